"""Every change of an operation is written here, and nowhere else.

One change reads top to bottom in `_apply`:

1. validate: a saved operation, a known state, a move `ledger.states.TRANSITIONS` allows;
2. check the fence: an agent's write that carries a fencing token is checked against its
   run's lease `run:<tenant>:<run_id>` in the same transaction, and an agent's change of an
   operation whose run is leased must carry one. A reconciler's token is checked by
   PostgreSQL alone (`event_reconciler_fenced`, against `reconcile:<operation_id>`): its
   caller took or released that lease in the same transaction, which locked the row;
3. build the event: who, why, the evidence (secrets masked), the token, the time;
4. run `CHANGE_OPERATION`, one SQL statement whose CTEs are the row's compare-and-set on
   (state, version), the duplicate mark of a move to succeeded, and the event. They cannot
   come apart: a change that matches no row (someone else moved first) writes no event,
   and `_apply` raises StaleVersion naming who moved it. The event is written unsealed;
   the sealer links it into the tenant's hash chain once committed (`ledger.chain.seal`),
   so writers of one tenant never hold a shared row to their commit.

A new receipt is written the same way, by `record` with `INSERT_OPERATION`.

Each caller has its own function, which names the actor; nothing here changes an
operation for an arbitrary actor:

    record(op, actor=)                            receipts.record_intent
    record_and_submit(op, actor=, ...)            receipts.record_intent(submit=True)
    by_agent(op, to_state, actor=, ...)           receipts.mark_*: never a human decision
    by_person(op, to_state, user=, ...)           receipts.resolve, after its permission checks
    by_reconciler(op, to_state, worker=, ...)     reconcile: a claim and a verdict
    by_sweep(op, reason=, evidence=)              reconcile.sweep_stale_submissions
    flag_by_person(op, conflict, user=, ...)      receipts.acknowledge
    reread_by_reconciler(op, conflict, worker=, ...)  reconcile: a re-read's finding
    by_denial(op, user=, reason=)                 approvals.deny: planned -> abandoned
    by_intent_edit(op, user=, intent=, ...)       approvals.approve(intent=): planned, new intent

`flag_by_person` and `reread_by_reconciler` change the conflict flag or the re-read
schedule of a terminal operation, not its state: the version steps by one (the transition
trigger allows that step for a terminal operation whose flag or `reread_due_at` changes,
and nothing else without a state change) and an event from the state to itself records who
and why, sealing the re-read's evidence, chained like every other event (`CHANGE_FLAG`).
`by_intent_edit` is the one change of a planned operation's intent (`EDIT_INTENT`), which
PostgreSQL admits only with a person's approval of exactly it.

`by_agent` and `by_person` are their own transaction, durable (a receipt is committed
before the external call, not when a caller's block ends), and `record` runs in the one
`single_statement()` of `record_intent`; `by_reconciler` and `by_sweep` run inside the
caller's transaction, which also stores evidence or releases a lease. PostgreSQL checks
every change again (`ledger.models.operations`: the transition trigger generated from
`ledger.states`, the event each change must carry, written by the same statement, each
column held to the moves that change it, and the event's own checks: a human-only move
names its deciding user, an agent's change of a leased run's operation carries the lease's
current token). The event's `chain_format` and `content` are set there too (its trigger
`event_chain_columns`), from the row the statement wrote.

These statements run on every receipt, so they are bound on the server and prepared
(`ledger.prepared`): PostgreSQL plans each shape once per connection.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime, timedelta
from typing import Any

import psycopg
from django.db import IntegrityError, OperationalError, connection, transaction
from django.utils import timezone

from ledger import access, chain, leases, states
from ledger.canonical import redact, scrub_text
from ledger.errors import (
    DependencyNotMet,
    IllegalTransition,
    InvalidInput,
    SecondPersonRequired,
    StaleFact,
    StaleFencingToken,
    StaleVersion,
)
from ledger.inputs import PG_INTEGER_MAX, check_json, check_user, storable
from ledger.models import Evidence, Operation, OperationEvent, ResolutionProposal
from ledger.models.operations import DEPENDENCY_HINT, FENCE_HINT, STALE_FACT_HINT, Conflict
from ledger.prepared import prepared_cursor
from ledger.selectors.approvals import pending_proposal
from ledger.states import ActorKind, State

# --- who changes what ----------------------------------------------------------------------


def record(op: Operation, *, actor: str = "") -> bool:
    """INSERT the new receipt `op` (unsaved, planned) with its first event.

    Unless its (tenant, operation, idempotency_key) exists: then nothing is written (no
    IntegrityError either: a concurrent recorder of the same key loses quietly) and it
    returns False. True: written, and `op` carries its primary key.
    """
    return _insert(op, _record_params(op, actor))


def _record_params(op: Operation, actor: str) -> dict[str, Any]:
    """INSERT_OPERATION's parameters for the new receipt `op` and its first event."""
    event = _event(op, from_state="", to_state=State.PLANNED, version=1,
                   actor_kind=ActorKind.AGENT, actor_id=actor, reason="intent recorded",
                   now=op.created_at, external_id=op.external_id)
    values = _db_values({field.attname: getattr(op, field.attname) for field in _INSERTED})
    return {**values, **event}


def _insert(op: Operation, params: dict[str, Any]) -> bool:
    with prepared_cursor() as cursor:
        cursor.execute(INSERT_OPERATION, params)
        row = cursor.fetchone()
    if row is None:
        return False
    op.pk = row[0]
    op._state.adding = False
    return True


