"""What an agent key may do over the network: the one layer the HTTP API and the MCP tools
share.

Each function takes the authenticated `AgentKey` first, fetches what it acts on through a
tenant-checked look-up (another tenant's object is `NotFound`, exactly like a missing one),
calls the same `ledger` function a Python agent calls, with the key's name as the actor,
and returns plain JSON-ready data. No rule of the ledger is restated here: every refusal is
the ledger's own `LedgerError`, which each surface turns into its error format.
"""

from __future__ import annotations

import inspect
from datetime import datetime, timedelta
from typing import Any

from ledger import access, agent_keys, approvals, facts, obligations, receipts, rows, runs
from ledger.errors import InvalidInput, LedgerError, NotFound, PermissionDenied, StaleVersion
from ledger.inputs import check_identifier, check_optional_identifier
from ledger.models import (
    AgentKey,
    ApprovalRequest,
    Evidence,
    Fact,
    Obligation,
    Operation,
    OperationEvent,
    Run,
)
from ledger.prepared import prepared_cursor
from ledger.selectors.approvals import gate
from ledger.states import RetryPolicy, State

# Whether this ledger has the in-flight window (`mark_submitted(in_flight_for=...)`).
HAS_IN_FLIGHT_WINDOW = "in_flight_for" in inspect.signature(receipts.mark_submitted).parameters

MAX_PAGE = 200
OUTCOMES = ("submitted", "succeeded", "rejected", "outcome_unknown")


# --- arguments from the network --------------------------------------------------------
#
# Every argument goes through the ledger's one gate (`ledger.inputs`): here for what this
# layer itself looks up before calling the ledger, in the ledger for the rest. A NUL or an
# unpaired surrogate in a name is refused (InvalidInput, 422); in free text (a detail, an
# objective) it is recorded as U+FFFD by the ledger.

# Longest in-flight window or lease an agent may ask for over the network, in seconds.
MAX_SECONDS = 7 * 24 * 3600


def _seconds(value: Any, name: str) -> timedelta:
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not 0 <= value <= MAX_SECONDS):
        raise InvalidInput(f"expected {name} to be a number of seconds from 0 to "
                           f"{MAX_SECONDS}, found {value!r}")
    return timedelta(seconds=value)


# --- fetch and check ---------------------------------------------------------------------


def _visible(key: AgentKey, rows):
    tenants = access.tenants_for(key)
    return rows if tenants is None else rows.filter(tenant__in=tenants)


_ACCESS_OPERATION = (
    f"SELECT {rows.OPERATION_COLUMNS} FROM {Operation._meta.db_table}"
    " WHERE operation_id = %s AND (%s OR tenant = ANY(%s))"
)


def authenticate(secret: str, *, operation_id: str | None = None) -> AgentKey | None:
    """The live key whose secret this is, or None (malformed, unknown or revoked).

    With the `operation_id` of the request's path, the same statement also fetches that
    operation through the key's tenants (`agent_keys.authenticate_with_operation`), and
    `access_operation` of this key and id then answers from it instead of asking again:
    one round trip to PostgreSQL less on every request that acts on one operation.
    """
    if operation_id is None or not _well_formed_operation_id(operation_id):
        return agent_keys.authenticate(secret)  # access_operation refuses a bad id itself
    key, found = agent_keys.authenticate_with_operation(secret, operation_id)
    if key is not None:
        key._operation_read = (operation_id, found)
    return key


def _well_formed_operation_id(operation_id: Any) -> bool:
    if not isinstance(operation_id, str) or not 0 < len(operation_id) <= 40:
        return False
    try:
        check_identifier(operation_id, "operation_id", 40)
    except InvalidInput:
        return False
    return True


def access_operation(key: AgentKey, operation_id: str) -> Operation:
    """The operation if the key sees its tenant; NotFound otherwise (either way). On every
    mark of every agent: one prepared statement, without the ORM's query compilation, or
    none when the key's authentication already read it (`authenticate`); that read is
    used once, by the request it was made for."""
    if not isinstance(operation_id, str) or not 0 < len(operation_id) <= 40:
        raise NotFound(f"expected an operation id, found {operation_id!r}")
    check_identifier(operation_id, "operation_id", 40)
    read = key.__dict__.pop("_operation_read", None)
    if read is not None and read[0] == operation_id:
        found = read[1]
    else:
        tenants = access.tenants_for(key)
        with prepared_cursor() as cursor:
            cursor.execute(_ACCESS_OPERATION,
                           [operation_id, tenants is None, sorted(tenants or ())])
            row = cursor.fetchone()
        found = None if row is None else rows.operation_from_row(row)
    if found is None:
        raise NotFound(
            f"expected operation {operation_id!r} among the tenants you may see, found none"
        )
    return found


