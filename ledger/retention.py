"""Retention: which policy governs an operation, what may be purged or redacted, and the purge.

An operation may be purged only when it is terminal AND completed more than the governing
policy's horizon ago (`purge_after_days`, or `keep_events_days` if longer: its events go with
it) AND nothing in `PURGE_BLOCKERS` holds it. The rule is SQL (`_purgeable_sql`): each batch
is picked and locked by it (a row that changed after it was counted is never taken).

The deletions and redactions themselves run in PostgreSQL, in the SECURITY DEFINER functions
`ledger_retention_purge` and `ledger_retention_redact` (migration 0014): the only way to
remove events and evidence or to change a settled receipt, even for the application role.
They check again that each operation is terminal and past its policy's horizon by the
database's clock, and write the audit themselves (PurgeRun counts, ChainAnchor, Redaction);
a database trigger also refuses deleting a non-terminal operation, whoever asks.

Redaction replaces the intent (and the payloads of its Evidence rows) of a terminal
operation `redact_after_days` after completion; the fingerprint, ids, states and events stay,
and each redaction is recorded in a `Redaction` row.

Policy writes (`set_policy`, `delete_policy`) are audited in `RetentionChange`.

Execution state (superseded facts, episodes, settled obligations) has policies of its own,
applied by the same `purge`: `ledger.retention_state`.
"""

from __future__ import annotations

import fnmatch
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from ledger import access, chain, retention_state
from ledger.errors import InvalidInput
from ledger.inputs import (
    check_aware,
    check_duration,
    check_identifier,
    check_operation_pattern,
    check_positive_duration,
    check_tenant_or_every,
    check_whole_number,
)
from ledger.models import (
    PurgeRun,
    RetentionChange,
    RetentionPolicy,
)
from ledger.states import TERMINAL

# What a redacted intent, evidence query or observation holds instead of its payload
# (defined beside the evidence seals, which account for it).
REDACTED_PAYLOAD = chain.REDACTED_PAYLOAD
MAX_DAYS = 36500
_WILDCARDS = "*?"
MAX_PAUSE = timedelta(minutes=1)
# What `manage.py purge` waits after each batch unless told otherwise: between batches the
# agents writing meanwhile get the database to themselves for a moment (bench/ P5 measures
# their p99 with and without it).
POLITE_PAUSE = timedelta(milliseconds=10)
# Operations per purge batch by default (at most: see BATCH_TARGET). A batch's cost is
# mostly PostgreSQL's foreign-key checks, eight per deleted operation (the tables that refer
# to it), run row by row: 6-9 ms per 250 operations since they are RESTRICT (migration 0029;
# 11-16 ms as NO ACTION); a batch of 250 takes about 20 ms, its pick and commit included
# (bench P5).
DEFAULT_BATCH = 250
# How long a batch's transaction should take at most. A batch that took longer halves the
# next one (down to MIN_BATCH); one that took under half of it grows the next by a quarter
# (up to the `batch` asked for). A busy server then gets smaller batches rather than longer
# locks: in bench P5 at 1M operations on 2 cores, the longest batches were the ones that
# waited 27-46 ms for a CPU while autovacuum ran (`p5_purge.py --waits`), several in a row.
BATCH_TARGET = timedelta(milliseconds=50)
MIN_BATCH = 10
Progress = Callable[[str], None]


# --- which policy governs ----------------------------------------------------------------


def specificity(policy: RetentionPolicy) -> tuple:
    """Sort key: the most specific policy first. Of the policies matching an operation:

    1. one naming the operation's tenant beats one for every tenant;
    2. then fewer wildcards (`*`, `?`) win: `articles.create` beats `articles.*`;
    3. then the longer literal prefix (text before the first wildcard) wins:
       `articles.c*` beats `articles.*`;
    4. then the longer pattern; last, alphabetical order, so the choice is always the same.
    The default policy (`*`, every tenant) therefore comes last.
    """
    pattern = policy.pattern
    wildcards = sum(pattern.count(c) for c in _WILDCARDS)
    prefix = len(re.split(r"[*?]", pattern, maxsplit=1)[0])
    return (0 if policy.tenant else 1, wildcards, -prefix, -len(pattern), pattern, policy.tenant)


def policies_by_specificity() -> list[RetentionPolicy]:
    return sorted(RetentionPolicy.objects.all(), key=specificity)