def record_and_submit(
    op: Operation,
    *,
    actor: str = "",
    reason: str,
    changes: Mapping[str, Any],
    fencing_token: int | None = None,
) -> bool:
    """`record(op)` and `by_agent(op, submitted)` in one transaction, one commit: the new
    receipt, its planned event, the move to submitted and its event (`receipts.
    record_intent(submit=True)`). Every rule of the two holds as when they run apart (the
    fence is checked in this transaction, PostgreSQL's gates run inside the change); a
    refusal rolls both back and is raised, and the caller records the intent alone.

    False: the key exists (a concurrent recorder won); nothing written, `op` unsaved.
    Outside a transaction and without a fence, BEGIN, the two statements and COMMIT go
    to PostgreSQL in one round trip (psycopg's pipeline): one round trip and one commit
    fewer than the two apart.
    """
    insert = _record_params(op, actor)
    try:
        with _refusals():
            fenced = fencing_token is not None or op.run_id is not None
            if (fenced or not connection.get_autocommit() or connection.in_atomic_block
                    or not _PIPELINES):
                with transaction.atomic(durable=True):
                    if not _insert(op, insert):
                        return False
                    _apply(op, State.SUBMITTED, actor_kind=ActorKind.AGENT, actor_id=actor,
                           reason=reason, changes=changes, fencing_token=fencing_token,
                           fenced=True)
                    return True
            return _pipelined(op, insert, actor=actor, reason=reason, changes=changes)
    except IntegrityError as exc:
        if _FENCE_REFUSAL in str(exc):
            raise StaleFencingToken(str(exc).splitlines()[0]) from exc
        raise


# Whether this libpq sends pipelines (14 and later; psycopg's binary wheels bundle one).
_PIPELINES = psycopg.Pipeline.is_supported()

# The change of a receipt inserted by the same pipeline (`_pipelined`): the row is found by
# its new operation_id, since its primary key is not known when the change is sent; a key
# that was taken (nothing inserted) leaves the change nothing to match.
_OF_NEW_ROW = "WHERE id = (SELECT id FROM ledger_operation WHERE operation_id = %(new_row)s) AND"


def _pipelined(op: Operation, insert: dict[str, Any], *, actor: str, reason: str,
               changes: Mapping[str, Any]) -> bool:
    """`record_and_submit` of an unfenced receipt on a connection in autocommit: BEGIN,
    INSERT_OPERATION, CHANGE_OPERATION and COMMIT in one pipeline, one round trip."""
    sql, params, fields = _change(op, State.SUBMITTED, from_state=State.PLANNED, version=1,
                                  actor_kind=ActorKind.AGENT, actor_id=actor, reason=reason,
                                  evidence=None, fencing_token=None, decided_by=None,
                                  changes=changes, evidence_row=None)
    sql = sql.replace("WHERE id = %(id)s AND", _OF_NEW_ROW, 1)
    assert _OF_NEW_ROW in sql, "CHANGE_OPERATION names its row by id"
    params = {**params, "new_row": op.operation_id}
    del params["id"]
    with prepared_cursor() as inserted, prepared_cursor() as changed:
        raw = connection.connection
        try:
            with connection.wrap_database_errors, raw.pipeline():
                raw.execute("BEGIN")
                inserted.execute(INSERT_OPERATION, insert)
                changed.execute(sql, params)
                raw.execute("COMMIT")
        except BaseException:
            # A refusal aborts the transaction block and skips the COMMIT: end it.
            if raw.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                with connection.wrap_database_errors:
                    raw.execute("ROLLBACK")
            raise
        new, moved = inserted.fetchone(), changed.fetchone()
    if new is None or moved is None:
        return False  # the key was taken (or, never seen, recorded alone: found as planned)
    op.pk = new[0]
    op._state.adding = False
    fields["conflict"] = moved[1]
    for name, value in fields.items():
        setattr(op, name, value)
    return True


def by_agent(
    op: Operation,
    to_state: str,
    *,
    actor: str | None = "",
    reason: str,
    changes: Mapping[str, Any] | None = None,
    evidence: Any = None,
    fencing_token: int | None = None,
    expected_version: int | None = None,
) -> Operation:
    """An agent reports its own call (`receipts.mark_*`); a human decision is refused.

    `expected_version` (default `op.version`) is the version the agent acted on.
    """
    _refuse_human_decision(op, to_state, found="an agent trying to")
    # The change of an operation of a run checks the run's lease in the same transaction
    # (two statements): once the run is leased, only its current token may change it.
    fenced = fencing_token is not None or getattr(op, "run_id", None) is not None

    def write() -> Operation:
        with _refusals(), transaction.atomic(durable=True) if fenced else single_statement():
            return _apply(op, to_state, actor_kind=ActorKind.AGENT, actor_id=actor or "",
                          reason=reason, changes=changes, evidence=evidence,
                          fencing_token=fencing_token, expected_version=expected_version,
                          fenced=True)

    try:
        return riding_lost_answers(write)
    except IntegrityError as exc:
        # PostgreSQL's own fence (the event trigger): a lease taken between the look at it
        # above and the event, when there was none to lock.
        if _FENCE_REFUSAL in str(exc):
            raise StaleFencingToken(str(exc).splitlines()[0]) from exc
        raise


def check_person(user, op: Operation, doing: str):
    """A saved user who may decide on `op`: `ledger.resolve_operation` and a grant of its
    tenant, at this moment (PermissionDenied otherwise). PostgreSQL checks the same of the
    event's `decided_by` (migration 0030); this refuses first, with the ledger's error."""
    check_user(user, doing)
    access.require_perm(user, "ledger.resolve_operation", doing=doing)
    access.require_tenant(user, op.tenant)
    return user