def access_run(key: AgentKey, run_id: str) -> Run:
    if not isinstance(run_id, str) or not 0 < len(run_id) <= 100:
        raise NotFound(f"expected a run id, found {run_id!r}")
    check_identifier(run_id, "run_id", 100)
    found = _visible(key, Run.objects.filter(run_id=run_id)).first()
    if found is None:
        raise NotFound(f"expected run {run_id!r} among the tenants you may see, found none")
    return found


def access_obligation(key: AgentKey, obligation_key: str) -> Obligation:
    if not isinstance(obligation_key, str) or not 0 < len(obligation_key) <= 200:
        raise NotFound(f"expected an obligation key, found {obligation_key!r}")
    check_identifier(obligation_key, "obligation_key", 200)
    found = _visible(key, Obligation.objects.filter(key=obligation_key)).first()
    if found is None:
        raise NotFound(
            f"expected obligation {obligation_key!r} among the tenants you may see, found none"
        )
    return found


def tenant_for(key: AgentKey, tenant: str | None) -> str:
    """The tenant a write goes to: the one named (which the key must see), or the key's
    only tenant, or "default" when the key sees it."""
    check_optional_identifier(tenant, "tenant", 100)
    if tenant is None:
        if len(key.tenants) == 1:
            return key.tenants[0]
        if "default" in key.tenants:
            return "default"
        raise InvalidInput(
            f"expected a tenant (key {key.name} sees {sorted(key.tenants)}), found none"
        )
    if not access.can_see(key, tenant):
        raise PermissionDenied(
            f"expected key {key.name} to be granted tenant {tenant!r}, found it scoped to "
            f"{sorted(key.tenants)}"
        )
    return tenant


# --- operations --------------------------------------------------------------------------


def record_intent(
    key: AgentKey,
    *,
    operation: str,
    target: str,
    intent: dict[str, Any],
    idempotency_key: str | None = None,
    tenant: str | None = None,
    run: str | None = None,
    step: str | None = None,
    call: str | None = None,
    retry_policy: str = RetryPolicy.IF_ABSENT_PROVEN,
    redact: list[str] | None = None,
    fingerprint_fields: list[str] | None = None,
    keep: list[str] | None = None,
    submit: bool = False,
    fencing_token: int | None = None,
    in_flight_seconds: float | None = None,
    trace: tuple[str, str] | None = None,
    relies_on: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], bool]:
    """(the operation, whether this call recorded it). Same key and intent: the existing
    operation, whatever its state (do not send again). `relies_on`: fact versions named by
    subject, predicate and version, of the operation's tenant.

    `submit`: the intent and its submission in one request. An operation (new or found)
    that is planned or safe_to_retry is marked submitted, and `submitted_now` in the
    returned data says this request did it: the caller sends now. Any other state, or a
    concurrent caller that moved it first (StaleVersion): `submitted_now` is false and the
    state says why. A refusal of the submission (ApprovalRequired, StaleFencingToken,
    DependencyNotMet, ...) is raised with the recorded operation on `.operation_recorded`,
    which the problem carries: the intent stays recorded either way."""
    run_obj = access_run(key, run) if run is not None else None
    if run_obj is not None and tenant is None:
        tenant = run_obj.tenant
    tenant = tenant_for(key, tenant)
    if not submit and (fencing_token is not None or in_flight_seconds is not None):
        raise InvalidInput("expected fencing_token and in_flight_seconds only with submit "
                           f"(found submit {submit!r}): mark it submitted to use them")
    op = receipts.record_intent(
        operation, target, intent, tenant=tenant, run=run_obj, step=step,
        idempotency_key=idempotency_key, call=call, fingerprint_fields=fingerprint_fields,
        redact=redact or (), retry_policy=retry_policy, actor=key.name, keep=keep,
        trace=trace,
        relies_on=[fact_version(tenant, ref) for ref in relies_on or ()],
    )
    recorded_now = op.recorded_now
    if not submit:
        return operation_dict(op), recorded_now
    submitted_now = False
    if op.state in (State.PLANNED, State.SAFE_TO_RETRY):
        marks: dict[str, Any] = {"fencing_token": fencing_token, "actor": key.name}
        if in_flight_seconds is not None:
            marks["in_flight_for"] = _seconds(in_flight_seconds, "in_flight_seconds")
        try:
            op = receipts.mark_submitted(op, **marks)
            submitted_now = True
        except StaleVersion as exc:
            op = exc.current or Operation.objects.get(pk=op.pk)
        except LedgerError as exc:
            exc.operation_recorded = operation_dict(op)
            raise
    return {**operation_dict(op), "submitted_now": submitted_now}, recorded_now