def matches(policy: RetentionPolicy, operation: str, tenant: str) -> bool:
    return (not policy.tenant or policy.tenant == tenant) and fnmatch.fnmatchcase(
        operation, policy.pattern
    )


def resolve_policy(
    operation: str, tenant: str, policies: list[RetentionPolicy] | None = None
) -> RetentionPolicy | None:
    """The policy that governs operations named `operation` in `tenant`, or None."""
    for policy in policies if policies is not None else policies_by_specificity():
        if matches(policy, operation, tenant):
            return policy
    return None


# --- policy writes -----------------------------------------------------------------------


def set_policy(
    pattern: str,
    *,
    tenant: str = "",
    purge_after_days: int,
    redact_after_days: int | None = None,
    keep_events_days: int | None = None,
    user,
) -> RetentionPolicy:
    """Create or change the policy for (`pattern`, `tenant`); audited with who, before, after.

    `keep_events_days` None means the same as `purge_after_days`; `redact_after_days` None
    means never redact. Needs `ledger.change_retentionpolicy`. Raises InvalidInput (writing
    nothing) for a malformed pattern or day count. A call that changes nothing writes nothing.
    """
    access.require_perm(user, "ledger.change_retentionpolicy", doing="change retention")
    values = check_policy_values(pattern, tenant, purge_after_days, redact_after_days,
                             keep_events_days)
    now = timezone.now()
    with transaction.atomic(durable=True):
        policy = (
            RetentionPolicy.objects.select_for_update()
            .filter(pattern=values["pattern"], tenant=values["tenant"]).first()
        )
        before = policy.as_audit_dict() if policy else None
        if before == values:
            return policy
        if policy is None:
            policy = RetentionPolicy(created_by=user, created_at=now, **values)
        for name, value in values.items():
            setattr(policy, name, value)
        policy.updated_by, policy.updated_at = user, now
        policy.save()
        _audit(policy, RetentionChange.Action.UPDATED if before else RetentionChange.Action.CREATED,
               user=user, before=before, after=values, now=now)
        return policy


def delete_policy(policy: RetentionPolicy, *, user) -> None:
    """Delete `policy`; audited. The default policy (`*`, every tenant) cannot be deleted."""
    access.require_perm(user, "ledger.delete_retentionpolicy", doing="delete retention policies")
    if policy.is_default:
        raise InvalidInput(
            "expected a policy other than the default ('*', every tenant) to delete, found the "
            "default; change its days instead"
        )
    now = timezone.now()
    with transaction.atomic(durable=True):
        locked = RetentionPolicy.objects.select_for_update().filter(pk=policy.pk).first()
        if locked is None:
            return
        _audit(locked, RetentionChange.Action.DELETED, user=user,
               before=locked.as_audit_dict(), after=None, now=now)
        locked.delete()


def _audit(policy, action, *, user, before, after, now) -> RetentionChange:
    return RetentionChange.objects.create(
        policy_id=policy.pk, action=action, changed_by=user,
        changed_by_name=user.get_username(), before=before, after=after, changed_at=now,
    )


def check_policy_values(pattern, tenant, purge_after_days, redact_after_days, keep_events_days):
    check_operation_pattern(pattern)
    check_tenant_or_every(tenant)
    _check_days("purge_after_days", purge_after_days)
    if keep_events_days is None:
        keep_events_days = purge_after_days
    _check_days("keep_events_days", keep_events_days)
    if redact_after_days is not None:
        _check_days("redact_after_days", redact_after_days)
        if redact_after_days > purge_after_days:
            raise InvalidInput(
                f"expected redact_after_days at most purge_after_days ({purge_after_days}), "
                f"found {redact_after_days}: the operation would be purged before redaction"
            )
    return {"pattern": pattern, "tenant": tenant, "purge_after_days": purge_after_days,
            "redact_after_days": redact_after_days, "keep_events_days": keep_events_days}


def _check_days(name: str, value: Any) -> None:
    check_whole_number(value, low=1, high=MAX_DAYS,
                       expected=f"{name} to be a whole number of days from 1 to {MAX_DAYS}")


# --- eligibility (SQL over `o`, an alias of ledger_operation) ----------------------------