def by_person(
    op: Operation,
    to_state: str,
    *,
    user,
    reason: str,
    expected_version: int | None = None,
    changes: Mapping[str, Any] | None = None,
) -> Operation:
    """A person's decision (`receipts.resolve`, which checks permissions and input first).

    Only the moves `states.HUMAN_DECISIONS` lists; the event names the deciding user.
    """
    if not states.is_human_only(op.state, to_state):
        raise IllegalTransition(
            f"expected a decision on operation {op.operation_id} among "
            f"{states.listed(states.resolutions_from(op.state), empty='none')} from "
            f"{op.state}, found "
            f"{op.state} -> {to_state}",
            from_state=op.state,
            to_state=to_state,
        )
    check_person(user, op, f"decide on operation {op.operation_id}")
    with transaction.atomic(durable=True):
        return _apply(op, to_state, actor_kind=ActorKind.HUMAN, actor_id=user.get_username(),
                      decided_by=user.pk, reason=reason, expected_version=expected_version,
                      changes=changes)


def by_second_person(
    op: Operation,
    to_state: str,
    *,
    user,
    reason: str,
    proposal,
    expected_version: int | None = None,
    changes: Mapping[str, Any] | None = None,
) -> Operation:
    """The second person's decision completing `proposal` (a ResolutionProposal of the same
    move by someone else), inside the caller's transaction (`receipts.resolve`, which holds
    the row's lock). The event names the deciding user and, in its evidence, the proposer;
    PostgreSQL refuses such a move without the proposal."""
    if not states.is_human_only(op.state, to_state) or proposal.to_state != to_state:
        raise IllegalTransition(
            f"expected the decision proposed on operation {op.operation_id} "
            f"({proposal.to_state}) among {states.listed(states.resolutions_from(op.state))}, "
            f"found "
            f"{op.state} -> {to_state}", from_state=op.state, to_state=to_state,
        )
    check_person(user, op, f"decide on operation {op.operation_id}")
    evidence = {"two_person": {
        "proposal_id": proposal.pk, "proposed_by": proposal.proposed_by_name,
        "proposed_by_id": proposal.proposed_by_id, "proposal_reason": proposal.reason,
        "proposed_at": proposal.created_at.isoformat(), "version": proposal.version,
    }}
    return _apply(op, to_state, actor_kind=ActorKind.HUMAN, actor_id=user.get_username(),
                  decided_by=user.pk, reason=reason, expected_version=expected_version,
                  changes=changes, evidence=evidence)


def by_two_people(
    op: Operation,
    to_state: str,
    *,
    user,
    reason: str,
    version: int,
    changes: Mapping[str, Any] | None = None,
) -> Operation:
    """A person's decision under the two-person rule (`receipts.resolve`, which checks
    permissions and input first), in one transaction of its own: with the row locked at
    `version` (StaleVersion otherwise), a pending proposal of the same move by someone else
    is completed (`by_second_person`, the proposal's external id carried over); the
    proposer's own again raises SecondPersonRequired; anything else records this person's
    decision as the proposal (replacing a pending one of another move).

    Returns the operation as it now stands, with `proposal_recorded` saying whether this
    call recorded a proposal (the operation then stays as it was).
    """
    changes = dict(changes or {})
    with transaction.atomic(durable=True):
        current = Operation.objects.select_for_update().filter(pk=op.pk).first()
        if current is None or current.version != version:
            raise stale_version_error(op, op.state, version)
        pending = pending_proposal(current)
        if pending is not None and pending.to_state == to_state:
            if pending.proposed_by_id == user.pk:
                raise SecondPersonRequired(
                    f"expected a person other than {user.get_username()} to complete the "
                    f"proposal {to_state} of operation {op.operation_id} (version {version}), "
                    f"found {user.get_username()} proposed it at "
                    f"{pending.created_at:%Y-%m-%d %H:%M:%S} UTC; the decision takes two people"
                )
            if pending.external_id and "external_id" not in changes:
                changes["external_id"] = pending.external_id
            by_second_person(current, to_state, user=user, reason=reason, proposal=pending,
                             expected_version=version, changes=changes)
            current.proposal_recorded = False
        else:
            ResolutionProposal.objects.create(
                operation=current, tenant=current.tenant, to_state=to_state, version=version,
                external_id=changes.get("external_id") or "", proposed_by=user,
                proposed_by_name=user.get_username(), reason=reason,
                created_at=timezone.now(),
            )
            current.proposal_recorded = True
    return current


def by_reconciler(
    op: Operation,
    to_state: str,
    *,
    worker: str,
    token: int,
    resource: str,
    reason: str,
    expected_version: int | None = None,
    changes: Mapping[str, Any] | None = None,
    evidence: Any = None,
    evidence_row: Evidence | None = None,
) -> Operation:
    """A reconciler's claim or verdict, fenced by its lease `resource` (in the caller's
    transaction); a human decision is refused. `evidence_row`, the Evidence row the caller
    wrote in this transaction, is sealed by the event (`ledger.chain.evidence_seal`).

    The caller took (`leases.acquire`) or released (`leases.release`, which checks the
    token) the lease in this transaction; PostgreSQL checks the event's token against it
    (`event_reconciler_fenced`) and StaleFencingToken is raised when it is not current."""
    _refuse_human_decision(op, to_state, found=f"reconciler {worker} trying to")
    _check_reconciler_lease(op, resource)
    with _refusals():
        return _apply(op, to_state, actor_kind=ActorKind.RECONCILER, actor_id=worker,
                      reason=reason, fencing_token=token, expected_version=expected_version,
                      changes=changes, evidence=evidence, evidence_row=evidence_row)