def fact_version(tenant: str, ref: Any) -> Fact:
    """The fact version {subject, predicate, version} of `tenant`, or NotFound."""
    if not isinstance(ref, dict) or set(ref) != {"subject", "predicate", "version"}:
        raise InvalidInput(f"expected each of relies_on to be {{subject, predicate, "
                           f"version}}, found {ref!r}"[:300])
    fact = Fact.objects.filter(tenant=tenant, subject=ref["subject"],
                               predicate=ref["predicate"], version=ref["version"]).first()
    if fact is None:
        raise NotFound(f"expected version {ref['version']} of fact {ref['subject']} "
                       f"{ref['predicate']} in tenant {tenant}, found none"[:500])
    return fact


def mark(
    key: AgentKey,
    operation_id: str,
    outcome: str,
    *,
    expected_version: int | None = None,
    fencing_token: int | None = None,
    in_flight_seconds: float | None = None,
    external_id: str | None = None,
    evidence: Any = None,
    result: Any = receipts.NO_RESULT,
    result_unstorable: str = "",
    error_code: str | None = None,
    detail: str = "",
) -> dict[str, Any]:
    """Record how the operation's call went (`outcome` one of OUTCOMES)."""
    op = access_operation(key, operation_id)
    common = {"fencing_token": fencing_token, "expected_version": expected_version,
              "actor": key.name}
    if outcome == "submitted":
        if in_flight_seconds is not None:
            if not HAS_IN_FLIGHT_WINDOW:
                raise InvalidInput(
                    "expected no in_flight_seconds (this ledger has no in-flight window), "
                    f"found {in_flight_seconds!r}"
                )
            common["in_flight_for"] = _seconds(in_flight_seconds, "in_flight_seconds")
        op = receipts.mark_submitted(op, **common)
    elif outcome == "succeeded":
        op = receipts.mark_succeeded(op, external_id=external_id, evidence=evidence,
                                     result=result, result_unstorable=result_unstorable,
                                     **common)
    elif outcome == "rejected":
        op = receipts.mark_rejected(op, error_code=error_code, detail=detail, **common)
    elif outcome == "outcome_unknown":
        op = receipts.mark_outcome_unknown(op, error_code=error_code, detail=detail, **common)
    else:
        raise InvalidInput(f"expected an outcome among {list(OUTCOMES)}, found {outcome!r}")
    return operation_dict(op)


def get_operation(key: AgentKey, operation_id: str) -> dict[str, Any]:
    """The receipt with its events (oldest first), evidence and approval status (the gate,
    the request). Four queries, five with `access_operation`'s own look-up (none when the
    key's authentication read the operation)."""
    op = access_operation(key, operation_id)
    data = operation_dict(op)
    data["approval"] = approval_dict(op)
    data["events"] = [
        event_dict(e) for e in OperationEvent.objects.filter(operation=op).order_by("version")
    ]
    data["evidence"] = [
        evidence_dict(e)
        for e in Evidence.objects.filter(operation=op).order_by("created_at", "id")
    ]
    return data


def request_approval(key: AgentKey, operation_id: str, *, note: str = "") -> dict[str, Any]:
    """Put the planned operation on the desk's "Awaiting approval" list with the agent's
    note (`ledger.approvals.request`, the key's name as who asked); the operation with its
    approval status. Then poll GET operations/{id} until `approval.status` is `approved`
    (send) or `denied` (do not; `approval.denied_reason` says why)."""
    op = access_operation(key, operation_id)
    op = approvals.request(op, note=note, actor=key.name)
    data = operation_dict(op)
    data["approval"] = approval_dict(op)
    return data


def approval_dict(op: Operation) -> dict[str, Any]:
    """Where the operation stands with approvals (two queries): `status` one of
    not_required, awaiting, approved, denied; `needed` people, `live` approvals of its
    current fingerprint, the policies asking, a denial's reason, the agent's request."""
    current = gate(op)
    asked = ApprovalRequest.objects.filter(operation_id=op.pk).first()
    if current.denial is not None:
        status = "denied"
    elif current.needed == 0:
        status = "not_required"
    elif current.state != "planned" or current.is_open:
        status = "approved"
    else:
        status = "awaiting"
    return {
        "status": status, "needed": current.needed, "live": current.have,
        "policies": current.patterns, "denied_reason": current.denial,
        "intent_fingerprint": current.intent_fingerprint,
        "requested": asked is not None,
        "note": asked.note if asked is not None else "",
        "requested_at": _iso(asked.requested_at) if asked is not None else None,
    }


