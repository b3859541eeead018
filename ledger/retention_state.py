"""Retention of execution state: superseded fact versions, episodes, settled obligations,
and coverage readings (`ledger.coverage`).

Policies are per kind (`StateKind`) and tenant ('' for every tenant; the policy naming a
tenant governs its rows, the one for every tenant the rest). Admins set them like the
operations' policies (`set_state_policy`, `delete_state_policy`, audited in
`RetentionChange`); `manage.py purge` applies them after the operations' policies, one
`PurgeRun` per policy with `rows_purged`.

A row may go once its policy's days have passed since it was superseded (a fact version:
its successor's `created_at`), recorded (an episode), settled (an obligation's
`committed_at` or `cancelled_at`) or taken (a coverage reading's `created_at`), and never
while its run is unfinished: an open obligation, a step not committed, an operation not
terminal, or a live lease on the run (`ledger_run_unfinished`, migration 0038). A current
fact, a candidate and an open obligation are never purged, nor the latest coverage reading
of a tenant, operation name, target and account, however old: it is what `/metrics`
reports (`ledger_unexplained_effects`) and what the desk's coverage page shows first, as a
current fact is what an agent reads. PostgreSQL holds all of that twice: the SECURITY
DEFINER function `ledger_retention_purge_state` checks each row again by the database's
clock, and the tables' triggers refuse any other DELETE, whoever asks.

What the purge (`Kind.kept`) keeps beyond that, so that nothing still referred to goes: a fact
version a conflict or a person's decision names, one a candidate contradicted, one an
operation that is still kept relied on (`record_intent(relies_on=)`: the desk shows it),
and every later version of a key whose older version is kept (versions go oldest first).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.utils import timezone

from ledger import access
from ledger.errors import InvalidInput
from ledger.inputs import check_choice, check_tenant_or_every, check_whole_number
from ledger.models import PurgeRun, RetentionChange, StateKind, StateRetentionPolicy
from ledger.models.coverage import LATER_READING

MAX_DAYS = 36500


# --- policy writes -----------------------------------------------------------------------


def set_state_policy(kind: str, *, tenant: str = "", purge_after_days: int,
                     user) -> StateRetentionPolicy:
    """Create or change the policy for (`kind`, `tenant`); audited with who, before, after.

    Needs `ledger.change_retentionpolicy` (the operations' policies' permission). Raises
    InvalidInput (writing nothing) for an unknown kind, a malformed tenant or day count. A
    call that changes nothing writes nothing.
    """
    access.require_perm(user, "ledger.change_retentionpolicy", doing="change retention")
    values = check_state_policy_values(kind, tenant, purge_after_days)
    now = timezone.now()
    with transaction.atomic(durable=True):
        policy = (StateRetentionPolicy.objects.select_for_update()
                  .filter(kind=values["kind"], tenant=values["tenant"]).first())
        before = policy.as_audit_dict() if policy else None
        if before == values:
            return policy
        if policy is None:
            policy = StateRetentionPolicy(created_by=user, created_at=now, **values)
        policy.purge_after_days = values["purge_after_days"]
        policy.updated_by, policy.updated_at = user, now
        policy.save()
        _audit(policy, RetentionChange.Action.UPDATED if before else RetentionChange.Action.CREATED,
               user=user, before=before, after=values, now=now)
        return policy


def delete_state_policy(policy: StateRetentionPolicy, *, user) -> None:
    """Delete a tenant's policy (its rows fall back to the one for every tenant); audited.
    The policies for every tenant cannot be deleted."""
    access.require_perm(user, "ledger.delete_retentionpolicy", doing="delete retention policies")
    if policy.is_default:
        raise InvalidInput(
            f"expected a tenant's policy to delete, found the {policy.kind} policy for every "
            "tenant; change its days instead")
    now = timezone.now()
    with transaction.atomic(durable=True):
        locked = StateRetentionPolicy.objects.select_for_update().filter(pk=policy.pk).first()
        if locked is None:
            return
        _audit(locked, RetentionChange.Action.DELETED, user=user,
               before=locked.as_audit_dict(), after=None, now=now)
        locked.delete()


def _audit(policy, action, *, user, before, after, now) -> RetentionChange:
    return RetentionChange.objects.create(
        state_policy_id=policy.pk, action=action, changed_by=user,
        changed_by_name=user.get_username(), before=before, after=after, changed_at=now,
    )


def check_state_policy_values(kind, tenant, purge_after_days) -> dict:
    check_choice(kind, "kind", StateKind.values)
    check_tenant_or_every(tenant)
    check_whole_number(purge_after_days, low=1, high=MAX_DAYS,
                       expected=f"purge_after_days to be a whole number of days from 1 to "
                                f"{MAX_DAYS}")
    return {"kind": kind, "tenant": tenant, "purge_after_days": purge_after_days}


def policies() -> list[StateRetentionPolicy]:
    """Every state policy: by kind, the one for every tenant first."""
    return list(StateRetentionPolicy.objects.order_by("kind", "tenant", "id"))


# --- which rows a policy may purge (SQL) -------------------------------------------------

# A fact version something still names: a conflict or a person's decision (the audit trail
# of facts, never purged), a candidate that contradicted it, or an operation still kept
# that relied on it (operation_relies_on_idx, migration 0038, holds only the operations
# that rely on a fact). Over `{x}`, an alias of ledger_fact.
_FACT_NAMED = (
    "EXISTS (SELECT 1 FROM ledger_factconflict c WHERE {x}.id IN "
    "(c.current_id, c.candidate_id, c.chosen_id, c.resolved_fact_id)) "
    "OR EXISTS (SELECT 1 FROM ledger_factdecision d WHERE {x}.id IN (d.chosen_id, d.written_id)) "
    "OR EXISTS (SELECT 1 FROM ledger_fact k WHERE k.contradicts_id = {x}.id) "
    "OR EXISTS (SELECT 1 FROM ledger_operation o WHERE o.relies_on <> '[]'::jsonb "
    "AND o.relies_on @> jsonb_build_array({x}.id))"
)


@dataclass(frozen=True)
class Kind:
    """How the purge reads one kind: its table under alias `x`, the time its days count from
    (`since`), what a row must be (`settled`, cheap: the pick's filter), and what keeps a
    settled row all the same (`kept`, checked on the picked rows only)."""

    table: str
    since: str
    joins: str
    settled: str
    kept: str


_RUN_UNFINISHED = "ledger_run_unfinished(x.run_id)"

KINDS: dict[str, Kind] = {
    StateKind.FACTS: Kind(
        "ledger_fact", "s.created_at", "JOIN ledger_fact s ON s.id = x.superseded_by_id",
        "x.status = 'superseded'",
        # ... or an older version of its key kept: versions go oldest first (a version's
        # successor links to it until it goes)
        f"{_RUN_UNFINISHED} OR {_FACT_NAMED.format(x='x')} "
        "OR EXISTS (SELECT 1 FROM ledger_fact p WHERE p.tenant = x.tenant "
        "AND p.subject = x.subject AND p.predicate = x.predicate AND p.version < x.version "
        f"AND (ledger_run_unfinished(p.run_id) OR {_FACT_NAMED.format(x='p')}))"),
    StateKind.EPISODES: Kind("ledger_episode", "x.created_at", "", "TRUE", _RUN_UNFINISHED),
    StateKind.OBLIGATIONS: Kind(
        "ledger_obligation", "coalesce(x.committed_at, x.cancelled_at)", "",
        "x.state <> 'open'", _RUN_UNFINISHED),
    # Of no run; the latest reading of its key is kept (the purge function and the table's
    # trigger refuse it too).
    StateKind.COVERAGE: Kind("ledger_coveragereading", "x.created_at", "", "TRUE",
                             f"NOT {LATER_READING.format(x='x')}"),
}


def _settled(policy: StateRetentionPolicy, now: datetime) -> tuple[str, list]:
    """FROM ... WHERE over alias `x` of the policy's table: the rows it governs that are
    settled and old enough at `now` (what `Kind.kept` may still keep)."""
    kind = KINDS[policy.kind]
    if policy.tenant:
        governs, params = "x.tenant = %s", [policy.tenant]
    else:
        governs = ("NOT EXISTS (SELECT 1 FROM ledger_stateretentionpolicy t "
                   "WHERE t.kind = %s AND t.tenant = x.tenant)")
        params = [policy.kind]
    cutoff = now - timedelta(days=policy.purge_after_days)
    return (f"FROM {kind.table} x {kind.joins} WHERE {kind.since} < %s AND {governs} "
            f"AND {kind.settled}", [cutoff, *params])


def preview(now: datetime | None = None) -> list[tuple[StateRetentionPolicy, int]]:
    """Per state policy: how many rows the next purge would delete now (the purge's rule).
    One statement whatever the number of policies."""
    now = now or timezone.now()
    ordered = policies()
    if not ordered:
        return []
    parts, params = [], []
    for policy in ordered:
        sql, part_params = _settled(policy, now)
        parts.append(f"(SELECT count(*) {sql} AND NOT ({KINDS[policy.kind].kept}))")
        params += part_params
    with connection.cursor() as cursor:
        cursor.execute("SELECT " + ", ".join(parts), params)
        counts = cursor.fetchone()
    return list(zip(ordered, counts, strict=True))


# --- the purge ---------------------------------------------------------------------------


def purge(*, actor: str, batch: int, dry_run: bool, now: datetime, say, result, sizer,
          between) -> None:
    """Apply every state policy (called by `ledger.retention.purge`, which checked the
    arguments): one `PurgeRun` per policy in `result.state_runs`, batches as the
    operations'."""
    counts = dict((p.pk, n) for p, n in preview(now)) if dry_run else {}
    for policy in policies():
        run = PurgeRun.objects.create(
            state_policy=policy, policy_snapshot=policy.as_audit_dict(), dry_run=dry_run,
            actor=actor[:200], batch_size=batch, started_at=timezone.now())
        result.state_runs.append(run)
        if dry_run:
            run.rows_purged = counts.get(policy.pk, 0)
            run.save(update_fields=["rows_purged"])
        else:
            _purge_policy(run, policy, now, say=say, result=result, sizer=sizer,
                          between=between)
        run.finished_at = timezone.now()
        run.save(update_fields=["finished_at"])
        say(f"{policy}: {'would purge' if dry_run else 'purged'} {run.rows_purged} "
            f"{StateKind(policy.kind).label.lower()}")


def _purge_policy(run, policy, now, *, say, result, sizer, between) -> None:
    """Batches in id order (a fact's older versions before it) until none is left; each
    batch's duration and size go to `result` and set the next size (`sizer`), as the
    operations' batches do."""
    after = 0
    while True:
        size = sizer.size
        started = time.perf_counter()
        last, ids = _batch(run, policy, now, size, after)
        if last is None:
            return
        seconds = time.perf_counter() - started
        sizer.took(seconds)
        result.batch_seconds.append(seconds)
        result.batch_sizes.append(size)
        result.purged_state_ids.extend(ids)
        after = last
        say(f"{policy}: purged {run.rows_purged} so far")
        between()


def _batch(run: PurgeRun, policy: StateRetentionPolicy, now, size: int, after: int):
    """The next `size` settled rows after id `after`, those of them nothing keeps handed to
    `ledger_retention_purge_state`, which checks each again and deletes it. Returns the last
    id looked at (None when none was left) and the ids deleted.

    Not locked here (the purge's role holds no UPDATE on these tables, which FOR UPDATE
    needs, and a settled row never changes): a row another purge deleted meanwhile is not
    counted twice. Picked by id (the primary key's order) with the cheap conditions first
    and what keeps a row checked on the batch alone, so a batch reads about its size of
    rows however many are kept."""
    sql, params = _settled(policy, now)
    kind = KINDS[policy.kind]
    with transaction.atomic(durable=True), connection.cursor() as cursor:
        cursor.execute(
            f"WITH picked AS (SELECT x.id {sql} AND x.id > %s ORDER BY x.id LIMIT %s) "
            f"SELECT x.id, NOT ({kind.kept}) FROM picked JOIN {kind.table} x ON x.id = picked.id "
            "ORDER BY x.id", [*params, after, size])
        picked = cursor.fetchall()
        if not picked:
            return None, []
        free = [pk for pk, purgeable in picked if purgeable]
        ids = []
        if free:
            cursor.execute("SELECT ledger_retention_purge_state(%s, %s)", [run.pk, free])
            ids = [pk for (pk,) in cursor.fetchall()]
    run.refresh_from_db()
    return picked[-1][0], ids
