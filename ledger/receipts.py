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

from django.utils import timezone

from ledger import access, approvals, conf, rows, runs, states, transitions
from ledger.canonical import canonical_json, check_json, fingerprint, redact, scrub_text
from ledger.errors import (
    IdempotencyKeyReused,
    IllegalTransition,
    InvalidInput,
)
from ledger.inputs import (
    check_choice,
    check_duration,
    check_operation_name,
    check_paths,
    check_reason,
    check_string,
    check_text,
)
from ledger.models import Operation, Run, Step
from ledger.models.operations import Conflict
from ledger.prepared import prepared_cursor
from ledger.states import RetryPolicy, State


def new_operation_id(now=None) -> str:
    """Sortable id: UTC time to the second, then 10 random hex digits."""
    now = now or timezone.now()
    return f"{now:%Y%m%dT%H%M%SZ}-{secrets.token_hex(5)}"


def idempotency_key(run_id: str, step_id: str) -> str:
    """A stable key derived from the run and step: the same inputs always give the same key."""
    check_text(run_id, "run_id")
    check_text(step_id, "step_id")
    digest = hashlib.sha256(f"{run_id}\x1f{step_id}".encode()).hexdigest()[:32]
    return f"ik-{digest}"


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
) -> Operation:
    """Record a planned operation before the external call; returns it in state `planned`.

    Secrets (keys naming them at any depth, and the dotted `redact` paths) are replaced
    before anything is written. With the same (tenant, operation, key) and the same
    fingerprint it returns the existing operation, whatever its state: the caller must not
    send again. Same key, other fingerprint: IdempotencyKeyReused. Bad input raises
    InvalidInput (a ValueError) and writes nothing. `op.recorded_now` says whether this call
    recorded it (True) or found it (False), also when concurrent callers race on one key.
    """
    redact_paths = check_paths(redact, "redact")
    fields = None if fingerprint_fields is None else check_paths(fingerprint_fields,
                                                                 "fingerprint_fields")
    check_operation_name(operation)
    target = scrub_text(check_string(target, "target", 2000))
    check_text(tenant, "tenant", 100)
    check_choice(retry_policy, "retry_policy", RetryPolicy.values)
    if not isinstance(intent, Mapping):
        raise InvalidInput(
            f"expected intent to be a JSON object (a dict), found {type(intent).__name__}"
        )
    check_json(intent, what="intent")
    stored_intent = _redact_intent(intent, redact_paths)
    intent_fingerprint = fingerprint(stored_intent, fields)
    if idempotency_key is None:
        idempotency_key = f"gen-{secrets.token_hex(16)}"
    check_text(idempotency_key, "idempotency_key", 200)
    run_obj, step_obj = runs.as_run_and_step(run, step, tenant=tenant)

    # Each statement below stands alone (see transitions.single_statement): the look-up
    # spares a replay the insert, and the insert keeps the key unique by itself.
    with transitions.single_statement():
        existing = _existing(tenant, operation, idempotency_key)
        if existing is None:
            now = timezone.now()
            candidate = Operation(
                operation_id=new_operation_id(now),
                tenant=tenant,
                operation=operation,
                target=target,
                intent=stored_intent,
                intent_fingerprint=intent_fingerprint,
                idempotency_key=idempotency_key,
                retry_policy=retry_policy,
                run=run_obj,
                step=step_obj,
                created_at=now,
                state_changed_at=now,
            )
            # A concurrent recorder of the same key loses quietly (nothing written) and
            # reads the winner's row below.
            if transitions.record(candidate, actor=actor or ""):
                candidate.recorded_now = True
                return candidate
            existing = _existing(tenant, operation, idempotency_key)
        if existing.intent_fingerprint != intent_fingerprint:
            raise IdempotencyKeyReused(
                f"expected idempotency key {idempotency_key!r} of {operation} to come with "
                f"fingerprint {existing.intent_fingerprint}, found {intent_fingerprint}; "
                f"the key already names operation {existing.operation_id} "
                f"({existing.state})",
                existing=existing,
            )
        return existing


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
) -> Operation:
    """planned -> submitted, or safe_to_retry -> submitted as attempt + 1 (same key).

    `in_flight_for` (default `LEDGER_IN_FLIGHT_SECONDS`) is how long this attempt's request
    may still be travelling: stored as `in_flight_until`, before which the reconciler takes
    no ProvenAbsent as proof. Like every mark below: `expected_version` (default
    `op.version`) is the version the caller acted on (StaleVersion if the row moved on);
    `actor` names the agent on the event. Under an approval policy (`ledger.approvals`), a
    planned operation needs enough live approvals of its current fingerprint first:
    ApprovalRequired, or ApprovalDenied when a person denied it.
    """
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
    reason = "request sent" if op.state == State.PLANNED else f"retry: attempt {op.attempt + 1}"
    return transitions.by_agent(
        op, State.SUBMITTED, fencing_token=fencing_token, reason=reason, changes=changes,
        expected_version=expected_version, actor=actor,
    )


def mark_succeeded(
    op: Operation,
    *,
    external_id: str | None = None,
    evidence: Any = None,
    fencing_token: int | None = None,
    expected_version: int | None = None,
    actor: str | None = None,
) -> Operation:
    """submitted -> succeeded, with the external system's id when it gave one."""
    changes = {}
    if external_id is not None:
        external_id = scrub_text(check_text(external_id, "external_id", 500))
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
    error_code = scrub_text(check_text(error_code, "error_code", 200))
    detail = scrub_text(check_string(detail, "detail"))
    return transitions.by_agent(
        op, to_state, fencing_token=fencing_token, reason=f"{error_code}: {detail}"[:2000],
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
    is retried.
    """
    mark_submitted(op, fencing_token=fencing_token, in_flight_for=in_flight_for)
    attempt = Attempt(op, fencing_token)
    try:
        yield attempt
    except BaseException as exc:
        if not attempt.finished:
            code = type(exc).__name__
            detail = scrub_text(str(exc))[:4000]
            if rejections and isinstance(exc, rejections):
                mark_rejected(op, error_code=code, detail=detail, fencing_token=fencing_token)
            else:
                mark_outcome_unknown(
                    op, error_code=code, detail=detail, fencing_token=fencing_token
                )
        raise
    if not attempt.finished:
        attempt.succeeded()


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
    """
    check_choice(to_state, "to_state", states.RESOLUTIONS)
    reason = check_reason(reason)
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
            f"expected operation {op.operation_id} in one of {sorted(states.NEEDS_REVIEW)} to "
            f"resolve it, found {op.state}",
            from_state=op.state,
            to_state=to_state,
        )
    changes = {}
    if external_id:
        external_id = scrub_text(check_text(external_id, "external_id", 500))
        changes["external_id"] = external_id
    if op.conflict == Conflict.AMBIGUOUS:
        changes["conflict"] = ""  # a person has decided between the matches
    return transitions.by_person(
        op, to_state, user=user, reason=reason, expected_version=expected_version,
        changes=changes,
    )


# --- the integration kit (ledger.actions), read here as receipts.<name> ----------------------

_KIT = frozenset({"action", "step_scope", "retries_due", "arecord_intent", "amark_submitted",
                  "amark_succeeded", "amark_rejected", "amark_outcome_unknown", "asubmit"})


def __getattr__(name: str):
    # Lazy: ledger.actions builds on this module, so it cannot be imported at its top.
    if name in _KIT:
        from ledger import actions
        return getattr(actions, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