def list_operations(
    key: AgentKey,
    *,
    state: str | None = None,
    operation: str | None = None,
    tenant: str | None = None,
    cursor: str | None = None,
    limit: int = 50,
    idempotency_key: str | None = None,
) -> dict[str, Any]:
    """Newest first, keyset-paged on the operation id: `next_cursor` is the id to pass as
    `cursor` for the next page (None on the last). One query per page. `idempotency_key`
    (with `operation`): a call's receipt, looked up without recording anything."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise InvalidInput(f"expected limit between 1 and {MAX_PAGE}, found {limit!r}")
    for name, value in (("state", state), ("operation", operation), ("tenant", tenant),
                        ("cursor", cursor), ("idempotency_key", idempotency_key)):
        check_optional_identifier(value, name, 200)
    rows = _visible(key, Operation.objects.select_related("run", "step"))
    if tenant is not None:  # a tenant the key is not granted is refused, not an empty page
        rows = rows.filter(tenant=tenant_for(key, tenant))
    if idempotency_key is not None:
        rows = rows.filter(idempotency_key=idempotency_key)
    if state is not None:
        rows = rows.filter(state=state)
    if operation is not None:
        rows = rows.filter(operation=operation)
    if cursor is not None:
        rows = rows.filter(operation_id__lt=cursor)
    page = list(rows.order_by("-operation_id")[: limit + 1])
    more = len(page) > limit
    page = page[:limit]
    return {
        "items": [operation_dict(op) for op in page],
        "next_cursor": page[-1].operation_id if more else None,
    }


# --- facts -------------------------------------------------------------------------------


def read_facts(key: AgentKey, subject: str, *, tenant: str | None = None) -> list[dict]:
    return [fact_dict(f) for f in facts.read_facts(subject, tenant=tenant_for(key, tenant))]


def assert_fact(
    key: AgentKey,
    *,
    subject: str,
    predicate: str,
    value: Any,
    source: str | None = None,
    observed_at: datetime | None = None,
    expected_version: int | None = None,
    tenant: str | None = None,
    run: str | None = None,
    fencing_token: int | None = None,
) -> dict[str, Any]:
    """The fact's source is always the key's name (with the agent's own `source` after a
    slash), so an agent can neither speak for another nor for a reviewer."""
    run_obj = access_run(key, run) if run is not None else None
    if run_obj is not None and tenant is None:
        tenant = run_obj.tenant
    check_optional_identifier(source, "source", 400)
    fact = facts.assert_fact(
        subject, predicate, value, source=key.name + (f"/{source}" if source else ""),
        observed_at=observed_at, expected_version=expected_version,
        tenant=tenant_for(key, tenant), run=run_obj, fencing_token=fencing_token,
    )
    return fact_dict(fact)


# --- runs and obligations ----------------------------------------------------------------


def start_run(
    key: AgentKey, *, objective: str, tenant: str | None = None, run_id: str | None = None
) -> dict[str, Any]:
    check_optional_identifier(run_id, "run_id", 100)
    if run_id is not None:
        existing = Run.objects.filter(run_id=run_id).only("tenant").first()
        if existing is not None and not access.can_see(key, existing.tenant):
            # Another tenant's run id: refused without saying whose it is.
            raise InvalidInput(f"expected run_id {run_id!r} to be new, found it taken")
    run = runs.start(objective, tenant=tenant_for(key, tenant), run_id=run_id)
    return run_dict(run)


def add_step(
    key: AgentKey, run_id: str, *, step_id: str, depends_on: list[str] | None = None
) -> dict[str, Any]:
    run = access_run(key, run_id)
    step = runs.add_step(run, step_id, depends_on=depends_on or ())
    return {"run_id": run.run_id, "step_id": step.step_id, "state": step.state,
            "depends_on": sorted(depends_on or ())}


def resume(key: AgentKey, run_id: str, *, ttl_seconds: float | None = None,
           worker: str | None = None) -> dict[str, Any]:
    """Take the run's lease for this key's agent (`<key name>/<worker>` when a worker is
    named, so that two workers of one key fence each other); the view carries the fencing
    `token`."""
    run = access_run(key, run_id)
    check_optional_identifier(worker, "worker", 100)
    kwargs = {}
    if ttl_seconds is not None:
        kwargs["ttl"] = _seconds(ttl_seconds, "ttl_seconds")
    owner = key.name + (f"/{worker}" if worker else "")
    return runs.resume(run, worker=owner, **kwargs).as_dict()


def open_obligation(
    key: AgentKey,
    *,
    run: str,
    kind: str,
    obligation_key: str,
    deadline: datetime | None = None,
    fencing_token: int | None = None,
) -> dict[str, Any]:
    run_obj = access_run(key, run)
    check_identifier(obligation_key, "obligation_key", 200)
    existing = Obligation.objects.filter(key=obligation_key).only("tenant").first()
    if existing is not None and not access.can_see(key, existing.tenant):
        raise InvalidInput(f"expected obligation key {obligation_key!r} to be new, found it "
                           "taken")
    obligation = obligations.open(run_obj, kind, obligation_key, deadline=deadline,
                                  fencing_token=fencing_token)
    return obligation_dict(obligation, run_obj)


def commit_obligation(
    key: AgentKey, obligation_key: str, *, result: Any, fencing_token: int | None = None
) -> dict[str, Any]:
    """Exactly once: a later or concurrent commit gets AlreadyCommitted with the winner's
    result."""
    found = access_obligation(key, obligation_key)
    obligation = obligations.commit(found.key, result, fencing_token=fencing_token)
    return obligation_dict(obligation, None)


# --- what the surfaces return ------------------------------------------------------------


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def operation_dict(op: Operation) -> dict[str, Any]:
    return {
        "operation_id": op.operation_id,
        "tenant": op.tenant,
        "operation": op.operation,
        "target": op.target,
        "state": op.state,
        "version": op.version,
        "attempt": op.attempt,
        "idempotency_key": op.idempotency_key,
        "intent_fingerprint": op.intent_fingerprint,
        "external_id": op.external_id,
        "intent": op.intent,
        "retry_policy": op.retry_policy,
        "error_code": op.error_code,
        "error_detail": op.error_detail,
        "conflict": op.conflict,
        "authentication_recorded": op.authentication_recorded,
        "run_id": op.run.run_id if op.run_id else None,
        "step_id": op.step.step_id if op.step_id else None,
        "created_at": _iso(op.created_at),
        "state_changed_at": _iso(op.state_changed_at),
        "submitted_at": _iso(op.submitted_at),
        "in_flight_until": _iso(op.in_flight_until),
        "completed_at": _iso(op.completed_at),
        "result": op.result,
        "result_unstorable": op.result_unstorable,
        "trace_id": op.trace_id,
        "span_id": op.span_id,
    }


def event_dict(event: OperationEvent) -> dict[str, Any]:
    return {
        "version": event.version,
        "from_state": event.from_state,
        "to_state": event.to_state,
        "actor_kind": event.actor_kind,
        "actor_id": event.actor_id,
        "reason": event.reason,
        "evidence": event.evidence,
        "fencing_token": event.fencing_token,
        "created_at": _iso(event.created_at),
    }


def evidence_dict(evidence: Evidence) -> dict[str, Any]:
    return {
        "reconciler": evidence.reconciler,
        "query": evidence.query,
        "observed": evidence.observed,
        "verdict": evidence.verdict,
        "matched_by": evidence.matched_by,
        "detail": evidence.detail,
        "created_at": _iso(evidence.created_at),
    }


def fact_dict(fact: Fact) -> dict[str, Any]:
    conflict = getattr(fact, "conflict", None) if fact.is_candidate else None
    return {
        "tenant": fact.tenant,
        "subject": fact.subject,
        "predicate": fact.predicate,
        "value": fact.value,
        "version": fact.version,
        "status": fact.status,
        "source": fact.source,
        "observed_at": _iso(fact.observed_at),
        "run_id": fact.run.run_id if fact.run_id else None,
        "is_candidate": fact.is_candidate,
        "conflict_id": conflict.pk if conflict is not None else None,
    }


def run_dict(run: Run) -> dict[str, Any]:
    return {"run_id": run.run_id, "tenant": run.tenant, "objective": run.objective}


def obligation_dict(obligation: Obligation, run: Run | None) -> dict[str, Any]:
    run = run or obligation.run
    return {
        "key": obligation.key,
        "kind": obligation.kind,
        "run_id": run.run_id,
        "tenant": obligation.tenant,
        "state": obligation.state,
        "deadline": _iso(obligation.deadline),
        "result": obligation.result,
        "committed_at": _iso(obligation.committed_at),
    }