def by_sweep(op: Operation, *, reason: str, evidence: Any) -> Operation:
    """submitted -> outcome_unknown for a sender that is gone (in the caller's transaction)."""
    return _apply(op, State.OUTCOME_UNKNOWN, actor_kind=ActorKind.SYSTEM,
                  actor_id="sweep_stale_submissions", reason=reason, evidence=evidence,
                  changes={"error_code": "SenderGone", "error_detail": reason})


def flag_by_person(
    op: Operation,
    conflict: str,
    *,
    user,
    reason: str,
    expected_version: int | None = None,
    evidence: Any = None,
) -> Operation:
    """A person sets the conflict flag of terminal `op` to `conflict` ("" settles it:
    `receipts.acknowledge`, which checks permissions and input first); in the caller's
    transaction. The event names the user."""
    check_person(user, op, f"acknowledge operation {op.operation_id}")
    return _apply_flag(op, conflict, actor_kind=ActorKind.HUMAN, actor_id=user.get_username(),
                       reason=reason, expected_version=expected_version, evidence=evidence,
                       decided_by=user.pk)


def reread_by_reconciler(
    op: Operation,
    conflict: str,
    *,
    worker: str,
    token: int,
    resource: str,
    reason: str,
    reread_due_at: datetime | None,
    reconcile_failures: int,
    evidence_row: Evidence,
    evidence: Any = None,
) -> Operation:
    """A re-read's finding on terminal `op` (`reconcile.settle_reread`), fenced by the
    worker's lease `resource`, in the caller's transaction: the flag (`conflict`, unchanged
    when nothing new was found), the next re-read (`reread_due_at`, None when done) and the
    failures in a row, with an event sealing `evidence_row`, so that every re-read is in
    the chain."""
    _check_reconciler_lease(op, resource)
    with _refusals():
        return _apply_flag(op, conflict, actor_kind=ActorKind.RECONCILER, actor_id=worker,
                           reason=reason, evidence=evidence, fencing_token=token,
                           evidence_row=evidence_row,
                           changes={"reread_due_at": reread_due_at,
                                    "reconcile_failures": reconcile_failures})


def _check_reconciler_lease(op: Operation, resource: str) -> None:
    """The lease a reconciler's change is fenced by is its operation's, and no other."""
    if isinstance(op, Operation) and resource != f"reconcile:{op.operation_id}":
        raise InvalidInput(f"expected the lease reconcile:{op.operation_id} to fence a "
                           f"reconciler's change of its operation, found {resource!r}")


@contextmanager
def _refusals() -> Iterator[None]:
    """PostgreSQL's refusals that the ledger names, as its own errors: a reconciler's stale
    token (StaleFencingToken with the current one), a step's operation submitted before
    its dependencies are committed (DependencyNotMet with the missing steps), an operation
    submitted on a fact version since superseded (StaleFact with the current version)."""
    try:
        yield
    except IntegrityError as exc:
        diag = getattr(exc.__cause__, "diag", None)
        hint = None if diag is None else diag.message_hint
        if hint == FENCE_HINT:
            current = int(diag.message_detail) if diag.message_detail else None
            raise StaleFencingToken(diag.message_primary, current_token=current) from exc
        if hint == DEPENDENCY_HINT:
            raise DependencyNotMet(diag.message_primary,
                                   missing=json.loads(diag.message_detail)) from exc
        if hint == STALE_FACT_HINT:
            raise StaleFact(diag.message_primary,
                            current=_current_of(int(diag.message_detail))) from exc
        raise


def _current_of(fact_id: int):
    """The current version of the fact whose version `fact_id` went stale, or None."""
    from ledger.models import Fact
    from ledger.selectors import facts as fact_reads

    stale = Fact.objects.filter(pk=fact_id).first()
    if stale is None:
        return None
    return fact_reads.current_fact(stale.tenant, stale.subject, stale.predicate)


def by_denial(op: Operation, *, user, reason: str, expected_version: int | None = None
              ) -> Operation:
    """planned -> abandoned: a person denied its approval (`ledger.approvals.deny`, which
    checks permissions and records the denial in the same transaction, the caller's)."""
    return _apply(op, State.ABANDONED, actor_kind=ActorKind.HUMAN,
                  actor_id=user.get_username(), reason=f"approval denied: {reason}",
                  expected_version=expected_version,
                  decided_by=check_person(user, op, "deny operations").pk,
                  changes={"error_code": "ApprovalDenied", "error_detail": reason})


