"""What an agent key may do over the network: the one layer the HTTP API and the MCP tools
share.

Each function takes the authenticated `AgentKey` first, fetches what it acts on through
`ledger.selectors` (the desk's own fetch-and-check: another tenant's object is `NotFound`,
exactly like a missing one), calls the same `ledger` function a Python agent calls, with
the key's name as the actor, and returns the noun's JSON shape (`ledger.shapes`). No rule
of the ledger is restated here: every refusal is the ledger's own `LedgerError`, which each
surface turns into its error format.
"""

from __future__ import annotations

import inspect
from datetime import datetime, timedelta
from typing import Any

from ledger import (
    access,
    agent_keys,
    approvals,
    canonical,
    facts,
    notifications,
    obligations,
    receipts,
    runs,
    selectors,
    shapes,
    states,
)
from ledger.errors import (
    InFlight,
    InvalidInput,
    LedgerError,
    NotFound,
    PermissionDenied,
)
from ledger.inputs import check_identifier, check_optional_identifier, check_paths
from ledger.models import AgentKey, Obligation, Operation, Run
from ledger.states import RetryPolicy

# Whether this ledger has the in-flight window (`mark_submitted(in_flight_for=...)`).
HAS_IN_FLIGHT_WINDOW = "in_flight_for" in inspect.signature(receipts.mark_submitted).parameters

MAX_PAGE = selectors.MAX_PAGE_SIZE
OUTCOMES = states.AGENT_OUTCOMES


# --- arguments from the network --------------------------------------------------------
#
# Every argument goes through the ledger's one gate (`ledger.inputs`): here for what this
# layer itself looks up before calling the ledger, in the ledger for the rest. A NUL or an
# unpaired surrogate in a name is refused (InvalidInput, 422); in free text (a detail, an
# objective) it is recorded as U+FFFD by the ledger.

# Longest in-flight window or lease an agent may ask for over the network, in seconds.
MAX_SECONDS = 7 * 24 * 3600


def _seconds(value: float | None, name: str, *, most: float | None = MAX_SECONDS
             ) -> timedelta | None:
    """Seconds as a timedelta (None stays None), from 0 to `most` (None: the ledger checks
    the range itself); InvalidInput for anything else."""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, int | float) or value != value
            or (most is not None and not 0 <= value <= most)):
        expected = "a number of seconds" + (f" from 0 to {most:g}" if most is not None else "")
        raise InvalidInput(f"expected {name} to be {expected}, found {value!r}")
    try:
        return timedelta(seconds=value)
    except OverflowError:
        raise InvalidInput(f"expected {name} to be a number of seconds, found "
                           f"{value!r}") from None


# --- fetch and check ---------------------------------------------------------------------
#
# The desk's helpers, an agent key as the principal (`ledger.selectors`).

access_operation = selectors.access_operation
access_run = selectors.access_run
access_obligation = selectors.access_obligation


def authenticate(secret: str, *, operation_id: str | None = None) -> AgentKey | None:
    """The live key whose secret this is, or None (malformed, unknown or revoked).

    With the `operation_id` of the request's path, the same statement also fetches that
    operation through the key's tenants, and `access_operation` of this key and id then
    answers from it instead of asking again (`agent_keys.authenticate`)."""
    return agent_keys.authenticate(secret, operation_id=operation_id)


def run_of(key: AgentKey, run_id: str, tenant: str | None = None) -> Run:
    """The run `run_id` the key may see; of `tenant` alone when named (which the key must
    be granted: PermissionDenied otherwise). Run ids are unique per tenant, so a key granted
    several tenants names the tenant of an id more than one of them uses."""
    return access_run(key, run_id,
                      tenant=None if tenant is None else tenant_for(key, tenant))