@dataclass(frozen=True)
class Blocker:
    """Something that keeps an operation from being purged or redacted.

    `holds_sql` is a SQL predicate over `o` (ledger_operation), TRUE when `o` must be kept.
    """

    name: str
    holds_sql: str


# Rules beyond terminal-and-old, checked inside each purge and redaction statement: while
# its run still has an open obligation or an open fact conflict, an operation is part of
# unfinished business and is kept.
PURGE_BLOCKERS: list[Blocker] = [
    Blocker(
        "open obligation",
        "EXISTS (SELECT 1 FROM ledger_obligation ob "
        "WHERE ob.run_id = o.run_id AND ob.state = 'open')",
    ),
    Blocker(
        "open fact conflict",
        "EXISTS (SELECT 1 FROM ledger_factconflict fc "
        "JOIN ledger_fact cur ON cur.id = fc.current_id "
        "JOIN ledger_fact cand ON cand.id = fc.candidate_id "
        "WHERE fc.state = 'open' AND o.run_id IN (cur.run_id, cand.run_id))",
    ),
    # A flagged operation waits on a person (receipts.acknowledge), and a retried success
    # on its re-read (reconcile.reread_due): both need the receipt and its intent.
    Blocker("unsettled conflict flag", "o.conflict <> ''"),
    Blocker("re-read pending",
            "o.reread_due_at IS NOT NULL AND o.state = 'succeeded'"),
]


def blockers() -> list[Blocker]:
    """The rules, beyond terminal-and-old, that keep an operation; see PURGE_BLOCKERS."""
    return list(PURGE_BLOCKERS)


def _like(pattern: str) -> str:
    escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped.replace("*", "%").replace("?", "_")


def _match_sql(policy: RetentionPolicy) -> tuple[str, list]:
    if policy.tenant:
        return "(o.operation LIKE %s ESCAPE '\\' AND o.tenant = %s)", [
            _like(policy.pattern), policy.tenant]
    return "(o.operation LIKE %s ESCAPE '\\')", [_like(policy.pattern)]


def _governs_sql(policy: RetentionPolicy, ordered: list[RetentionPolicy]) -> tuple[str, list]:
    """`o` matches `policy` and no policy more specific than it."""
    sql, params = _match_sql(policy)
    for other in ordered[: ordered.index(policy)]:
        other_sql, other_params = _match_sql(other)
        sql += f" AND NOT {other_sql}"
        params += other_params
    return sql, params


def _kept_sql() -> str:
    return "".join(f" AND NOT ({b.holds_sql})" for b in blockers())


def _terminal_sql() -> str:
    return "o.state IN (" + ", ".join(f"'{s}'" for s in sorted(TERMINAL)) + ")"


def _purgeable_sql(policy, ordered, now: datetime) -> tuple[str, list]:
    governs, params = _governs_sql(policy, ordered)
    cutoff = now - timedelta(days=policy.purge_horizon_days)
    return (f"{_terminal_sql()} AND o.completed_at < %s AND {governs}{_kept_sql()}",
            [cutoff, *params])


def _redactable_sql(policy, ordered, now: datetime) -> tuple[str, list] | None:
    if policy.redact_after_days is None:
        return None
    governs, params = _governs_sql(policy, ordered)
    cutoff = now - timedelta(days=policy.redact_after_days)
    return (f"{_terminal_sql()} AND o.completed_at < %s AND o.redacted_at IS NULL "
            f"AND {governs}{_kept_sql()}", [cutoff, *params])


# --- what a purge would do ---------------------------------------------------------------


@dataclass
class PolicyPreview:
    policy: RetentionPolicy
    operations: int = 0
    events: int = 0
    evidence: int = 0
    redactions: int = 0
    first_operation_id: str = ""
    last_operation_id: str = ""


def _preview_one(policy, ordered, now) -> PolicyPreview:
    return preview_policies([policy], ordered=ordered, now=now)[0]