def by_intent_edit(
    op: Operation,
    *,
    user,
    intent: Mapping[str, Any],
    intent_fingerprint: str,
    reason: str,
    expected_version: int | None = None,
) -> Operation:
    """A planned operation's intent replaced by the one a person approved
    (`ledger.approvals.approve(intent=)`, in its transaction, after the approval row).

    The operation keeps its id and key and stays planned; its version steps by one, with an
    event planned -> planned naming both fingerprints, so an agent still holding the old
    intent cannot submit it (StaleVersion). PostgreSQL allows the new fingerprint only with
    that step and with a person's approval of exactly it.
    """
    if op.state != State.PLANNED:
        raise IllegalTransition(
            f"expected operation {op.operation_id} planned to edit its intent, found {op.state}",
            from_state=op.state, to_state=State.PLANNED,
        )
    version = op.version if expected_version is None else expected_version
    if version >= PG_INTEGER_MAX:  # its successor would not fit the integer column
        raise stale_version_error(op, op.state, version)
    event = _event(op, from_state=State.PLANNED, to_state=State.PLANNED, version=version + 1,
                   actor_kind=ActorKind.HUMAN, actor_id=user.get_username(),
                   reason=f"intent edited and approved: {reason}" if reason
                   else "intent edited and approved",
                   evidence={"edited_from": op.intent_fingerprint,
                             "edited_to": intent_fingerprint},
                   decided_by=check_person(user, op, "edit an intent").pk, now=timezone.now(),
                   external_id=op.external_id)
    params = {"id": op.pk, "from_version": version,
              **_db_values({"intent": intent, "intent_fingerprint": intent_fingerprint}),
              **event}
    with prepared_cursor() as cursor:
        cursor.execute(EDIT_INTENT, params)
        row = cursor.fetchone()
    if row is None:
        raise stale_version_error(op, State.PLANNED, version)
    op.intent, op.intent_fingerprint, op.version = intent, intent_fingerprint, version + 1
    return op


def single_statement() -> AbstractContextManager:
    """The transaction of an agent's write that is a single SQL statement.

    Every change here is one statement (the row and its event), and in
    autocommit mode PostgreSQL runs a statement as its own transaction, deferred event
    check included; so no BEGIN and COMMIT round trips around it. Inside a caller's
    transaction it is `atomic(durable=True)`, which refuses to nest: a receipt must be
    committed before the external call, not when the caller's block ends.
    """
    if connection.get_autocommit() and not connection.in_atomic_block:
        return nullcontext()
    return transaction.atomic(durable=True)


# How long an agent's write keeps trying when PostgreSQL's answer does not come (the
# connection cut, the server gone, a failover under way), in seconds; then the error.
LOST_ANSWER_RETRY_SECONDS = 20.0


# SQLSTATEs of an answer that is not the write's own (`answer_lost`): the connection failed
# (class 08), the server is shutting down, crashed or not yet accepting connections (a
# failover under way), or it rolled the write back for it to be tried again.
_TRY_AGAIN = ("57P01", "57P02", "57P03", "40001", "40P01")


def answer_lost(exc: OperationalError) -> bool:
    """Whether `exc` says the database did not answer the write (or rolled it back to be
    tried again), rather than answering it: a lost connection has no SQLSTATE, or one of
    class 08. A statement cancelled by statement_timeout (57014), a lock not available
    (55P03) or the server out of connections (53300) is the database's answer: the write
    is not tried again."""
    state = getattr(exc.__cause__, "sqlstate", None)
    return state is None or state.startswith("08") or state in _TRY_AGAIN


def riding_lost_answers[T](write: Callable[[], T]) -> T:
    """`write()` (one durable write of its own: a statement in autocommit, or a durable
    transaction), again on a new connection when the database does not answer it
    (`answer_lost`), until `LOST_ANSWER_RETRY_SECONDS` have passed (then its
    OperationalError). Any other error, OperationalError included, is raised at once.

    A write whose answer was lost may have committed: each write retried here finds its
    own first try instead of doing it twice. `record_intent` finds its row by key (and by
    the operation id it generated); a move finds its own event (`_apply`: same actor, same
    from and to, same version step, and the same time, which this process chose for the
    first try), and reports success, not StaleVersion. Inside a caller's transaction it
    runs once: a lost COMMIT there is the caller's to retry."""
    if connection.in_atomic_block:
        return write()
    deadline = time.monotonic() + LOST_ANSWER_RETRY_SECONDS
    delay = 0.05
    while True:
        try:
            return write()
        except OperationalError as exc:
            if (connection.in_atomic_block or not answer_lost(exc)
                    or time.monotonic() + delay > deadline):
                raise
        connection.close()  # the next try opens a connection (through libpq's hosts)
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


def stale_version_error(op: Operation, state: str, version: int) -> StaleVersion:
    """The StaleVersion for a change of `op` decided at (state, version): who changed the
    row since, when, and to what."""
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


def _refuse_human_decision(op: Operation, to_state: str, *, found: str) -> None:
    if states.is_human_only(op.state, to_state):
        raise IllegalTransition(
            f"expected a person to move operation {op.operation_id} from {op.state} to "
            f"{to_state} (receipts.resolve), found {found}",
            from_state=op.state,
            to_state=to_state,
        )


# --- one change ----------------------------------------------------------------------------