def tenant_for(key: AgentKey, tenant: str | None, *, named_by: str = "a tenant") -> str:
    """The tenant a write goes to: the one named (which the key must see), or the key's
    only tenant, or "default" when the key sees it. `named_by`: where the caller names it,
    for the refusal when it must and does not (the gateway: "[gateway] tenant")."""
    check_optional_identifier(tenant, "tenant", 100)
    if tenant is None:
        if len(key.tenants) == 1:
            return key.tenants[0]
        if "default" in key.tenants:
            return "default"
        raise InvalidInput(
            f"expected {named_by} (key {key.name} sees {sorted(key.tenants)}), found none"
        )
    if not access.can_see(key, tenant):
        raise PermissionDenied(
            f"expected key {key.name} to be granted tenant {tenant!r}, found it scoped to "
            f"{sorted(key.tenants)}"
        )
    return tenant


# --- operations --------------------------------------------------------------------------


def record(
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
    account: str | None = None,
    request_id: str | None = None,
) -> Operation:
    """The operation `receipts.record_intent` recorded or found for this key (its
    `recorded_now`, and with `submit` its `submitted_now`, say what this call did): what
    `record_intent` answers with, as the model, for a caller that goes on with it (the MCP
    gateway). A refusal of the submission is raised with the recorded operation on
    `.recorded_operation`."""
    run_obj = run_of(key, run, tenant) if run is not None else None
    if run_obj is not None and tenant is None:
        tenant = run_obj.tenant
    tenant = tenant_for(key, tenant)
    if not submit and (fencing_token is not None or in_flight_seconds is not None):
        raise InvalidInput("expected fencing_token and in_flight_seconds only with submit "
                           f"(found submit {submit!r}): mark it submitted to use them")
    submission: dict[str, Any] = {}
    if submit:
        # A new operation: recorded and submitted in one transaction (one commit).
        submission = {"submit": True, "fencing_token": fencing_token,
                      "request_id": request_id}
        if in_flight_seconds is not None:
            submission["in_flight_for"] = _seconds(in_flight_seconds, "in_flight_seconds")
    return receipts.record_intent(
        operation, target, intent, tenant=tenant, run=run_obj, step=step,
        idempotency_key=idempotency_key, call=call, fingerprint_fields=fingerprint_fields,
        redact=redact or (), retry_policy=retry_policy, actor=key.name, keep=keep,
        trace=trace, account=account or "",
        relies_on=[fact_version(tenant, ref) for ref in relies_on or ()],
        **submission,
    )


def record_intent(
    key: AgentKey, *, submit: bool = False, request_id: str | None = None, **arguments: Any
) -> tuple[dict[str, Any], bool]:
    """(the operation, whether this call recorded it); `arguments` as for `record`. Same key
    and intent: the existing operation, whatever its state (do not send again). `relies_on`:
    fact versions named by subject, predicate and version, of the operation's tenant.

    `submit`: the intent and its submission in one request (`receipts.record_intent(
    submit=True)`: a new operation in one transaction). An operation (new or found)
    that is planned or safe_to_retry is marked submitted, and `submitted_now` in the
    returned data says this request did it: the caller sends now. Any other state, or a
    concurrent caller that moved it first (StaleVersion): `submitted_now` is false and the
    state says why. A refusal of the submission (ApprovalRequired, StaleFencingToken,
    DependencyNotMet, ...) is raised with the recorded operation on `.operation_recorded`,
    which the problem carries: the intent stays recorded either way.

    `request_id` (with `submit`): the client's id of this request, repeated when it sends
    the request again after its answer was lost. The submission records its digest; a
    repeat that finds the operation still as that submission left it gets the same answer
    (`submitted_now` true, `request_repeated` true): the client that made the submission
    is the one sending, and it has not sent yet. Another id, or none: in flight."""
    try:
        op = record(key, submit=submit, request_id=request_id, **arguments)
    except LedgerError as exc:
        recorded = getattr(exc, "recorded_operation", None)
        if recorded is not None:  # the submission refused, the intent recorded
            exc.operation_recorded = operation_dict(recorded)
        raise
    recorded_now = op.recorded_now
    if not submit:
        return operation_dict(op), recorded_now
    if not op.submitted_now and op.state == states.State.SUBMITTED:
        # found submitted, or a concurrent caller submitted it first: in flight, unless it
        # is this request's own submission whose answer was lost (the same Request-Id)
        if request_id is not None and receipts.submitted_by_request(op, request_id, key.name):
            return shapes.recorded(op, submitted_now=True, request_repeated=True), False
        in_flight = InFlight.of(op)
        in_flight.operation_recorded = operation_dict(op)
        raise in_flight
    return shapes.recorded(op, submitted_now=op.submitted_now), recorded_now