def preview_policies(policies: list[RetentionPolicy], *, ordered: list[RetentionPolicy],
                     now: datetime) -> list[PolicyPreview]:
    """Per policy of `policies`: what the next purge would delete and redact at `now`, with
    the same rule the purge applies (`ordered`: every policy, most specific first, as
    `policies_by_specificity` returns them). One statement whatever the number of policies;
    the desk's preview (`ledger.selectors.retention.preview`) and a dry run both count here.
    """
    if not policies:
        return []
    parts, params = [], []
    for index, policy in enumerate(policies):
        sql, part_params = _preview_sql(index, policy, ordered, now)
        parts.append(sql)
        params += part_params
    results = [PolicyPreview(policy=policy) for policy in policies]
    with connection.cursor() as cursor:
        cursor.execute(" UNION ALL ".join(parts), params)
        for index, *counts in cursor.fetchall():
            result = results[index]
            (result.operations, result.events, result.evidence, result.redactions,
             result.first_operation_id, result.last_operation_id) = counts
    return results


def _preview_sql(index: int, policy, ordered, now) -> tuple[str, list]:
    """One row for `policy`: its index, then what it would purge and, after that, redact."""
    where, params = _purgeable_sql(policy, ordered, now)
    redactable = _redactable_sql(policy, ordered, now)
    if redactable:
        # What the purge leaves behind; it deletes before it redacts.
        redactions = (f"(SELECT count(*) FROM ledger_operation o WHERE ({redactable[0]}) "
                      f"AND NOT ({where}))")
        redaction_params = redactable[1] + params
    else:
        redactions, redaction_params = "0::bigint", []
    sql = f"""
        (WITH doomed AS (SELECT o.id, o.operation_id FROM ledger_operation o WHERE {where})
        SELECT %s,
               (SELECT count(*) FROM doomed),
               (SELECT count(*) FROM ledger_operationevent e
                 WHERE e.operation_id IN (SELECT id FROM doomed)),
               (SELECT count(*) FROM ledger_evidence ev
                 WHERE ev.operation_id IN (SELECT id FROM doomed)),
               {redactions},
               (SELECT coalesce(min(operation_id), '') FROM doomed),
               (SELECT coalesce(max(operation_id), '') FROM doomed))
        """
    return sql, [*params, index, *redaction_params]


# --- the purge ---------------------------------------------------------------------------


@dataclass
class PurgeResult:
    runs: list[PurgeRun] = field(default_factory=list)
    purged_operation_ids: list[str] = field(default_factory=list)
    redacted_operation_ids: list[str] = field(default_factory=list)
    # The execution state's policies' runs (ledger.retention_state), and the ids of the
    # facts, episodes and obligations they purged.
    state_runs: list[PurgeRun] = field(default_factory=list)
    purged_state_ids: list[int] = field(default_factory=list)
    # How long each batch's transaction took (pick, purge or redact, commit), in order: what
    # holds the batch's rows locked; the sealing between batches is not part of it.
    batch_seconds: list[float] = field(default_factory=list)
    # The size each of those batches was given (at most `batch`; see BATCH_TARGET).
    batch_sizes: list[int] = field(default_factory=list)


