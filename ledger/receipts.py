"""Action receipts: record the intent before the call, then its outcome.

Every change is a compare-and-set on (state, version) plus one OperationEvent, in one
transaction. A transport failure after submission is `outcome_unknown`, never "failed";
nothing here ever retries or sends anything.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from ledger import access, audit, leases, states
from ledger.canonical import canonical_json, check_json, fingerprint, redact, scrub_text
from ledger.errors import (
    IdempotencyKeyReused,
    IllegalTransition,
    InvalidInput,
    StaleVersion,
)
from ledger.models import Operation, OperationEvent, Run, Step
from ledger.models.operations import Conflict
from ledger.prepared import prepared_cursor
from ledger.states import ActorKind, RetryPolicy, State

_OPERATION_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]*$")


def new_operation_id(now=None) -> str:
    """Sortable id: UTC time to the second, then 10 random hex digits."""
    now = now or timezone.now()
    return f"{now:%Y%m%dT%H%M%SZ}-{secrets.token_hex(5)}"


def idempotency_key(run_id: str, step_id: str) -> str:
    """A stable key derived from the run and step: the same inputs always give the same key."""
    for name, value in (("run_id", run_id), ("step_id", step_id)):
        if not isinstance(value, str) or not value:
            raise InvalidInput(f"expected {name} to be a non-empty string, found {value!r}")
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
    redact_paths = _check_paths(redact, "redact")
    fields = None if fingerprint_fields is None else _check_paths(fingerprint_fields,
                                                                  "fingerprint_fields")
    _check_text(operation, "operation", max_length=200)
    if not _OPERATION_NAME.match(operation):
        raise InvalidInput(
            "expected operation to be a name like 'articles.create' (letters, digits, "
            f"'_', '.', ':', '/', '-'), found {operation!r}"
        )
    if not isinstance(target, str):
        raise InvalidInput(f"expected target to be a string, found {type(target).__name__}")
    if len(target) > 2000:
        raise InvalidInput(f"expected target of at most 2000 characters, found {len(target)}")
    _check_text(tenant, "tenant", max_length=100)
    if retry_policy not in RetryPolicy.values:
        raise InvalidInput(
            f"expected retry_policy one of {RetryPolicy.values}, found {retry_policy!r}"
        )
    if not isinstance(intent, Mapping):
        raise InvalidInput(
            f"expected intent to be a JSON object (a dict), found {type(intent).__name__}"
        )
    check_json(intent, what="intent")
    stored_intent = _redact_intent(intent, redact_paths)
    intent_fingerprint = fingerprint(stored_intent, fields)
    if idempotency_key is None:
        idempotency_key = f"gen-{secrets.token_hex(16)}"
    _check_text(idempotency_key, "idempotency_key", max_length=200)
    run_obj, step_obj = _resolve_run_and_step(run, step, tenant)

    # Each statement below stands alone (see _one_statement): the look-up spares a replay
    # the insert, and the insert keeps the key unique by itself (ON CONFLICT DO NOTHING).
    with _one_statement():
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
            # ON CONFLICT DO NOTHING: a concurrent recorder of the same key loses quietly
            # and reads the winner's row below, so no IntegrityError escapes.
            candidate.pk = audit.insert_operation_with_event(
                {f.attname: getattr(candidate, f.attname)
                 for f in Operation._meta.concrete_fields if not f.primary_key},
                audit.event_values(from_state="", to_state=State.PLANNED, version=1,
                                   actor_kind=ActorKind.AGENT, actor_id=actor or "",
                                   reason="intent recorded", now=now),
            )
            if candidate.pk is not None:
                candidate._state.adding = False
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
    f"SELECT {audit.OPERATION_COLUMNS} FROM {Operation._meta.db_table}"
    " WHERE tenant = %s AND operation = %s AND idempotency_key = %s AND idempotency_key > ''"
)


def _existing(tenant: str, operation: str, key: str) -> Operation | None:
    # On every record_intent: a prepared statement skips the ORM's query compilation and
    # the planner, and without an ORDER BY (which .first() would add) the partial unique
    # index answers it alone.
    with prepared_cursor() as cursor:
        cursor.execute(_EXISTING, [tenant, operation, key])
        row = cursor.fetchone()
    return None if row is None else audit.operation_from_row(row)


def _one_statement() -> AbstractContextManager:
    """The transaction of an agent's write that is a single SQL statement.

    Every change here is one statement (the row, its event and its chain link: see
    ledger.audit), and in autocommit mode PostgreSQL runs a statement as its own
    transaction, deferred event check included; so no BEGIN and COMMIT round trips around
    it. Inside a caller's transaction it is `atomic(durable=True)` as before, which refuses
    to nest: a receipt must be committed before the external call, not when the caller's
    block ends.
    """
    if connection.get_autocommit() and not connection.in_atomic_block:
        return nullcontext()
    return transaction.atomic(durable=True)


def _redact_intent(intent: Mapping[str, Any], paths: list[str]) -> dict[str, Any]:
    stored = redact(intent, paths)
    size = len(canonical_json(stored).encode("utf-8"))
    limit = settings.LEDGER_MAX_INTENT_BYTES
    if size > limit:
        raise InvalidInput(
            f"expected an intent of at most {limit:,} bytes of canonical JSON "
            f"(LEDGER_MAX_INTENT_BYTES), found {size:,} bytes; store large payloads "
            "elsewhere and record a reference"
        )
    return stored


def _check_text(value: Any, name: str, *, max_length: int) -> None:
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(f"expected {name} to be a non-empty string, found {value!r}")
    if len(value) > max_length:
        raise InvalidInput(
            f"expected {name} of at most {max_length} characters, found {len(value)}"
        )


def _check_paths(paths: Iterable[str], name: str) -> list[str]:
    if isinstance(paths, str):
        raise InvalidInput(f"expected {name} to be a list of dotted paths, found a string")
    result = list(paths)
    for path in result:
        if not isinstance(path, str) or not path or path.startswith(".") or ".." in path:
            raise InvalidInput(
                f"expected each of {name} to be a dotted path like 'body.card', found {path!r}"
            )
    return result


def _resolve_run_and_step(run, step, tenant: str) -> tuple[Run | None, Step | None]:
    if isinstance(run, str):
        try:
            run = Run.objects.get(run_id=run)
        except Run.DoesNotExist:
            raise InvalidInput(f"expected run {run!r} to exist, found no such run") from None
    elif run is not None and not isinstance(run, Run):
        raise InvalidInput(f"expected run to be a Run or a run_id, found {type(run).__name__}")
    if run is not None and run.tenant != tenant:
        raise InvalidInput(
            f"expected run {run.run_id} to belong to tenant {tenant!r}, found {run.tenant!r}"
        )
    if isinstance(step, str):
        if run is None:
            raise InvalidInput(f"expected a run with step {step!r}, found run=None")
        try:
            step = Step.objects.get(run=run, step_id=step)
        except Step.DoesNotExist:
            raise InvalidInput(
                f"expected step {step!r} to exist in run {run.run_id}, found no such step"
            ) from None
    elif step is not None:
        if not isinstance(step, Step):
            raise InvalidInput(
                f"expected step to be a Step or a step_id, found {type(step).__name__}"
            )
        if run is None:
            run = step.run
        elif step.run_id != run.pk:
            raise InvalidInput(
                f"expected step {step.step_id} to belong to run {run.run_id}, found another run"
            )
    return run, step


# --- transitions -------------------------------------------------------------------------


def apply_transition(
    op: Operation,
    to_state: str,
    *,
    actor_kind: str,
    actor_id: str = "",
    reason: str = "",
    evidence: Any = None,
    fencing_token: int | None = None,
    expected_version: int | None = None,
    changes: Mapping[str, Any] | None = None,
    fencing_resource: str | None = None,
) -> Operation:
    """Move `op` to `to_state` inside the caller's transaction; updates `op` in place.

    For ledger modules (receipts, reconcile): callers outside the ledger use the public
    functions below. Compare-and-set on (state, version): raises IllegalTransition when the
    table forbids the move, StaleVersion when someone else changed the row first,
    StaleFencingToken when `fencing_token` is not the current token of the run's lease (or,
    when `fencing_resource` is given, of that lease: the reconciler fences with
    `reconcile:<operation_id>`). The token is recorded on the event.
    """
    if not isinstance(op, Operation) or op.pk is None:
        raise InvalidInput(f"expected a saved Operation, found {op!r}")
    if to_state not in State.values:
        raise InvalidInput(f"expected a state among {State.values}, found {to_state!r}")
    from_state = op.state
    version = op.version if expected_version is None else expected_version
    if not states.is_legal(from_state, to_state):
        raise IllegalTransition(
            f"illegal transition of operation {op.operation_id}: expected {from_state} -> one "
            f"of {states.targets(from_state) or ['none (terminal)']}, found {from_state} -> "
            f"{to_state}",
            from_state=from_state,
            to_state=to_state,
        )
    if fencing_token is not None and fencing_resource is not None:
        leases.check(fencing_resource, fencing_token)
    elif fencing_token is not None:
        if op.run_id is None:
            raise InvalidInput(
                f"expected operation {op.operation_id} to belong to a run when a fencing_token "
                "is given, found run=None"
            )
        leases.check_run(op.run_id, fencing_token)
    now = timezone.now()
    fields: dict[str, Any] = dict(changes or {})
    fields.update(state=to_state, version=version + 1, state_changed_at=now)
    if to_state in states.TERMINAL:
        fields["completed_at"] = now
    if to_state == State.SUBMITTED:
        fields.setdefault("submitted_at", now)
    if to_state == State.OUTCOME_UNKNOWN and from_state == State.SUBMITTED:
        fields["unknown_since"] = now
    event = audit.event_values(
        from_state=from_state, to_state=to_state, version=version + 1, actor_kind=actor_kind,
        actor_id=actor_id, reason=reason, evidence=evidence, fencing_token=fencing_token, now=now,
    )
    conflict = audit.update_operation_with_event(
        op, state=from_state, version=version, changes=fields, event=event,
        mark_duplicates=to_state == State.SUCCEEDED,
    )
    if conflict is None:
        raise _stale(op, from_state, version)
    fields["conflict"] = conflict
    for name, value in fields.items():
        setattr(op, name, value)
    return op


def _stale(op: Operation, state: str, version: int) -> StaleVersion:
    current = Operation.objects.filter(pk=op.pk).first()
    if current is None:
        return StaleVersion(
            f"expected operation {op.operation_id} at version {version} ({state}), found it gone"
        )
    last = OperationEvent.objects.filter(operation=current).order_by("-version").first()
    who = ""
    if last is not None:
        who = (
            f", last changed by {last.actor_kind} {last.actor_id or '(unnamed)'} at "
            f"{last.created_at.isoformat()}"
            + (f": {last.reason}" if last.reason else "")
        )
    return StaleVersion(
        f"expected operation {op.operation_id} at version {version} ({state}), found version "
        f"{current.version} ({current.state}){who}",
        current=current,
        last_event=last,
    )


def _agent_transition(op, to_state, *, actor: str | None = None, **kwargs) -> Operation:
    if (op.state, to_state) in states.HUMAN_ONLY:
        raise IllegalTransition(
            f"expected a person to move operation {op.operation_id} from {op.state} to "
            f"{to_state} (receipts.resolve), found an agent trying to",
            from_state=op.state,
            to_state=to_state,
        )
    # A fenced write checks the lease in the same transaction as the change: two statements.
    fenced = kwargs.get("fencing_token") is not None
    with transaction.atomic(durable=True) if fenced else _one_statement():
        return apply_transition(
            op, to_state, actor_kind=ActorKind.AGENT, actor_id=actor or "", **kwargs
        )


def mark_submitted(
    op: Operation,
    *,
    fencing_token: int | None = None,
    expected_version: int | None = None,
    actor: str | None = None,
) -> Operation:
    """planned -> submitted, or safe_to_retry -> submitted as attempt + 1 (same key).

    Like every mark below: `expected_version` (default `op.version`) is the version the
    caller acted on (StaleVersion if the row moved on); `actor` names the agent on the event.
    """
    changes = {}
    if op.state == State.SAFE_TO_RETRY:
        changes = {"attempt": op.attempt + 1, "submitted_at": timezone.now(),
                   "error_code": "", "error_detail": "", "unknown_since": None,
                   "next_attempt_at": None, "reconcile_attempts": 0, "reconcile_failures": 0}
    reason = "request sent" if op.state == State.PLANNED else f"retry: attempt {op.attempt + 1}"
    return _agent_transition(
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
        _check_text(external_id, "external_id", max_length=500)
        changes["external_id"] = external_id
    return _agent_transition(
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
    _check_text(error_code, "error_code", max_length=200)
    if not isinstance(detail, str):
        raise InvalidInput(f"expected detail to be a string, found {type(detail).__name__}")
    detail = scrub_text(detail)
    return _agent_transition(
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
):
    """Mark `op` submitted, run the block that sends it, and record how it ended.

    Normal exit: succeeded. An exception in `rejections`: rejected. Any other exception
    (timeouts, dropped connections, crashes): outcome_unknown. Both are re-raised; nothing
    is retried.
    """
    mark_submitted(op, fencing_token=fencing_token)
    attempt = Attempt(op, fencing_token)
    try:
        yield attempt
    except BaseException as exc:
        if not attempt.finished:
            code = type(exc).__name__
            detail = str(exc)[:4000]
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
    if to_state not in states.RESOLUTIONS:
        raise InvalidInput(
            f"expected to_state one of {list(states.RESOLUTIONS)}, found {to_state!r}"
        )
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidInput(f"expected a non-empty reason for the decision, found {reason!r}")
    access.require_perm(user, "ledger.resolve_operation", doing="resolve operations")
    access.require_tenant(user, op.tenant)
    if to_state == State.SAFE_TO_RETRY and op.retry_policy == RetryPolicy.NEVER:
        access.require_perm(
            user, "ledger.override_retry_policy",
            doing=f"mark {op.operation_id} safe to retry despite its retry policy 'never'",
        )
    if expected_version is not None and expected_version != op.version:
        raise _stale(op, op.state, expected_version)
    if op.state not in states.NEEDS_REVIEW:
        raise IllegalTransition(
            f"expected operation {op.operation_id} in one of {sorted(states.NEEDS_REVIEW)} to "
            f"resolve it, found {op.state}",
            from_state=op.state,
            to_state=to_state,
        )
    changes = {}
    if external_id:
        _check_text(external_id, "external_id", max_length=500)
        changes["external_id"] = external_id
    if op.conflict == Conflict.AMBIGUOUS:
        changes["conflict"] = ""  # a person has decided between the matches
    with transaction.atomic(durable=True):
        return apply_transition(
            op, to_state, actor_kind=ActorKind.HUMAN, actor_id=user.get_username(),
            reason=reason.strip(), expected_version=expected_version, changes=changes,
        )