def fact_version(tenant: str, ref: Any) -> Any:
    """The fact version {subject, predicate, version} of `tenant`, or NotFound."""
    if not isinstance(ref, dict) or set(ref) != {"subject", "predicate", "version"}:
        raise InvalidInput(f"expected each of relies_on to be {{subject, predicate, "
                           f"version}}, found {ref!r}"[:300])
    return selectors.fact_version(tenant, subject=ref["subject"], predicate=ref["predicate"],
                                  version=ref["version"])


def mark(key: AgentKey, operation_id: str, outcome: str, **arguments: Any) -> dict[str, Any]:
    """Record how the operation's call went (`outcome` one of OUTCOMES; `arguments` as for
    `mark_operation`): the operation's shape."""
    return operation_dict(mark_operation(key, access_operation(key, operation_id), outcome,
                                         **arguments))


def mark_operation(
    key: AgentKey,
    op: Operation,
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
) -> Operation:
    """Record how `op`'s call went (`outcome` one of OUTCOMES), the key's name the actor:
    `op` as the key's own `record` or `access_operation` gave it (an operation of a tenant
    the key does not see is NotFound, as there). Returns it as the write left it."""
    _check_own(key, op)
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
        return receipts.mark_submitted(op, **common)
    if outcome == "succeeded":
        return receipts.mark_succeeded(op, external_id=external_id, evidence=evidence,
                                       result=result, result_unstorable=result_unstorable,
                                       **common)
    if outcome == "rejected":
        return receipts.mark_rejected(op, error_code=error_code, detail=detail, **common)
    if outcome == "outcome_unknown":
        return receipts.mark_outcome_unknown(op, error_code=error_code, detail=detail,
                                             **common)
    raise InvalidInput(f"expected an outcome among {list(OUTCOMES)}, found {outcome!r}")


def _check_own(key: AgentKey, op: Operation) -> None:
    """NotFound, as `access_operation` says it, for an operation of a tenant `key` does not
    see (no query: the key carries its tenants)."""
    if not access.can_see(key, op.tenant):
        raise NotFound(f"expected operation {op.operation_id!r} among the tenants you may "
                       "see, found none")


def get_operation(key: AgentKey, operation_id: str) -> dict[str, Any]:
    """The receipt with its events (oldest first), evidence and approval status (the gate,
    the request). One query (`selectors.operation_receipt`), two with `access_operation`'s
    own look-up (none when the key's authentication read the operation)."""
    found = selectors.operation_receipt(key, operation_id)
    return shapes.operation_detail(found.operation, events=found.events,
                                   evidence_rows=found.evidence, approval_status=found.approval)


def request_approval(key: AgentKey, operation_id: str, *, note: str = "") -> dict[str, Any]:
    """Put the planned operation on the desk's "Awaiting approval" list with the agent's
    note (`ask_approval`); the operation with its approval status. Then poll GET
    operations/{id} until `approval.status` is `approved` (send) or `denied` (do not;
    `approval.denied_reason` says why)."""
    op = ask_approval(key, access_operation(key, operation_id), note=note)
    data = operation_dict(op)
    data["approval"] = approval_dict(op)
    return data


def ask_approval(key: AgentKey, op: Operation, *, note: str = "",
                 unless_pending: bool = False) -> Operation:
    """`ledger.approvals.request` of `op` (as for `mark_operation`), the key's name as who
    asked; the operation as it is now. `unless_pending`: nothing is written while a request
    of it is still pending (a caller asking at every repeat of a call keeps the first
    request's note and time on the desk)."""
    _check_own(key, op)
    if unless_pending and selectors.approval_pending(op):
        return op
    return approvals.request(op, note=note, actor=key.name)