def _apply(
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
    fenced: bool = False,
    decided_by: int | None = None,
    evidence_row: Evidence | None = None,
) -> Operation:
    """Move `op` to `to_state` inside the caller's transaction; updates `op` in place.

    Behind the functions above, which decide who may make the move. Compare-and-set on
    (state, version): raises IllegalTransition when the table forbids the move,
    StaleVersion when someone else changed the row first, StaleFencingToken when an
    agent's `fencing_token` is not the current token of the run's lease, or, with `fenced`
    (an agent's write), when the run is leased and no token is given (a reconciler's token
    is PostgreSQL's to check: `by_reconciler`). The token is recorded on the event, and
    `decided_by` (the deciding user's primary key: PostgreSQL refuses a human decision
    without it).
    """
    # 1. Validate.
    if not isinstance(op, Operation) or op.pk is None:
        raise InvalidInput(f"expected a saved Operation, found {op!r}")
    if to_state not in State.values:
        raise InvalidInput(f"expected a state among {State.values}, found {to_state!r}")
    from_state = op.state
    version = op.version if expected_version is None else expected_version
    if version >= PG_INTEGER_MAX:  # its successor would not fit the integer column
        raise stale_version_error(op, from_state, version)
    if not states.is_legal(from_state, to_state):
        raise IllegalTransition(
            f"illegal transition of operation {op.operation_id}: expected {from_state} -> one "
            f"of {states.listed(states.targets(from_state), empty='none (terminal)')}, found "
            f"{from_state} -> "
            f"{to_state}",
            from_state=from_state,
            to_state=to_state,
        )

    # 2. Check the fence (an agent's; a reconciler's is the event trigger's alone).
    if actor_kind == ActorKind.RECONCILER:
        pass
    elif fencing_token is not None and op.run_id is None:
        raise InvalidInput(
            f"expected operation {op.operation_id} to belong to a run when a fencing_token "
            "is given, found run=None"
        )
    elif fencing_token is not None or (fenced and op.run_id is not None):
        leases.check_run(op.run_id, fencing_token)

    # 3. Build the event, and the row's new values. A retry of the same move on the same
    # object (its answer lost) keeps the first try's time: its event, if it landed, is
    # this move's own (`_own_move`).
    move = (from_state, to_state, version + 1, actor_kind, actor_id or "")
    pending = getattr(op, "_ledger_pending_move", None)
    now = pending[1] if pending is not None and pending[0] == move else timezone.now()
    op._ledger_pending_move = (move, now)
    sql, params, fields = _change(op, to_state, from_state=from_state, version=version,
                                  actor_kind=actor_kind, actor_id=actor_id, reason=reason,
                                  evidence=evidence, fencing_token=fencing_token,
                                  decided_by=decided_by, changes=changes,
                                  evidence_row=evidence_row, now=now)
    # 4. One statement: the row, the duplicate mark, the chain link, the event.
    with prepared_cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None:
        if _own_move(op, move, now):
            op._ledger_pending_move = None
            op.refresh_from_db()
            return op
        raise stale_version_error(op, from_state, version)
    op._ledger_pending_move = None
    fields["conflict"] = row[1]
    for name, value in fields.items():
        setattr(op, name, value)
    return op


