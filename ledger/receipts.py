"""Action receipts: record the intent before the call, then its outcome.

The public API of agents and reviewers: it checks the input (and a person's rights), then
hands the change to `ledger.transitions`, which writes every change of an operation (a
compare-and-set on (state, version) plus one OperationEvent, in one statement). A
transport failure after submission is `outcome_unknown`, never "failed"; nothing here ever
retries or sends anything.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any
from urllib.parse import quote

from django.db import DatabaseError, transaction
from django.db.models import Q
from django.utils import timezone

from ledger import (
    access,
    approvals,
    conf,
    facts,
    rows,
    runs,
    states,
    tracing,
    transitions,
    validation,
)
from ledger.canonical import canonical_json, fingerprint, redact, scrub_text
from ledger.canonical import keep as keep_fields
from ledger.errors import (
    IdempotencyKeyReused,
    IllegalTransition,
    InvalidInput,
    LedgerError,
    StaleVersion,
    ValidationRefused,
)
from ledger.inputs import (
    PG_BIGINT_MAX,
    check_choice,
    check_duration,
    check_identifier,
    check_json,
    check_operation_name,
    check_optional_identifier,
    check_paths,
    check_reason,
    check_string,
    check_user,
    check_version,
    check_whole_number,
    describe_exception,
    storable_text,
)
from ledger.models import Fact, Operation, Run, Step
from ledger.models.execution import FactStatus
from ledger.models.operations import Conflict, OperationEvent
from ledger.prepared import prepared_cursor
from ledger.states import ActorKind, RetryPolicy, State


def new_operation_id(now=None) -> str:
    """Sortable id: UTC time to the second, then 10 random hex digits."""
    now = now or timezone.now()
    return f"{now:%Y%m%dT%H%M%SZ}-{secrets.token_hex(5)}"


def idempotency_key(run_id: str, step_id: str, call: str | None = None) -> str:
    """The key of a step's operation, derived from the run and the step: the same inputs
    give the same key in any process, so a step re-run after a crash finds its receipt.

    Format: `run:<run_id>/step:<step_id>`, then `/call:<call>` when `call` tells apart
    several calls of one operation in one step; each part percent-encoded (`/` is `%2F`,
    `%` is `%25`: no two inputs share a key). A key longer than the 200 characters a key may
    have is `run-step:sha256:<hex digest of that text>`.
    """
    check_identifier(run_id, "run_id")
    check_identifier(step_id, "step_id")
    parts = [f"run:{_key_part(run_id)}", f"step:{_key_part(step_id)}"]
    if call is not None:
        parts.append(f"call:{_key_part(check_identifier(call, 'call', 200))}")
    key = "/".join(parts)
    if len(key) > _MAX_KEY:
        key = f"run-step:sha256:{hashlib.sha256(key.encode()).hexdigest()}"
    return key


_MAX_KEY = 200


def _key_part(value: str) -> str:
    return quote(value, safe="")


# --- recording the intent ----------------------------------------------------------------


def record_intent(
    operation: str,
    target: str,
    intent: Mapping[str, Any],
    *,
    tenant: str = "default",
    run: Run | str | None = None,
    step: Step | str | None = None,
    idempotency_key: str | None = None,
    fingerprint_fields: Iterable[str] | None = None,
    redact: Iterable[str] = (),
    retry_policy: str = RetryPolicy.IF_ABSENT_PROVEN,
    actor: str | None = None,
    call: str | None = None,
    keep: Iterable[str] | None = None,
    trace: tuple[str, str] | None = None,
    relies_on: Iterable[Fact] = (),
    submit: bool = False,
    fencing_token: int | None = None,
    in_flight_for: timedelta | None = None,
    account: str = "",
    request_id: str | None = None,
) -> Operation:
    """Record a planned operation before the external call; returns it in state `planned`.

    `submit=True`: the intent and its submission at once, as `mark_submitted` would make
    it (`fencing_token`, `in_flight_for` and every rule as there): a new operation is
    recorded and marked submitted in one transaction, one commit; one found planned or
    safe_to_retry is marked submitted. `op.submitted_now` says whether this call did it:
    the caller sends now. False: the operation found is in another state, or a concurrent
    caller moved it first (its state as found); never send then. A refusal of the
    submission (ApprovalRequired, StaleFencingToken, DependencyNotMet, StaleFact, ...) is
    raised with the intent recorded (planned), the operation on the error's
    `.recorded_operation`. `request_id`: as for `mark_submitted`, named (as its digest) on
    the submission's event.

    `account`: which account at the provider the call acts as (a Stripe account id, a
    mailbox, the provider's tenant), beside `target`: a non-secret label (credentials in
    it are masked like the target's), stored and under the chain, never changed after.
    Reconcilers read as it, and a positive control is an effect of the same target and
    account. It is part of the key's identity, not of the fingerprint (the fingerprint is
    the intent's, matched against what a service lists): the same key with another account
    is another action, IdempotencyKeyReused.

    `trace`: the (trace id, span id) the operation belongs to, stored on a new operation
    for the desk's trace link; by default those of the current OpenTelemetry span, if any
    (`ledger.tracing`).

    The idempotency key: `idempotency_key` when given; else, with a run and a step, the key
    derived from them (`idempotency_key(run_id, step_id, call)`: a step re-run after a
    crash finds its receipt instead of recording a second one); else a generated one.
    `call` (only with a run and a step, and no key) tells apart several calls of one
    operation in one step. Not fenced: a planned receipt has no effect; every change of it
    is (`mark_submitted` ...).

    `keep` (dotted paths, e.g. ["amount", "customer.id", "items.sku"]): only those fields of
    the intent are stored and fingerprinted; the rest never reach the database. Secrets
    (keys naming them at any depth, the dotted `redact` paths, and credentials in text:
    `canonical.scrub_text`) are replaced before anything is written, kept fields included.

    `relies_on` (saved Fact versions, e.g. from `facts.read_facts`): the facts the action
    was planned on. Each must be current now (StaleFact, nothing written); the versions
    are stored, and `mark_submitted` refuses to send once one of them is superseded
    (PostgreSQL too). A replay of the key returns the receipt with the versions it
    recorded first.

    With the same (tenant, operation, key) and the same fingerprint it returns the existing
    operation, whatever its state: the caller must not send again. Same key, other
    fingerprint: IdempotencyKeyReused. Bad input raises InvalidInput (a ValueError) and
    writes nothing. `op.recorded_now` says whether this call recorded it (True) or found it
    (False), also when concurrent callers race on one key.
    """
    redact_paths = check_paths(redact, "redact")
    kept = None if keep is None else check_paths(keep, "keep")
    fields = None if fingerprint_fields is None else check_paths(fingerprint_fields,
                                                                 "fingerprint_fields")
    check_operation_name(operation)
    target = check_string(target, "target", 2000)
    target = scrub_text(target and check_identifier(target, "target", 2000))
    account = check_account(account)
    check_identifier(tenant, "tenant", 100)
    check_choice(retry_policy, "retry_policy", RetryPolicy.values)
    check_optional_identifier(actor, "actor", 200)
    if not isinstance(intent, Mapping):
        raise InvalidInput(
            f"expected intent to be a JSON object (a dict), found {type(intent).__name__}"
        )
    check_json(intent, what="intent")
    if submit:
        _check_mark_args(fencing_token, in_flight_for)
    elif fencing_token is not None or in_flight_for is not None:
        raise InvalidInput("expected fencing_token and in_flight_for only with submit=True "
                           "(found submit=False): mark it submitted to use them")
    relied = _relied_on(relies_on, tenant)
    if kept is not None:
        intent = keep_fields(intent, kept)
    stored_intent = _redact_intent(intent, redact_paths)
    intent_fingerprint = fingerprint(stored_intent, fields)
    _check_run_and_step(run, step)
    run_obj, step_obj = runs.as_run_and_step(run, step, tenant=tenant)
    if call is not None and (idempotency_key is not None or step_obj is None):
        raise InvalidInput(
            "expected call= only with a run and a step and no idempotency_key (it tells "
            "apart the derived keys of several calls in one step), found "
            + ("an explicit idempotency_key" if idempotency_key is not None else
               "no step")
        )
    if idempotency_key is None and step_obj is not None:
        idempotency_key = _derived_key(run_obj, step_obj, call)
    elif idempotency_key is None:
        idempotency_key = f"gen-{secrets.token_hex(16)}"
    check_identifier(idempotency_key, "idempotency_key", 200)

    trace = tracing.check_ids(trace) or tracing.current_ids() or ("", "")

    # The operation id is generated once per call: a row found later under this call's key
    # with this id is this call's own, written by a try whose answer was lost
    # (transitions.riding_lost_answers).
    now = timezone.now()
    generated = new_operation_id(now)

    def new() -> Operation:
        return Operation(
            operation_id=generated,
            trace_id=trace[0],
            span_id=trace[1],
            tenant=tenant,
            operation=operation,
            target=target,
            account=account,
            intent=stored_intent,
            intent_fingerprint=intent_fingerprint,
            idempotency_key=idempotency_key,
            retry_policy=retry_policy,
            run=run_obj,
            step=step_obj,
            relies_on=relied,
            created_at=now,
            state_changed_at=now,
        )

    def found(existing: Operation | None) -> Operation | None:
        if existing is not None and existing.account != account:
            raise IdempotencyKeyReused(
                f"expected idempotency key {idempotency_key!r} of {operation} to come with "
                f"account {existing.account!r}, found {account!r}; the key already names "
                f"operation {existing.operation_id} ({existing.state}), acting as another "
                "account",
                existing=existing,
            )
        if existing is not None and existing.intent_fingerprint != intent_fingerprint:
            raise IdempotencyKeyReused(
                f"expected idempotency key {idempotency_key!r} of {operation} to come with "
                f"fingerprint {existing.intent_fingerprint}, found {intent_fingerprint}; "
                f"the key already names operation {existing.operation_id} "
                f"({existing.state})",
                existing=existing,
            )
        return existing

    def recorded() -> Operation:
        # Each statement below stands alone (see transitions.single_statement): the look-up
        # spares a replay the insert (bench/ P4: a replay is a third of a first record),
        # and the insert keeps the key unique by itself. Retried when PostgreSQL's answer
        # is lost: the look-up then finds the row an earlier try committed, and the
        # generated id says it is this call's own (`landed_before`: written by a try of
        # this call whose answer never came).
        def write() -> Operation:
            with transitions.single_statement():
                existing = found(_existing(tenant, operation, idempotency_key))
                if existing is None:
                    candidate = new()
                    # A concurrent recorder of the same key loses quietly (nothing written)
                    # and reads the winner's row below.
                    if transitions.record(candidate, actor=actor or ""):
                        candidate.recorded_now = True
                        candidate.landed_before = False
                        return candidate
                    existing = found(_existing(tenant, operation, idempotency_key))
                existing.recorded_now = existing.landed_before = (
                    existing.operation_id == generated)
                return existing

        return transitions.riding_lost_answers(write)

    if not submit:
        return recorded()
    candidate = new()
    if validation.has_checks() and validation.refusal(candidate):
        # Refused by its kind's checks: the intent alone (or the operation its key already
        # names), then mark_submitted records the refusal (abandoned, with the reason) and
        # raises ValidationRefused.
        return _submitted_now(recorded(), actor=actor, fencing_token=fencing_token,
                              in_flight_for=in_flight_for, request_id=request_id)
    # The intent and its submission first, without a look-up: a new key, an action's
    # common case, is one round trip (P1's 2-commit lifecycle: 0.93x its time with the
    # look-up first). A key already taken writes nothing there (the insert finds it taken,
    # the change finds no new row), and only then is its row read: a replay of a submitted
    # action is one round trip more.
    changes, reason = _submission(candidate, in_flight_for, request_id)
    taken = False
    try:
        if transitions.record_and_submit(candidate, actor=actor or "", reason=reason,
                                         changes=changes, fencing_token=fencing_token):
            candidate.recorded_now = candidate.submitted_now = True
            return candidate
        taken = True
    except (LedgerError, DatabaseError):
        # The submission refused (rolled back with the intent), or its answer lost: the
        # intent alone, then the submission apart, which says why (as mark_submitted
        # always has).
        pass
    op = (found(transitions.riding_lost_answers(
        lambda: _existing(tenant, operation, idempotency_key))) if taken else None)
    if op is None:
        op = recorded()
        if (op.landed_before and op.state == states.State.SUBMITTED and op.version == 2):
            # The intent and its submission committed together, and the answer was lost:
            # only this call writes a row with this id, so the submission is this call's.
            op.submitted_now = True
            return op
    return _submitted_now(op, actor=actor, fencing_token=fencing_token,
                          in_flight_for=in_flight_for, request_id=request_id)


def _submitted_now(op: Operation, *, actor, fencing_token, in_flight_for,
                   request_id=None) -> Operation:
    """`record_intent(submit=True)` of an operation recorded or found apart: marked submitted
    when planned or safe_to_retry; `submitted_now` says whether this call did it."""
    op.submitted_now = False
    if op.state not in states.SENDABLE:
        return op
    try:
        submitted = mark_submitted(op, fencing_token=fencing_token, actor=actor,
                                   in_flight_for=in_flight_for, request_id=request_id)
    except StaleVersion as exc:
        # A concurrent caller moved it first: its state as found, not sent by this one.
        current = exc.current or Operation.objects.filter(pk=op.pk).first() or op
        current.recorded_now = op.recorded_now
        current.submitted_now = False
        return current
    except ValidationRefused as exc:  # recorded abandoned, with the validator's reason
        exc.recorded_operation = exc.operation or op
        raise
    except LedgerError as exc:
        exc.recorded_operation = op
        raise
    submitted.submitted_now = True
    return submitted


def check_account(account: Any) -> str:
    """The provider account label `account` as stored: "" for none; credentials in it
    masked (`scrub_text`); InvalidInput when it is not a short identifier."""
    if account is None:
        return ""
    account = check_string(account, "account", 200)
    return scrub_text(account and check_identifier(account, "account", 200))


def _relied_on(relies_on: Any, tenant: str) -> list[int]:
    """The ids of the fact versions an action relies on, each checked current (StaleFact)."""
    if isinstance(relies_on, Fact | str | bytes | Mapping) or not isinstance(relies_on,
                                                                             Iterable):
        raise InvalidInput(f"expected relies_on to be a list of facts, found "
                           f"{type(relies_on).__name__}")
    relied = list(relies_on)
    for fact in relied:
        if not isinstance(fact, Fact) or fact.pk is None:
            raise InvalidInput(f"expected relies_on to hold saved Fact versions (as "
                               f"facts.read_facts returns them), found {fact!r}")
        if fact.tenant != tenant:
            raise InvalidInput(f"expected the facts an operation of tenant {tenant!r} relies "
                               f"on to be of that tenant, found {fact.subject} "
                               f"{fact.predicate} of {fact.tenant!r}")
    stale = _first_stale([fact.pk for fact in relied])
    if stale is not None:
        facts.require_current(stale)  # raises StaleFact, naming the current version
    return sorted({fact.pk for fact in relied})


def _first_stale(ids: list[int]) -> Fact | None:
    """The first of the fact versions `ids` that is no longer current or has expired (or
    None)."""
    if not ids:
        return None
    current = set(Fact.objects.filter(pk__in=ids, status=FactStatus.CURRENT).unexpired()
                  .values_list("pk", flat=True))
    missing = sorted(set(ids) - current)
    if not missing:
        return None
    return Fact.objects.filter(pk=missing[0]).first() or Fact(pk=missing[0])


def _derived_key(run: Run, step: Step, call: str | None) -> str:
    return idempotency_key(run.run_id, step.step_id, call)


def _check_run_and_step(run: Any, step: Any) -> None:
    if isinstance(run, str):
        check_identifier(run, "run", 100)
    if isinstance(step, str):
        check_identifier(step, "step", 100)


def _check_mark_args(fencing_token: Any, in_flight_for: Any) -> None:
    """The submission's own arguments, checked before anything is written."""
    if fencing_token is not None:
        check_whole_number(fencing_token, low=1, high=PG_BIGINT_MAX,
                           expected="fencing_token to be a positive "
                           "integer or None")
    if in_flight_for is not None:
        check_duration(in_flight_for, "in_flight_for", high=timedelta(days=7))


def _check_mark(op: Any, fencing_token: Any, expected_version: Any, actor: Any) -> None:
    """The arguments every mark takes, checked before any query."""
    if not isinstance(op, Operation) or op.pk is None:
        raise InvalidInput(f"expected a saved Operation, found {type(op).__name__}")
    if fencing_token is not None:
        check_whole_number(fencing_token, low=1, high=PG_BIGINT_MAX,
                           expected="fencing_token to be a positive "
                           "integer or None")
    if expected_version is not None:
        check_version(expected_version)
    check_optional_identifier(actor, "actor", 200)


_EXISTING = (
    f"SELECT {rows.OPERATION_COLUMNS} FROM {Operation._meta.db_table}"
    " WHERE tenant = %s AND operation = %s AND idempotency_key = %s AND idempotency_key > ''"
)


def _existing(tenant: str, operation: str, key: str) -> Operation | None:
    # On every record_intent: a prepared statement skips the ORM's query compilation and
    # the planner, and without an ORDER BY (which .first() would add) the partial unique
    # index answers it alone.
    with prepared_cursor() as cursor:
        cursor.execute(_EXISTING, [tenant, operation, key])
        row = cursor.fetchone()
    return None if row is None else rows.operation_from_row(row)


def _redact_intent(intent: Mapping[str, Any], paths: list[str]) -> dict[str, Any]:
    stored = redact(intent, paths)
    size = len(canonical_json(stored).encode("utf-8"))
    limit = conf.MAX_INTENT_BYTES
    if size > limit:
        raise InvalidInput(
            f"expected an intent of at most {limit:,} bytes of canonical JSON "
            f"(LEDGER_MAX_INTENT_BYTES), found {size:,} bytes; store large payloads "
            "elsewhere and record a reference"
        )
    return stored


# --- an agent's outcomes ------------------------------------------------------------------


@approvals.gated  # ApprovalRequired / ApprovalDenied under an approval policy
def mark_submitted(
    op: Operation,
    *,
    fencing_token: int | None = None,
    expected_version: int | None = None,
    actor: str | None = None,
    in_flight_for: timedelta | None = None,
    request_id: str | None = None,
) -> Operation:
    """planned -> submitted, or safe_to_retry -> submitted as attempt + 1 (same key).

    StaleFact (`.current`) once a fact version the operation relies on (`record_intent(
    relies_on=)`) is superseded or has expired: it was planned on what is no longer true;
    nothing written.
    DependencyNotMet (`.missing`) while a step the operation's step depends on is not
    committed: no effect of `ship` before `charge` is done. On a leased run,
    StaleFencingToken unless `fencing_token` is the lease's current token (so for every
    mark below).

    `in_flight_for` (default `LEDGER_IN_FLIGHT_SECONDS`) is how long this attempt's request
    may still land after the sender gives up on it: stored as `in_flight_until`, first from
    now, then, when the attempt becomes outcome_unknown (the agent's timeout, or the sweep
    of a sender that is gone), from that moment; before it the reconciler takes no
    ProvenAbsent as proof. A request can hang for longer than any window (a slow proxy, a
    queue): the window is counted from when nobody waits for the answer any more.

    Like every mark below: `expected_version` (default `op.version`) is the version the
    caller acted on (StaleVersion if the row moved on); `actor` names the agent on the
    event. Under an approval policy (`ledger.approvals`), a planned operation needs enough
    live approvals of its current fingerprint first: ApprovalRequired, or ApprovalDenied
    when a person denied it.

    A retry also sets `reread_due_at`, the end of the latest in-flight window of every
    attempt so far, this one included: once the retry has succeeded and that time has
    passed, the reconciler reads the external system again (`reconcile.reread_due`) and
    flags the operation `duplicate` if an earlier attempt's request landed after all.

    The operation kind's validators (`ledger.validation`: rules and functions) run first:
    a refusal moves the operation to abandoned with error code validation_refused and the
    reason, and raises ValidationRefused; nothing is submitted, so nothing may be sent.

    `request_id`: the id a client gave the request that submits (HTTP `Request-Id`); the
    event's reason names its digest (`submission_request_digest`), never the id, so only
    the client holding the id can later show that a submission was its own
    (`submitted_by_request`).
    """
    _check_mark(op, fencing_token, expected_version, actor)
    stale = _first_stale(list(op.relies_on or ()))
    if stale is not None:
        facts.require_current(stale)  # StaleFact naming the current version; nothing written
    if op.state in states.SENDABLE and validation.has_checks():
        _refuse_if_invalid(op, fencing_token=fencing_token, expected_version=expected_version,
                           actor=actor)
    changes, reason = _submission(op, in_flight_for, request_id)
    return transitions.by_agent(
        op, State.SUBMITTED, fencing_token=fencing_token, reason=reason, changes=changes,
        expected_version=expected_version, actor=actor,
    )


def _submission(op: Operation, in_flight_for: timedelta | None,
                request_id: str | None = None) -> tuple[dict[str, Any], str]:
    """(the columns a move of `op` to submitted sets, the event's reason; with `request_id`,
    the reason names its digest)."""
    if in_flight_for is None:
        in_flight_for = timedelta(seconds=conf.IN_FLIGHT_SECONDS)
    check_duration(in_flight_for, "in_flight_for", high=timedelta(days=7))
    now = timezone.now()
    changes: dict[str, Any] = {"submitted_at": now, "in_flight_until": now + in_flight_for}
    if op.state == State.SAFE_TO_RETRY:
        changes.update({"attempt": op.attempt + 1,
                        "error_code": "", "error_detail": "", "unknown_since": None,
                        "next_attempt_at": None, "reconcile_attempts": 0,
                        "reconcile_failures": 0})
        windows = (op.reread_due_at, op.in_flight_until, changes["in_flight_until"])
        changes["reread_due_at"] = max(w for w in windows if w is not None)
    reason = "request sent" if op.state == State.PLANNED else f"retry: attempt {op.attempt + 1}"
    if request_id is not None:
        reason = f"{reason} ({submission_request_digest(request_id)})"
    return changes, reason


def _refuse_if_invalid(op: Operation, *, fencing_token: int | None,
                       expected_version: int | None, actor: str | None) -> None:
    """Record the validators' refusal of `op` (abandoned, before anything is sent) and raise
    ValidationRefused; return when none refuses it."""
    why = validation.refusal(op)
    if not why:
        return
    why = scrub_text(storable_text(why, "the validator's reason", 2000))
    refused = transitions.by_agent(
        op, State.ABANDONED, fencing_token=fencing_token, actor=actor,
        reason=f"refused before sending by the validator: {why}",
        changes={"error_code": validation.REFUSED_CODE, "error_detail": why},
        expected_version=expected_version,
    )
    raise ValidationRefused(
        f"expected operation {op.operation_id} ({op.operation}) to pass the checks of its "
        f"kind before it is sent, found: {why}; it is recorded abandoned and nothing was "
        "sent", reason=why, operation=refused)


def submission_request_digest(request_id: str) -> str:
    """What a submission's event records of the client's request id: `request sha256:<hex>`
    (the id itself stays with the client)."""
    return f"request sha256:{hashlib.sha256(request_id.encode()).hexdigest()}"


def submitted_by_request(op: Operation, request_id: str, actor: str) -> bool:
    """Whether `op`, submitted, is still as the request `request_id` of agent `actor` left
    it: its current version is the submission that request made (the same actor, the
    request's digest on the event). True means nothing has moved it since and nobody else
    sent it: the request's answer was lost on the way back, and its client may still send."""
    if op.state != State.SUBMITTED:
        return False
    return OperationEvent.objects.filter(
        operation_id=op.pk, version=op.version, to_state=State.SUBMITTED,
        actor_kind=ActorKind.AGENT, actor_id=actor,
        reason__endswith=f"({submission_request_digest(request_id)})").exists()


NO_RESULT: Any = object()  # mark_succeeded's result= left out: the result columns untouched


def storable_result(value: Any) -> tuple[Any, str]:
    """(the redacted value to store as `Operation.result`, "") or (None, why it cannot be
    stored: not JSON, or above LEDGER_MAX_INTENT_BYTES)."""
    try:
        check_json(value, what="result")
    except InvalidInput as exc:
        return None, str(exc)[:300]
    stored = redact(value)
    size = len(canonical_json(stored).encode("utf-8"))
    if size > conf.MAX_INTENT_BYTES:
        return None, (f"a result of {size:,} bytes, above LEDGER_MAX_INTENT_BYTES "
                      f"({conf.MAX_INTENT_BYTES:,})")
    return stored, ""


def mark_succeeded(
    op: Operation,
    *,
    external_id: str | None = None,
    evidence: Any = None,
    fencing_token: int | None = None,
    expected_version: int | None = None,
    actor: str | None = None,
    result: Any = NO_RESULT,
    result_unstorable: str = "",
) -> Operation:
    """submitted -> succeeded, with the external system's id when it gave one.

    `result`: the call's return value, stored redacted as `Operation.result` (what a later
    call of the same key gets instead of sending); one that is not JSON or too large is not
    stored and `result_unstorable` says why. `result_unstorable` alone: the caller could
    not even send it (its reason is recorded). Neither: the result columns stay as they are.
    """
    _check_mark(op, fencing_token, expected_version, actor)
    if evidence is not None:
        check_json(evidence, what="evidence")
    changes = {}
    if result is not NO_RESULT or result_unstorable:
        why = scrub_text(storable_text(result_unstorable, "result_unstorable", 300))
        stored = None
        if result is not NO_RESULT and not why:
            stored, why = storable_result(result)
        changes.update({"result": stored, "result_unstorable": why})
    if external_id is not None:
        external_id = scrub_text(check_identifier(external_id, "external_id", 500))
        changes["external_id"] = external_id
    return transitions.by_agent(
        op, State.SUCCEEDED, fencing_token=fencing_token, evidence=evidence,
        reason="the external system confirmed it", changes=changes,
        expected_version=expected_version, actor=actor,
    )


def mark_rejected(
    op: Operation,
    *,
    error_code: str,
    detail: str = "",
    fencing_token: int | None = None,
    expected_version: int | None = None,
    actor: str | None = None,
) -> Operation:
    """submitted -> rejected: the external system refused it and did nothing."""
    return _outcome(op, State.REJECTED, error_code, detail, fencing_token,
                    expected_version=expected_version, actor=actor)


def mark_outcome_unknown(
    op: Operation,
    *,
    error_code: str,
    detail: str = "",
    fencing_token: int | None = None,
    expected_version: int | None = None,
    actor: str | None = None,
) -> Operation:
    """submitted -> outcome_unknown: sent, but whether it took effect is not known."""
    return _outcome(op, State.OUTCOME_UNKNOWN, error_code, detail, fencing_token,
                    expected_version=expected_version, actor=actor)


def _outcome(op, to_state, error_code, detail, fencing_token, **kwargs) -> Operation:
    # The code names a kind of failure (an identifier); the detail is the outside world's
    # text, recorded whatever it holds.
    _check_mark(op, fencing_token, kwargs.get("expected_version"), kwargs.get("actor"))
    error_code = scrub_text(check_identifier(error_code, "error_code", 200))
    detail = scrub_text(storable_text(detail, "detail", 4000))
    return transitions.by_agent(
        op, to_state, fencing_token=fencing_token,
        reason=(f"{error_code}: {detail}" if detail else error_code)[:2000],
        changes={"error_code": error_code, "error_detail": detail}, **kwargs,
    )


class Attempt:
    """Handed out by `submit`: say how the call went."""

    def __init__(self, op: Operation, fencing_token: int | None):
        self.op = op
        self._fencing_token = fencing_token
        self.finished = False

    def succeeded(self, *, external_id: str | None = None, evidence: Any = None) -> Operation:
        """Record success now; the block's normal exit then changes nothing more."""
        self.op = mark_succeeded(
            self.op, external_id=external_id, evidence=evidence,
            fencing_token=self._fencing_token,
        )
        self.finished = True
        return self.op


@contextmanager
def submit(
    op: Operation,
    rejections: tuple[type[BaseException], ...] = (),
    *,
    fencing_token: int | None = None,
    in_flight_for: timedelta | None = None,
):
    """Mark `op` submitted, run the block that sends it, and record how it ended.

    `in_flight_for`: as for `mark_submitted`.

    Normal exit: succeeded. An exception in `rejections`: rejected. Any other exception
    (timeouts, dropped connections, crashes): outcome_unknown. Both are re-raised; nothing
    is retried. The exception's message is recorded whatever it holds (NUL and unpaired
    surrogates become U+FFFD): the agent's own exception is what the caller sees.
    """
    mark_submitted(op, fencing_token=fencing_token, in_flight_for=in_flight_for)
    attempt = Attempt(op, fencing_token)
    try:
        yield attempt
    except BaseException as exc:
        if not attempt.finished:
            code, detail = failure_record(exc)
            if rejections and isinstance(exc, rejections):
                mark_rejected(op, error_code=code, detail=detail, fencing_token=fencing_token)
            else:
                mark_outcome_unknown(
                    op, error_code=code, detail=detail, fencing_token=fencing_token
                )
        raise
    if not attempt.finished:
        attempt.succeeded()


def failure_record(exc: BaseException) -> tuple[str, str]:
    """(error_code, detail) recording an agent's exception: its class name and its message,
    storable whatever the message holds, never raising on a strange exception."""
    code = type(exc).__name__
    detail = describe_exception(exc, 4000)
    return code, scrub_text(detail[len(code) + 2:])


# --- human decisions ---------------------------------------------------------------------


def resolve(
    op: Operation,
    to_state: str,
    *,
    user,
    reason: str,
    external_id: str | None = None,
    expected_version: int | None = None,
) -> Operation:
    """A person settles an operation the ledger could not prove.

    `to_state` is succeeded, safe_to_retry or abandoned, from outcome_unknown or
    manual_review. Needs `ledger.resolve_operation` and a grant for the operation's tenant;
    safe_to_retry on a `never` operation also needs `ledger.override_retry_policy`.
    `expected_version` (default: `op.version`) is the version the person decided on: if
    someone else resolved first, StaleVersion says who and when, and nothing is written.

    Two-person rule: when a consequential approval policy matches the operation, or for
    safe_to_retry on a `never` operation (`approvals.takes_two_people`), the first person's
    resolve records a proposal (`ResolutionProposal`, see `approvals.pending_proposal`) and
    returns the operation unchanged (same state, same version). A different person's resolve
    with the same decision at the same version completes it: the event names them
    (`decided_by`) and the proposer (its evidence, `two_person`). The proposer resolving
    the same again: SecondPersonRequired. A different decision records a new proposal that
    replaces the pending one (who disagrees proposes; nobody decides alone). A proposal of
    a version that has since changed is stale: it no longer counts. PostgreSQL refuses such
    a decision without a matching proposal by someone else. The operation returned says
    whether this call recorded a proposal (`proposal_recorded`).
    """
    check_choice(to_state, "to_state", states.RESOLUTIONS)
    reason = check_reason(reason)
    check_user(user, f"resolve operation {op.operation_id}")
    access.require_perm(user, "ledger.resolve_operation", doing="resolve operations")
    access.require_tenant(user, op.tenant)
    if to_state == State.SAFE_TO_RETRY and op.retry_policy == RetryPolicy.NEVER:
        access.require_perm(
            user, "ledger.override_retry_policy",
            doing=f"mark {op.operation_id} safe to retry despite its retry policy 'never'",
        )
    if expected_version is not None and expected_version != op.version:
        raise transitions.stale_version_error(op, op.state, expected_version)
    if op.state not in states.NEEDS_REVIEW:
        raise IllegalTransition(
            f"expected operation {op.operation_id} in one of "
            f"{states.listed(states.NEEDS_REVIEW)} to resolve it, found {op.state}",
            from_state=op.state,
            to_state=to_state,
        )
    changes = {}
    if external_id:
        external_id = scrub_text(check_identifier(external_id, "external_id", 500))
        changes["external_id"] = external_id
    if op.conflict == Conflict.AMBIGUOUS:
        changes["conflict"] = ""  # a person has decided between the matches
    if not approvals.takes_two_people(op, to_state):
        op = transitions.by_person(
            op, to_state, user=user, reason=reason, expected_version=expected_version,
            changes=changes,
        )
        op.proposal_recorded = False
        return op
    return _resolve_by_two(op, to_state, user=user, reason=reason, changes=changes,
                           version=op.version if expected_version is None else expected_version)


def _resolve_by_two(op: Operation, to_state: str, *, user, reason: str,
                    changes: dict[str, Any], version: int) -> Operation:
    """The two-person rule of `resolve` (`transitions.by_two_people`): propose, or complete
    another person's proposal; `op` updated in place."""
    current = transitions.by_two_people(op, to_state, user=user, reason=reason,
                                        version=version, changes=changes)
    for field in Operation._meta.concrete_fields:
        setattr(op, field.attname, getattr(current, field.attname))
    op.proposal_recorded = current.proposal_recorded
    return op


def acknowledge(
    op: Operation,
    *,
    user,
    reason: str,
    expected_version: int | None = None,
) -> Operation:
    """A person settles the conflict flag of a terminal operation; returns it, flag cleared.

    "Intended: two different articles", "real duplicate, compensated by hand": the
    operation leaves the review queue, and its event (a move from its state to itself,
    naming the user and the reason) is audited like a decision. A `duplicate` flag is
    settled for the whole set at once: every other terminal operation of the tenant with the
    same operation name and fingerprint that carries it is cleared too, each with its own
    event naming this one, in the same transaction (they are one finding; a person who
    looked at one has looked at the pair). A later success with the same fingerprint flags
    the set again. Needs `ledger.resolve_operation` and a grant for the operation's tenant
    (PermissionDenied), a non-empty reason (InvalidInput) and a terminal operation that
    carries a flag (IllegalTransition otherwise). `expected_version` (default `op.version`):
    StaleVersion, naming who changed it, if the operation moved on; nothing is written.
    """
    if not isinstance(op, Operation) or op.pk is None:
        raise InvalidInput(f"expected a saved Operation, found {op!r}")
    reason = check_reason(reason)
    access.require_perm(user, "ledger.resolve_operation", doing="acknowledge conflicts")
    access.require_tenant(user, op.tenant)
    version = op.version if expected_version is None else expected_version
    with transaction.atomic(durable=True):
        # The flagged set locked in id order, as every acknowledger takes it (no deadlock).
        same_fingerprint = Q(tenant=op.tenant, operation=op.operation,
                             intent_fingerprint=op.intent_fingerprint,
                             conflict=Conflict.DUPLICATE, state__in=states.TERMINAL)
        locked = list(
            Operation.objects.select_for_update()
            .filter(Q(pk=op.pk) | same_fingerprint).order_by("id")
        )
        current = next((row for row in locked if row.pk == op.pk), None)
        if current is None or current.version != version:
            raise transitions.stale_version_error(op, op.state, version)
        if current.state not in states.TERMINAL or not current.conflict:
            raise IllegalTransition(
                f"expected operation {op.operation_id} terminal "
                f"({states.listed(states.TERMINAL)}) with a conflict flag to acknowledge, "
                f"found {current.state} with "
                + (f"flag {current.conflict}" if current.conflict else "no flag"),
                from_state=current.state, to_state=current.state,
            )
        twins = ([row for row in locked if row.pk != op.pk]
                 if current.conflict == Conflict.DUPLICATE else [])
        transitions.flag_by_person(
            current, "", user=user, reason=f"acknowledged {current.conflict}: {reason}",
            expected_version=version,
            evidence={"settles": [twin.operation_id for twin in twins]} if twins else None,
        )
        for twin in twins:
            transitions.flag_by_person(
                twin, "", user=user,
                reason=f"acknowledged duplicate with {op.operation_id}: {reason}",
                evidence={"acknowledged_with": op.operation_id},
            )
    for name in ("version", "conflict"):
        setattr(op, name, getattr(current, name))
    return op


# --- the agent integration kit (ledger.agent_kit), read here as receipts.<name> -----------

_KIT = frozenset({"action", "step_scope", "retries_due", "arecord_intent", "amark_submitted",
                  "amark_succeeded", "amark_rejected", "amark_outcome_unknown", "asubmit"})


def __getattr__(name: str):
    # Lazy: ledger.agent_kit builds on this module, so it cannot be imported at its top.
    if name in _KIT:
        from ledger import agent_kit
        return getattr(agent_kit, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