async def await_approval(key: AgentKey, op: Operation, *, timeout: float) -> Operation:
    """`ledger.approvals.await_decision` of `op` (as for `mark_operation`): the operation as
    approved (a reviewer may have edited it), ApprovalDenied, or ApprovalRequired when
    `timeout` seconds pass first. The event loop runs on while it waits."""
    _check_own(key, op)
    return await approvals.await_decision(op, timeout=timeout)


def approval_dict(op: Operation) -> dict[str, Any]:
    """Where the operation stands with approvals (one query; `selectors.approval_status`,
    shaped as `shapes.approval`)."""
    return shapes.approval(selectors.approval_status(op))


def list_operations(
    key: AgentKey,
    *,
    state: str | None = None,
    operation: str | None = None,
    tenant: str | None = None,
    cursor: str | None = None,
    limit: int = 50,
    idempotency_key: str | None = None,
    account: str | None = None,
) -> dict[str, Any]:
    """Newest first, keyset-paged on the operation id: `next_cursor` is the id to pass as
    `cursor` for the next page (None on the last). One query per page. `idempotency_key`
    (with `operation`): a call's receipt, looked up without recording anything."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise InvalidInput(f"expected limit between 1 and {MAX_PAGE}, found {limit!r}")
    for name, value in (("state", state), ("operation", operation), ("tenant", tenant),
                        ("cursor", cursor), ("idempotency_key", idempotency_key),
                        ("account", account)):
        check_optional_identifier(value, name, 200)
    if tenant is not None:  # a tenant the key is not granted is refused, not an empty page
        tenant = tenant_for(key, tenant)
    page = selectors.operations_page(key, state=state, operation=operation, tenant=tenant,
                                     idempotency_key=idempotency_key, account=account,
                                     cursor=cursor or "",
                                     per_page=limit)
    return shapes.operation_page(page.items, page.next_cursor)


def desk_url(op: Operation) -> str:
    """The desk page of `op`: where a person sees it, and settles what the ledger cannot."""
    return notifications.desk_link(f"operations/{op.operation_id}/")


# --- an agent's earlier calls (the MCP gateway's default key) ------------------------------


def earlier_call(
    key: AgentKey, tenant: str, operation: str, intent: dict[str, Any], *,
    redact: list[str] | None = None, fingerprint_fields: list[str] | None = None,
) -> selectors.EarlierCall | None:
    """The last call of `operation` in `tenant` (which the key must see) with the
    fingerprint `record` would give `intent` (`redact` and `fingerprint_fields` as there), or
    None: `selectors.earlier_call`."""
    tenant = tenant_for(key, tenant)
    fields = None if fingerprint_fields is None else check_paths(fingerprint_fields,
                                                                 "fingerprint_fields")
    stored = canonical.redact(intent, check_paths(redact or (), "redact"))
    return selectors.earlier_call(tenant, operation, canonical.fingerprint(stored, fields))


def call_between(key: AgentKey, tenant: str, after: selectors.EarlierCall, *, gateway: str,
                 resources: list[str] | None = None) -> selectors.EarlierCall | None:
    """The first call through `gateway` after `after` of the same operation by this key, or
    naming one of `resources`, in `tenant` (which the key must see):
    `selectors.call_between`."""
    return selectors.call_between(tenant_for(key, tenant), after, gateway=gateway,
                                  caller=key.name, resources=resources or ())


# --- facts -------------------------------------------------------------------------------


def read_facts(key: AgentKey, subject: str, *, tenant: str | None = None,
               include_expired: bool = False) -> list[dict]:
    """Current, unexpired versions; with `include_expired`, expired ones too, marked
    `expired: true`."""
    return [fact_dict(f) for f in facts.read_facts(subject, tenant=tenant_for(key, tenant),
                                                   include_expired=include_expired)]


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
    expires_at: datetime | None = None,
    ttl_seconds: float | None = None,
) -> dict[str, Any]:
    """The fact's source is always the key's name (with the agent's own `source` after a
    slash), so an agent can neither speak for another nor for a reviewer. `ttl_seconds`:
    how long from now the fact stays current."""
    run_obj = run_of(key, run, tenant) if run is not None else None
    if run_obj is not None and tenant is None:
        tenant = run_obj.tenant
    check_optional_identifier(source, "source", 400)
    fact = facts.assert_fact(
        subject, predicate, value, source=key.name + (f"/{source}" if source else ""),
        observed_at=observed_at, expected_version=expected_version,
        tenant=tenant_for(key, tenant), run=run_obj, fencing_token=fencing_token,
        expires_at=expires_at, ttl=_seconds(ttl_seconds, "ttl_seconds", most=None),
    )
    return fact_dict(fact)


# --- runs and obligations ----------------------------------------------------------------


def start_run(
    key: AgentKey, *, objective: str, tenant: str | None = None, run_id: str | None = None
) -> dict[str, Any]:
    check_optional_identifier(run_id, "run_id", 100)
    # Run ids are unique per tenant: another tenant's run of that id is neither seen nor hit.
    run = runs.start(objective, tenant=tenant_for(key, tenant), run_id=run_id)
    return run_dict(run)


def add_step(
    key: AgentKey, run_id: str, *, step_id: str, depends_on: list[str] | None = None,
    tenant: str | None = None, fencing_token: int | None = None,
) -> dict[str, Any]:
    """Once the run is leased, only under the lease's current token (StaleFencingToken)."""
    run = run_of(key, run_id, tenant)
    step = runs.add_step(run, step_id, depends_on=depends_on or (),
                         fencing_token=fencing_token)
    return shapes.step(step, run=run, depends_on=depends_on or ())