class BatchSizer:
    """The size of the next batch: `most` while batches take under `target`; halved (not
    below MIN_BATCH) after one that took longer, grown by a quarter (not above `most`) after
    one that took under half of it. pt-online-schema-change's --chunk-time adapts its chunks
    to the time they take in the same spirit."""

    def __init__(self, most: int, target: timedelta):
        self.most, self.target = most, target.total_seconds()
        self.size = most

    def took(self, seconds: float) -> None:
        if seconds > self.target:
            self.size = max(min(MIN_BATCH, self.most), self.size // 2)
        elif seconds < self.target / 2:
            self.size = min(self.most, self.size + max(1, self.size // 4))


def purge(
    *,
    actor: str,
    batch: int = DEFAULT_BATCH,
    dry_run: bool = False,
    now: datetime | None = None,
    progress: Progress | None = None,
    pause: timedelta = timedelta(0),
    batch_target: timedelta = BATCH_TARGET,
) -> PurgeResult:
    """Purge, then redact, what every policy allows; one `PurgeRun` per policy. Then the
    execution state's policies (`ledger.retention_state`), one `PurgeRun` each.

    Works in batches of at most `batch` operations, each its own short transaction
    (`atomic(durable=True)` per batch rather than one around the whole purge, so locks are
    short and an interruption loses at most the batch in flight); each batch is locked by the
    rule, rows locked by others are skipped for the next run, and the database functions
    check terminal-and-old again. Safe to
    interrupt and rerun. `dry_run` writes only the PurgeRun, with the counts a real purge
    would reach now. Never deletes a non-terminal operation. `pause` is slept after each
    batch (outside any transaction), leaving the database's CPU and WAL to the agents writing
    meanwhile: bench/ P5 measures what it buys them. `batch` is the most a batch takes: one
    whose transaction took longer than `batch_target` halves the next (`BatchSizer`).
    """
    check_identifier(actor, "actor", 200)
    check_whole_number(batch, low=1, high=10_000, expected="batch to be from 1 to 10000 operations")
    check_aware(now, "now")
    check_duration(pause, "pause", high=MAX_PAUSE)
    check_positive_duration(batch_target, "batch_target")
    check_duration(batch_target, "batch_target", high=MAX_PAUSE)
    now = now or timezone.now()
    say = progress or (lambda message: None)
    ordered = policies_by_specificity()
    result = PurgeResult()
    between = _pauser(pause)
    sizer = BatchSizer(batch, batch_target)
    # What is committed gets its links first (the sealer's own work, a dry run included so
    # that it counts what a purge would reach): only sealed events can be purged and anchored.
    chain.seal()
    for policy in ordered:
        run = _start_run(policy, actor=actor, batch=batch, dry_run=dry_run)
        result.runs.append(run)
        if dry_run:
            _record_dry_run(run, _preview_one(policy, ordered, now))
        else:
            _purge_policy(run, policy, ordered, now, sizer, say, result, between)
            _redact_policy(run, policy, ordered, now, sizer, say, result, between)
        run.finished_at = timezone.now()
        run.save(update_fields=["finished_at"])
        say(f"{policy}: {'would purge' if dry_run else 'purged'} {run.operations_purged} "
            f"operations ({run.events_purged} events, {run.evidence_purged} evidence), "
            f"{'would redact' if dry_run else 'redacted'} {run.operations_redacted}")
    retention_state.purge(actor=actor, batch=batch, dry_run=dry_run, now=now, say=say,
                          result=result, sizer=sizer, between=between)
    return result


def _start_run(policy, *, actor, batch, dry_run) -> PurgeRun:
    return PurgeRun.objects.create(
        policy=policy, policy_snapshot=policy.as_audit_dict(), dry_run=dry_run,
        actor=actor[:200], batch_size=batch, started_at=timezone.now(),
    )


def _record_dry_run(run: PurgeRun, seen: PolicyPreview) -> None:
    run.operations_purged, run.events_purged = seen.operations, seen.events
    run.evidence_purged, run.operations_redacted = seen.evidence, seen.redactions
    run.first_operation_id, run.last_operation_id = (seen.first_operation_id,
                                                     seen.last_operation_id)
    run.save(update_fields=["operations_purged", "events_purged", "evidence_purged",
                            "operations_redacted", "first_operation_id", "last_operation_id"])


def _pauser(pause: timedelta) -> Callable[[], None]:
    seconds = pause.total_seconds()
    return (lambda: time.sleep(seconds)) if seconds else (lambda: None)


def _purge_policy(run, policy, ordered, now, sizer, say, result, between) -> None:
    # What agents committed since the last batch gets its links too (a tenant another
    # sealer is working on is skipped): the batch's check for unsealed events reads them
    # all, and without a sealer running beside a long purge they would pile up (bench P5 at
    # 1M: 178k, read by every pick).
    _in_batches(lambda after, size: _purge_batch(run, policy, ordered, now, size, after),
                before_each=chain.seal, done=result.purged_operation_ids, sizer=sizer,
                result=result, between=between,
                report=lambda: say(f"{policy}: purged {run.operations_purged} operations so far"))


def _in_batches(next_batch, *, before_each, done, sizer, result, report, between) -> None:
    """Run `next_batch(after, size)` until it returns no ids, `sizer` choosing each size:
    each batch's ids go to `done`, its transaction's duration (seconds) and size to
    `result`'s batch_seconds and batch_sizes; `report` and `between` follow each."""
    after = None
    while True:
        before_each()
        size = sizer.size
        started = time.perf_counter()
        ids, after = next_batch(after, size)
        if not ids:
            return
        seconds = time.perf_counter() - started
        sizer.took(seconds)
        result.batch_seconds.append(seconds)
        result.batch_sizes.append(size)
        done.extend(ids)
        report()
        between()


def _purge_batch(run, policy, ordered, now, batch, after):
    # The only way to delete events and evidence (migration 0015): the function checks
    # again that each is terminal and past the policy's horizon, anchors the chain and
    # counts what it removed on the run, as the tables' owner.
    where, params = _purgeable_sql(policy, ordered, now)
    return _sanctioned_batch(run, (where + _SEALED_SQL, params), batch, "ledger_retention_purge",
                             after, wait_for_flush=False)


# The purge anchors the chain where it deletes links (ledger.chain): an event the sealer has
# not linked yet has none. `purge` seals first; this skips what committed meanwhile (the
# next run takes it), and the purge function refuses it too (migration 0025). Written as
# NOT IN, the unsealed events are read once per batch into a hashed set (from
# event_unsealed_idx); a NOT EXISTS let the planner compare every candidate with every
# unsealed event, and a batch took 100-500 ms once agents had written 20k events during
# the purge (bench P5).
_SEALED_SQL = (" AND o.id NOT IN (SELECT e.operation_id FROM ledger_operationevent e"
               " WHERE e.chain_seq IS NULL)")


def _sanctioned_batch(run, rule, batch, function: str, after, *, wait_for_flush=True):
    """Pick and lock one batch by `rule` (where, params), hand it to the SECURITY DEFINER
    `function` (purge or redact), and return the operation ids it did and where the next
    batch starts. Rows locked by others wait for the next run; locked, a settled receipt
    cannot change before it goes.

    Batches go in (completed_at, id) order, each starting after the last one picked
    (`after`): the rows the earlier batches removed or changed stay in the index as dead
    entries until vacuum, and a picker starting from the oldest again walked past all of
    them (at 1M operations the pick grew to 300-550 ms a batch, bench P5). What it passes
    over (locked, held, not yet sealed) waits for the next run, as locked rows always did.

    `wait_for_flush=False` commits the batch without waiting for its WAL to reach the disk
    (`synchronous_commit = off` for this transaction alone). A purge batch can: after a
    crash of the server, a batch whose WAL was not yet written is simply not done, wholly
    (rows, anchor and the run's counts are one transaction), and the next run removes the
    rows again. PostgreSQL writes WAL in order, so the first synchronous commit after the
    batch (the sealing before the next batch when there is anything to seal, the run's
    `finished_at` at the latest) makes it durable: `purge` returns only after that. What
    it buys: a batch's COMMIT no longer waits out the disk's fsync stalls, which held its
    rows locked for 75-250 ms in some runs of bench P5 (docs/SCALING.md).
    """
    where, params = rule
    if after is not None:
        where += " AND o.completed_at >= %s AND (o.completed_at, o.id) > (%s, %s)"
        params = [*params, after[0], after[0], after[1]]
    with transaction.atomic(durable=True), connection.cursor() as cursor:
        if not wait_for_flush:
            cursor.execute("SET LOCAL synchronous_commit = off")
        cursor.execute(
            f"SELECT o.id, o.completed_at FROM ledger_operation o WHERE {where} "
            "ORDER BY o.completed_at, o.id LIMIT %s FOR UPDATE SKIP LOCKED",
            [*params, batch],
        )
        picked = cursor.fetchall()
        if not picked:
            return [], after
        cursor.execute(f"SELECT {function}(%s, %s)", [run.pk, [pk for pk, _ in picked]])
        ids = sorted(operation_id for (operation_id,) in cursor.fetchall())
    run.refresh_from_db()
    last_pk, last_completed = picked[-1]
    return ids, (last_completed, last_pk)


def _redact_policy(run, policy, ordered, now, sizer, say, result, between) -> None:
    if _redactable_sql(policy, ordered, now) is None:
        return
    _in_batches(lambda after, size: _redact_batch(run, policy, ordered, now, size, after),
                before_each=lambda: None, done=result.redacted_operation_ids, sizer=sizer,
                result=result, between=between,
                report=lambda: say(f"{policy}: redacted {run.operations_redacted} operations "
                                   "so far"))


def _redact_batch(run, policy, ordered, now, batch, after):
    # The only way to change a settled receipt's intent (migration 0015): the function
    # checks each again, writes REDACTED_PAYLOAD, one Redaction row each, and the counts.
    return _sanctioned_batch(run, _redactable_sql(policy, ordered, now), batch,
                             "ledger_retention_redact", after)