def _change(op: Operation, to_state: str, *, from_state: str, version: int, actor_kind: str,
            actor_id: str, reason: str, evidence: Any, fencing_token: int | None,
            decided_by: int | None, changes: Mapping[str, Any] | None,
            evidence_row: Evidence | None,
            now: datetime | None = None) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(CHANGE_OPERATION's text, its parameters, the row's new values) of `_apply`'s move,
    at `now` (the time of its event; default: now)."""
    now = now or timezone.now()
    fields: dict[str, Any] = dict(changes or {})
    if evidence_row is not None and evidence_row.operation_id != op.pk:
        raise InvalidInput(
            f"expected evidence of operation {op.operation_id} to seal, found evidence row "
            f"{evidence_row.pk} of operation pk {evidence_row.operation_id}"
        )
    event = _event(op, from_state=from_state, to_state=to_state, version=version + 1,
                   actor_kind=actor_kind, actor_id=actor_id, reason=reason, evidence=evidence,
                   fencing_token=fencing_token, decided_by=decided_by, now=now,
                   external_id=fields.get("external_id", op.external_id),
                   evidence_row=evidence_row)
    fields.update(state=to_state, version=version + 1, state_changed_at=now)
    if to_state in states.TERMINAL:
        fields["completed_at"] = now
    if to_state == State.SUBMITTED:
        fields.setdefault("submitted_at", now)
    if to_state == State.OUTCOME_UNKNOWN and from_state == State.SUBMITTED:
        fields["unknown_since"] = now
        # The in-flight window counts from the give-up (the agent's timeout, or the sweep
        # of a sender that is gone), not from submission: a request that hung past its
        # window may still land after the sender stopped waiting for it.
        if op.in_flight_until is not None and op.submitted_at is not None:
            fields["in_flight_until"] = now + max(op.in_flight_until - op.submitted_at,
                                                  timedelta(0))

    also_set = {name: value for name, value in fields.items() if name not in _ALWAYS_SET}
    params = {
        "id": op.pk, "from_version": version, "conflict": fields.get("conflict"),
        **{f"new_{name}": value for name, value in _db_values(also_set).items()},
        **event,
    }
    return _change_operation(tuple(also_set)), params, fields


def _own_move(op: Operation, move: tuple, now: datetime) -> bool:
    """Whether `move` (from, to, version, actor kind, actor id) is already applied to `op`
    by an earlier try of this same change whose answer was lost: its event carries the
    time this process chose for that try. Another caller's move, even by the same actor
    at the same version, has an event of another time, and stays a StaleVersion."""
    from_state, to_state, version, actor_kind, actor_id = move
    return OperationEvent.objects.filter(
        operation_id=op.pk, version=version, from_state=from_state, to_state=to_state,
        actor_kind=actor_kind, actor_id=storable(actor_id, 200), created_at=now).exists()


def _apply_flag(
    op: Operation,
    conflict: str,
    *,
    actor_kind: str,
    actor_id: str,
    reason: str,
    expected_version: int | None = None,
    changes: Mapping[str, Any] | None = None,
    evidence: Any = None,
    fencing_token: int | None = None,
    decided_by: int | None = None,
    evidence_row: Evidence | None = None,
) -> Operation:
    """Set the conflict flag of terminal `op` to `conflict` (and `changes`: the re-read
    schedule), stepping its version by one, with its event (state to itself); updates `op`
    in place.

    Raises IllegalTransition for an operation that is not terminal, InvalidInput for an
    unknown flag, StaleVersion when the row moved on since `expected_version` (default
    `op.version`) or already carries `conflict` (unless the re-read schedule changes).
    """
    if not isinstance(op, Operation) or op.pk is None:
        raise InvalidInput(f"expected a saved Operation, found {op!r}")
    if conflict not in ("", *Conflict.values):
        raise InvalidInput(
            f"expected a conflict flag among {['', *Conflict.values]}, found {conflict!r}"
        )
    if op.state not in states.TERMINAL:
        raise IllegalTransition(
            f"expected a terminal operation ({states.listed(states.TERMINAL)}) to change "
            f"the conflict flag of, found operation {op.operation_id} {op.state}",
            from_state=op.state, to_state=op.state,
        )
    version = op.version if expected_version is None else expected_version
    if version >= PG_INTEGER_MAX:  # its successor would not fit the integer column
        raise stale_version_error(op, op.state, version)
    now = timezone.now()
    flag = {"from": op.conflict, "to": conflict}
    event = _event(op, from_state=op.state, to_state=op.state, version=version + 1,
                   actor_kind=actor_kind, actor_id=actor_id, reason=reason,
                   evidence={"conflict": flag, **(evidence or {})},
                   fencing_token=fencing_token, decided_by=decided_by, now=now,
                   external_id=op.external_id, evidence_row=evidence_row)
    also_set = dict(changes or {})
    params = {
        "id": op.pk, "from_version": version, "conflict": conflict,
        "rereading": "reread_due_at" in also_set,
        **{f"new_{name}": value for name, value in _db_values(also_set).items()},
        **event,
    }
    with prepared_cursor() as cursor:
        cursor.execute(_change_flag(tuple(also_set)), params)
        row = cursor.fetchone()
    if row is None:
        raise stale_version_error(op, op.state, version)
    op.version, op.conflict = version + 1, conflict
    for name, value in also_set.items():
        setattr(op, name, value)
    return op


def _event(
    op: Operation,
    *,
    from_state: str,
    to_state: str,
    version: int,
    actor_kind: str,
    actor_id: str = "",
    reason: str = "",
    evidence: Any = None,
    fencing_token: int | None = None,
    decided_by: int | None = None,
    now: datetime,
    external_id: str = "",
    evidence_row: Evidence | None = None,
) -> dict[str, Any]:
    """The event's parameters of the statements below: with the operation's `external_id`
    after the move (which the statement also sets on the row) and the seal of
    `evidence_row`, which its chain link will cover. The event's `chain_format` and
    `content` PostgreSQL sets, from the row the statement wrote (ledger.chain_content).

    Evidence and reasons are agent- or person-written: secrets are masked before storage.
    """
    if evidence is not None:
        check_json(evidence, what="evidence")
        evidence = chain.normalize(redact(evidence))
    # Names and reasons reach here already checked by the public functions; what still
    # comes from the outside world (an exception's message inside a reason) is made
    # storable rather than refused, so the change is never lost to its description.
    actor_id = storable(actor_id or "", 200)
    reason = scrub_text(storable(reason or "", 4000))
    external_id = external_id or ""
    seal = chain.evidence_seal(evidence_row) if evidence_row is not None else None
    return {
        "from_state": from_state, "to_state": to_state, "to_version": version,
        "actor_kind": actor_kind, "actor_id": actor_id, "reason": reason,
        "evidence": _EVIDENCE.get_db_prep_save(evidence, connection),
        "fencing_token": fencing_token, "decided_by": decided_by, "now": now,
        "event_external_id": external_id,
        "evidence_seal": _SEAL.get_db_prep_save(seal, connection),
    }


def _db_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` (by attname of Operation) as the database takes them: JSON adapted."""
    return {name: _FIELD_BY_ATTNAME[name].get_db_prep_save(value, connection)
            for name, value in values.items()}


_FIELD_BY_ATTNAME = {field.attname: field for field in Operation._meta.concrete_fields}
_INSERTED = [field for field in Operation._meta.concrete_fields if not field.primary_key]
_EVIDENCE = OperationEvent._meta.get_field("evidence")
_SEAL = OperationEvent._meta.get_field("evidence_seal")
# Set by every change, in the statement's text; `conflict` has its own clause, and
# `external_id` is set to what the event records (the chain covers it).
_ALWAYS_SET = frozenset({"state", "version", "state_changed_at", "conflict", "external_id"})


# How the event trigger's refusal of an unfenced change begins (ledger.models.operations).
_FENCE_REFUSAL = "expected the current fencing token"


# --- the statements --------------------------------------------------------------------------


def _compact(sql: str) -> str:
    """`sql` on one line, as it is sent and prepared (its literals hold no runs of spaces)."""
    return " ".join(sql.split()).replace("( ", "(").replace(" )", ")")


# The CTE every write of an operation ends with (CHANGE_OPERATION, INSERT_OPERATION): the
# event recording the change, for each row of `changed`. It is written unsealed: the sealer
# links committed events into their tenant's chain within moments (ledger.chain.seal), so
# writers of one tenant never wait for each other's commits.
_EVENT = """event AS (
    INSERT INTO ledger_operationevent
           (operation_id, tenant, version, from_state, to_state, actor_kind, actor_id, reason,
            evidence, fencing_token, decided_by_id, created_at, external_id, evidence_seal)
    SELECT changed.id, changed.tenant, %(to_version)s, %(from_state)s, %(to_state)s,
           %(actor_kind)s, %(actor_id)s, %(reason)s, %(evidence)s, %(fencing_token)s,
           %(decided_by)s, %(now)s, %(event_external_id)s, %(evidence_seal)s
      FROM changed
    RETURNING operation_id
)
"""
# What every `changed` CTE returns besides: the columns the event's content is made of
# (the event's trigger reads them from the row itself; callers read them here).
_CONTENT = ", ".join(chain.CONTENT_COLUMNS)

