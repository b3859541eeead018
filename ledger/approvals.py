"""Approval before a consequential call, bound to the exact intent that is finally sent.

An admin's policy (`set_policy`) names operations that wait for people before they are
submitted. The agent records its intent as usual, may ask with `request(op, note=)` (the
desk's "Awaiting approval" list) and waits (`wait`, `await_decision`). A reviewer approves
(`approve`), approves an edited intent (`approve(intent=)`: the operation keeps its key and
gets the new fingerprint, with an event) or denies (`deny`: the operation is abandoned and
the agent sees `errors.ApprovalDenied`).

An approval records the fingerprint and version its person saw, and counts only for that
fingerprint until it expires (the policy's ttl). `receipts.mark_submitted` asks
`check_can_submit` first, and PostgreSQL refuses the same planned -> submitted on its own
(`ledger.models.approval_gate`, one SQL text for both). Consequential policies take two
different people: the first approval proposes, a second person's completes it; nobody
approves twice.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.db import IntegrityError, transaction
from django.db.models import BooleanField
from django.db.models.expressions import RawSQL
from django.db.models.functions import Now
from django.utils import timezone

from ledger import access, audited, conf, transitions
from ledger.canonical import canonical_json, check_json, fingerprint, redact, scrub_text
from ledger.errors import (
    ApprovalDenied,
    ApprovalRequired,
    IllegalTransition,
    InvalidInput,
    NotFound,
    SecondPersonRequired,
    StaleVersion,
)
from ledger.inputs import (
    check_aware,
    check_duration,
    check_identifier,
    check_operation_pattern,
    check_positive_duration,
    check_reason,
    check_string,
    check_whole_number,
)
from ledger.models import (
    Approval,
    ApprovalPolicy,
    ApprovalPolicyChange,
    ApprovalRequest,
    Operation,
)
from ledger.models.approval_gate import GATE_HINT, pattern_matches_sql
from ledger.selectors.approvals import Gate, gate, pending_proposal  # noqa: F401 (a read)
from ledger.states import RetryPolicy, State

# How long an approval lasts when no policy says (an agent asked on its own).
DEFAULT_TTL = timedelta(hours=24)
MAX_TTL = timedelta(days=30)
MAX_NOTE = 2000
POLL = timedelta(milliseconds=200)


# --- policies (admins) ----------------------------------------------------------------------


def set_policy(
    pattern: str,
    *,
    user,
    tenant: str = "default",
    approvals_needed: int = 1,
    ttl: timedelta = DEFAULT_TTL,
    consequential: bool = False,
    requires_approval: bool = True,
) -> ApprovalPolicy:
    """Create or change the policy of (`tenant`, `pattern`); the change is audited.

    Needs `ledger.change_approvalpolicy` and the tenant grant. `pattern` is a glob over the
    operation name (`*`, `?`); `requires_approval=False` keeps the row but asks nothing.
    """
    check_operation_pattern(pattern)
    check_identifier(tenant, "tenant", 100)
    check_whole_number(approvals_needed, low=1, high=2,
                       expected="approvals_needed of 1 or 2")
    check_positive_duration(ttl, "ttl")
    check_duration(ttl, "ttl", high=MAX_TTL)
    if not isinstance(consequential, bool) or not isinstance(requires_approval, bool):
        raise InvalidInput(f"expected consequential and requires_approval to be booleans, "
                           f"found {consequential!r} and {requires_approval!r}")
    access.require_perm(user, "ledger.change_approvalpolicy", doing="set approval policies")
    access.require_tenant(user, tenant)
    values = {"requires_approval": requires_approval, "approvals_needed": approvals_needed,
              "approval_ttl": ttl, "consequential": consequential}
    return audited.set_policy_row(ApprovalPolicy, ApprovalPolicyChange, tenant=tenant,
                                  pattern=pattern, values=values, user=user)


def policies_for(tenant: str, operation: str):
    """The policies asking approval of `operation` in `tenant` (the gate's own match)."""
    matches = pattern_matches_sql("%s", '"ledger_approvalpolicy"."pattern"')
    return ApprovalPolicy.objects.filter(tenant=tenant, requires_approval=True).alias(
        matches=RawSQL(matches, [operation], output_field=BooleanField())
    ).filter(matches=True)


def takes_two_people(op: Operation, to_state: str) -> bool:
    """Whether a person's move of `op` to `to_state` (`receipts.resolve`) takes two people:
    safe_to_retry on a `never` operation, or a consequential policy matching it (the same
    rule as PostgreSQL's, `ledger.models.approval_gate.TWO_PERSON_TRIGGER`)."""
    if to_state == State.SAFE_TO_RETRY and op.retry_policy == RetryPolicy.NEVER:
        return True
    return policies_for(op.tenant, op.operation).filter(consequential=True).exists()


# --- what an operation needs ------------------------------------------------------------------


def check_can_submit(op: Operation) -> None:
    """Raise unless `op` may go planned -> submitted now (one query; `mark_submitted` asks
    only when PostgreSQL refused).

    ApprovalDenied when a person denied it; ApprovalRequired when it needs more live
    approvals of its current fingerprint, or when a reviewer edited the intent since `op`
    was read (send the approved intent: `wait` returns the operation carrying it).
    PostgreSQL checks the same on the UPDATE itself.
    """
    if op.state != State.PLANNED:
        return
    current = gate(op)
    if current.denial is not None:
        raise ApprovalDenied(
            f"expected operation {op.operation_id} approved before it is sent, found it "
            f"denied: {current.denial}", reason=current.denial, operation=op,
        )
    if current.is_open and current.intent_fingerprint == op.intent_fingerprint:
        return
    if current.intent_fingerprint != op.intent_fingerprint:
        raise ApprovalRequired(
            f"expected to send the approved intent of operation {op.operation_id} "
            f"(fingerprint {current.intent_fingerprint}), found the caller holding "
            f"fingerprint {op.intent_fingerprint}: a reviewer edited it; send the intent of "
            "the operation approvals.wait returns", operation=op,
            needed=current.needed, have=current.have,
        )
    raise ApprovalRequired(_missing(op, current), operation=op, needed=current.needed,
                           have=current.have)


def gated(mark_submitted: Callable[..., Operation]) -> Callable[..., Operation]:
    """`receipts.mark_submitted`, telling an agent why its planned operation may not go.

    Costs nothing when the operation may go: PostgreSQL's gate runs inside the change
    itself. When it refuses (or the change finds the row moved on because a reviewer
    edited or denied it), `check_can_submit` says why: ApprovalRequired or ApprovalDenied.
    """

    @functools.wraps(mark_submitted)
    def wrapper(op: Operation, *args, **kwargs) -> Operation:
        planned = isinstance(op, Operation) and op.state == State.PLANNED
        try:
            return mark_submitted(op, *args, **kwargs)
        except IntegrityError as exc:
            if not planned or _hint(exc) != GATE_HINT:
                raise
            check_can_submit(op)
            raise ApprovalRequired(f"expected enough live approvals of operation "
                                   f"{op.operation_id}, found PostgreSQL refusing: {exc}",
                                   operation=op) from exc
        except StaleVersion:
            if planned:
                _explain_stale(op)
            raise

    return wrapper


def _hint(exc: IntegrityError) -> str | None:
    diag = getattr(exc.__cause__, "diag", None)
    return None if diag is None else diag.message_hint


def _explain_stale(op: Operation) -> None:
    """A planned operation that moved on under its agent: denied, or its intent edited."""
    current = gate(op)
    if current.denial is not None or current.intent_fingerprint != op.intent_fingerprint:
        check_can_submit(op)


def _missing(op: Operation, current: Gate) -> str:
    asking = (f"approval policy {current.patterns}" if current.patterns
              else "the agent's request")
    return (f"expected {current.needed} live approval(s) of operation {op.operation_id} "
            f"(fingerprint {current.intent_fingerprint}, {asking}) before it is sent, "
            f"found {current.have}")


# --- the agent's side ------------------------------------------------------------------------


def request(op: Operation, *, note: str = "", actor: str | None = None) -> Operation:
    """Put the planned `op` on the desk's "Awaiting approval" list, with the agent's note.

    Asking again (after an expiry, or with a new note) puts it back on the list. The
    operation then needs at least one approval even if no policy matches it.
    """
    note = scrub_text(check_string(note, "note", MAX_NOTE))
    actor = scrub_text(check_string(actor or "", "actor", 200))
    if not isinstance(op, Operation) or op.pk is None:
        raise InvalidInput(f"expected a saved Operation, found {op!r}")
    people = max([1, *(p.people_needed for p in policies_for(op.tenant, op.operation))])
    now = timezone.now()
    with transaction.atomic(durable=True):
        current = Operation.objects.select_for_update().filter(pk=op.pk).first()
        if current is None:  # gone, or another tenant's for a login limited to its own
            raise NotFound(f"expected operation {op.operation_id!r} among the tenants this "
                           "login may see, found none")
        if current.state != State.PLANNED:
            raise IllegalTransition(
                f"expected operation {op.operation_id} planned to ask approval of it, found "
                f"{current.state}", from_state=current.state, to_state=current.state,
            )
        ApprovalRequest.objects.update_or_create(
            operation=current,
            defaults={"tenant": current.tenant, "note": note, "requested_by": actor,
                      "approvals_needed": people, "status": ApprovalRequest.Status.PENDING,
                      "requested_at": now, "decided_at": None},
        )
    return current


def wait(op: Operation, *, timeout: timedelta | float, poll: timedelta = POLL) -> Operation:
    """Block until `op` may be submitted; returns the operation as approved (its intent is
    the one to send: a reviewer may have edited it).

    Raises ApprovalDenied when a person denied it, ApprovalRequired when `timeout` passes
    first. Polls the database every `poll`; never holds a transaction while it sleeps.
    """
    limit = _seconds(timeout)
    deadline = time.monotonic() + limit
    while True:
        decided = _decided(op)
        if decided is not None:
            return decided
        if time.monotonic() >= deadline:
            raise _timed_out(op, limit)
        time.sleep(min(_seconds(poll), max(0.0, deadline - time.monotonic())))


async def await_decision(op: Operation, *, timeout: timedelta | float,
                         poll: timedelta = POLL) -> Operation:
    """`wait` for async agents: the loop keeps running while the decision is pending."""
    limit = _seconds(timeout)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    decided_now = sync_to_async(_decided, thread_sensitive=True)
    while True:
        decided = await decided_now(op)
        if decided is not None:
            return decided
        if loop.time() >= deadline:
            raise _timed_out(op, limit)
        await asyncio.sleep(min(_seconds(poll), max(0.0, deadline - loop.time())))


def _seconds(value: timedelta | float) -> float:
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 86400:
        raise InvalidInput(f"expected a timeout from 0 to 1 day (seconds or a timedelta), "
                           f"found {value!r}")
    return float(value)


def _decided(op: Operation) -> Operation | None:
    """The operation when its decision is taken (approved, or already past planned); None
    while pending; ApprovalDenied for a denial."""
    current = gate(op)
    if current.denial is not None:
        raise ApprovalDenied(
            f"expected operation {op.operation_id} approved, found it denied: "
            f"{current.denial}", reason=current.denial, operation=op,
        )
    if current.state != State.PLANNED or current.is_open:
        return Operation.objects.get(pk=op.pk)
    return None


def _timed_out(op: Operation, limit: float) -> ApprovalRequired:
    current = gate(op)
    return ApprovalRequired(
        f"expected a decision on operation {op.operation_id} within {limit:g} s, found none "
        f"yet: {current.have} of {current.needed} approval(s)", operation=op,
        needed=current.needed, have=current.have,
    )


# --- the reviewer's side ---------------------------------------------------------------------


def approve(
    op: Operation,
    *,
    user,
    reason: str = "",
    intent: Mapping[str, Any] | None = None,
    expected_version: int | None = None,
    now: datetime | None = None,
) -> Operation:
    """Approve the planned `op` as it is, or (with `intent`) approve a changed intent.

    Needs `ledger.resolve_operation` and the tenant grant. The approval records the
    fingerprint and version seen and lasts the strictest matching policy's ttl from `now`
    (default: the current time). `expected_version` (default `op.version`) is the version
    the person decided on: StaleVersion if it changed since, and nothing is written. An
    edited intent is checked like a recorded one (secrets masked, size), replaces the
    operation's intent and fingerprint, steps its version and is audited by an event; the
    key stays. A person who already approved this intent: SecondPersonRequired.
    """
    reason = scrub_text(check_string(reason, "reason", 2000)).strip()
    now = check_aware(now, "now") or timezone.now()
    edited = None if intent is None else _checked_intent(intent)
    access.require_perm(user, "ledger.resolve_operation", doing="approve operations")
    access.require_tenant(user, op.tenant)
    with transaction.atomic(durable=True):
        current, version = _locked_planned(op, expected_version, doing="approve")
        old_fingerprint = current.intent_fingerprint
        if edited is not None and edited[1] == old_fingerprint:
            edited = None  # the "edit" changed nothing: a plain approval
        approved_fingerprint = old_fingerprint if edited is None else edited[1]
        if edited is None:
            _refuse_second_approval(current, user)
        Approval.objects.create(
            operation=current, tenant=current.tenant, decision=Approval.Decision.APPROVE,
            intent_fingerprint=approved_fingerprint, version=version,
            edited_from="" if edited is None else old_fingerprint, decided_by=user,
            decided_by_name=user.get_username(), reason=reason,
            expires_at=now + _ttl(current), created_at=now,
        )
        if edited is not None:
            transitions.by_intent_edit(current, user=user, intent=edited[0],
                                       intent_fingerprint=edited[1], reason=reason,
                                       expected_version=version)
        after = gate(current)
        if after.is_open:
            ApprovalRequest.objects.filter(operation=current).update(
                status=ApprovalRequest.Status.APPROVED, decided_at=now)
    _copy(current, op)
    return op


def deny(op: Operation, *, user, reason: str, expected_version: int | None = None) -> Operation:
    """Deny the planned `op`: it is abandoned (error_code ApprovalDenied, the reason as its
    detail) and its agent sees errors.ApprovalDenied. One person suffices. Needs
    `ledger.resolve_operation` and the tenant grant; StaleVersion as for `approve`."""
    reason = scrub_text(check_reason(reason))
    check_string(reason, "reason", 2000)
    access.require_perm(user, "ledger.resolve_operation", doing="deny operations")
    access.require_tenant(user, op.tenant)
    now = timezone.now()
    with transaction.atomic(durable=True):
        current, version = _locked_planned(op, expected_version, doing="deny")
        Approval.objects.create(
            operation=current, tenant=current.tenant, decision=Approval.Decision.DENY,
            intent_fingerprint=current.intent_fingerprint, version=version,
            decided_by=user, decided_by_name=user.get_username(), reason=reason,
            created_at=now,
        )
        ApprovalRequest.objects.filter(operation=current).update(
            status=ApprovalRequest.Status.DENIED, decided_at=now)
        transitions.by_denial(current, user=user, reason=reason, expected_version=version)
    _copy(current, op)
    return op


def _locked_planned(op: Operation, expected_version: int | None, *, doing: str):
    """The operation's row, locked to the commit, if it is still planned at the version the
    person decided on."""
    version = op.version if expected_version is None else expected_version
    check_whole_number(version, low=1, expected="a version >= 1")
    current = Operation.objects.select_for_update().filter(pk=op.pk).first()
    if current is None or current.version != version:
        raise transitions.stale_version_error(op, op.state, version)
    if current.state != State.PLANNED:
        raise IllegalTransition(
            f"expected operation {op.operation_id} planned to {doing} it, found "
            f"{current.state}", from_state=current.state, to_state=current.state,
        )
    return current, version


def _refuse_second_approval(op: Operation, user) -> None:
    mine = (Approval.objects.filter(
        operation=op, intent_fingerprint=op.intent_fingerprint,
        decision=Approval.Decision.APPROVE, decided_by=user, expires_at__gt=Now(),
    ).order_by("-created_at").first())
    if mine is not None:
        raise SecondPersonRequired(
            f"expected a person other than {user.get_username()} to approve operation "
            f"{op.operation_id} (fingerprint {op.intent_fingerprint}), found "
            f"{user.get_username()} approved it already at {mine.created_at:%Y-%m-%d %H:%M:%S} "
            "UTC; the next approval must be someone else's"
        )


def _ttl(op: Operation) -> timedelta:
    ttls = [p.approval_ttl for p in policies_for(op.tenant, op.operation)]
    return min(ttls) if ttls else DEFAULT_TTL


def _checked_intent(intent: Any) -> tuple[dict[str, Any], str]:
    """An edited intent as record_intent takes one: a JSON object, secrets masked, within
    the size limit; with its fingerprint (over the whole intent)."""
    if not isinstance(intent, Mapping):
        raise InvalidInput(
            f"expected the edited intent to be a JSON object, found {type(intent).__name__}"
        )
    check_json(intent, what="intent")
    stored = redact(intent, [])
    size = len(canonical_json(stored).encode("utf-8"))
    if size > conf.MAX_INTENT_BYTES:
        raise InvalidInput(
            f"expected an edited intent of at most {conf.MAX_INTENT_BYTES:,} bytes of "
            f"canonical JSON (LEDGER_MAX_INTENT_BYTES), found {size:,} bytes"
        )
    return stored, fingerprint(stored, None)


def _copy(source: Operation, target: Operation) -> None:
    if source is target:
        return
    for field in Operation._meta.concrete_fields:
        setattr(target, field.attname, getattr(source, field.attname))