def resume(key: AgentKey, run_id: str, *, ttl_seconds: float | None = None,
           worker: str | None = None, tenant: str | None = None) -> dict[str, Any]:
    """Take the run's lease for this key's agent (`<key name>/<worker>` when a worker is
    named, so that two workers of one key fence each other); the view carries the fencing
    `token`."""
    run = run_of(key, run_id, tenant)
    check_optional_identifier(worker, "worker", 100)
    kwargs = {}
    if ttl_seconds is not None:
        kwargs["ttl"] = _seconds(ttl_seconds, "ttl_seconds")
    owner = key.name + (f"/{worker}" if worker else "")
    return shapes.hand_off(runs.resume(run, worker=owner, **kwargs))


def open_obligation(
    key: AgentKey,
    *,
    run: str,
    kind: str,
    obligation_key: str,
    deadline: datetime | None = None,
    fencing_token: int | None = None,
    tenant: str | None = None,
) -> dict[str, Any]:
    run_obj = run_of(key, run, tenant)
    check_identifier(obligation_key, "obligation_key", 200)
    obligation = obligations.open(run_obj, kind, obligation_key, deadline=deadline,
                                  fencing_token=fencing_token)
    return obligation_dict(obligation, run_obj)


def commit_obligation(
    key: AgentKey, obligation_key: str, *, result: Any, fencing_token: int | None = None,
    tenant: str | None = None,
) -> dict[str, Any]:
    """Exactly once: a later or concurrent commit gets AlreadyCommitted with the winner's
    result. `tenant`: as for `run_of`."""
    found = access_obligation(
        key, obligation_key, tenant=None if tenant is None else tenant_for(key, tenant))
    obligation = obligations.commit(found.key, result, fencing_token=fencing_token,
                                    tenant=found.tenant)
    return obligation_dict(obligation, None)


# --- what the surfaces return: the shapes of `ledger.shapes` ------------------------------

operation_dict = shapes.operation
event_dict = shapes.event
evidence_dict = shapes.evidence
fact_dict = shapes.fact
run_dict = shapes.run


def obligation_dict(obligation: Obligation, run: Run | None) -> dict[str, Any]:
    return shapes.obligation(obligation, run=run)