# One change of an operation, as one statement, so that its parts cannot come apart:
#   changed     the compare-and-set of the row on (state, version): no row when someone
#               else changed it first, and then nothing below writes anything;
#   duplicates  on a move to succeeded, the other succeeded operations of the same tenant,
#               operation and fingerprint are marked duplicate (the row itself in `changed`);
#               any other move skips it before reading a row (a one-time filter on the
#               parameter, whatever plan PostgreSQL picks);
#   event       the OperationEvent, unsealed (the sealer links it into the tenant's chain
#               after the commit), carrying the external_id `changed` set (what its link
#               will cover, so verify_audit can hold the row to its last event) and the
#               seal of the Evidence row written in the same transaction, if any.
# `{also_set}` stands for the other columns the change sets (`_change_operation`).
CHANGE_OPERATION = _compact(f"""
WITH changed AS (
    UPDATE ledger_operation
       SET state = %(to_state)s, version = %(to_version)s, state_changed_at = %(now)s,
           external_id = %(event_external_id)s, conflict = CASE
               WHEN %(to_state)s::varchar = '{State.SUCCEEDED}' AND EXISTS (
                   SELECT 1 FROM ledger_operation twin
                    WHERE twin.tenant = ledger_operation.tenant
                      AND twin.operation = ledger_operation.operation
                      AND twin.intent_fingerprint = ledger_operation.intent_fingerprint
                      AND twin.state = '{State.SUCCEEDED}' AND twin.id <> ledger_operation.id)
               THEN 'duplicate'
               ELSE COALESCE(%(conflict)s, ledger_operation.conflict)
           END {{also_set}}
     WHERE id = %(id)s AND state = %(from_state)s AND version = %(from_version)s
    RETURNING id, tenant, operation, conflict, {_CONTENT}
),
duplicates AS (
    UPDATE ledger_operation twin SET conflict = 'duplicate'
      FROM changed
     WHERE %(to_state)s::varchar = '{State.SUCCEEDED}'
       AND twin.tenant = changed.tenant AND twin.operation = changed.operation
       AND twin.intent_fingerprint = changed.intent_fingerprint
       AND twin.state = '{State.SUCCEEDED}' AND twin.id <> changed.id
       AND twin.conflict <> 'duplicate'
),
{_EVENT}SELECT changed.id, changed.conflict
  FROM changed JOIN event ON event.operation_id = changed.id
""")


@functools.cache
def _change_operation(also_set: tuple[str, ...]) -> str:
    """CHANGE_OPERATION setting the columns `also_set` too (one text, hence one prepared
    statement, per set of columns)."""
    assignments = "".join(
        f", {connection.ops.quote_name(_FIELD_BY_ATTNAME[name].column)} = %(new_{name})s"
        for name in also_set
    )
    return CHANGE_OPERATION.replace(" {also_set}", assignments)


# A new receipt with its first event, unless its (tenant, operation, idempotency_key) is
# taken: then `changed` is empty and nothing is written. `event` as above.
INSERT_OPERATION = _compact(f"""
WITH changed AS (
    INSERT INTO ledger_operation
           ({", ".join(connection.ops.quote_name(field.column) for field in _INSERTED)})
    VALUES ({", ".join(f"%({field.attname})s" for field in _INSERTED)})
    ON CONFLICT (tenant, operation, idempotency_key) WHERE idempotency_key > '' DO NOTHING
    RETURNING id, tenant, {_CONTENT}
),
{_EVENT}SELECT changed.id FROM changed JOIN event ON event.operation_id = changed.id
""")


# The conflict flag of a terminal operation, with its event (`_apply_flag`): the row's
# compare-and-set on (state, version), refused too when the row already carries the flag
# (the duplicate mark of another operation's success sets it without an event) unless a
# re-read changes its schedule; then the event, as above. `{also_set}`
# as in CHANGE_OPERATION.
CHANGE_FLAG = _compact(f"""
WITH changed AS (
    UPDATE ledger_operation SET version = %(to_version)s, conflict = %(conflict)s {{also_set}}
     WHERE id = %(id)s AND state = %(from_state)s AND version = %(from_version)s
       AND (conflict <> %(conflict)s OR %(rereading)s)
    RETURNING id, tenant, {_CONTENT}
),
{_EVENT}SELECT changed.id FROM changed JOIN event ON event.operation_id = changed.id
""")


@functools.cache
def _change_flag(also_set: tuple[str, ...]) -> str:
    assignments = "".join(
        f", {connection.ops.quote_name(_FIELD_BY_ATTNAME[name].column)} = %(new_{name})s"
        for name in also_set
    )
    return CHANGE_FLAG.replace(" {also_set}", assignments)


# An approver's edit of a planned intent (`by_intent_edit`): the row (same state, version
# + 1, new intent and fingerprint) and its event planned -> planned, as above.
EDIT_INTENT = _compact(f"""
WITH changed AS (
    UPDATE ledger_operation
       SET intent = %(intent)s, intent_fingerprint = %(intent_fingerprint)s,
           version = %(to_version)s
     WHERE id = %(id)s AND state = '{State.PLANNED}' AND version = %(from_version)s
    RETURNING id, tenant, {_CONTENT}
),
{_EVENT}SELECT changed.id FROM changed JOIN event ON event.operation_id = changed.id
""")
