"""Retention of execution state: superseded fact versions, episodes, settled obligations.

Policies are per kind (`StateKind`) and tenant ('' for every tenant; the policy naming a
tenant governs its rows, the one for every tenant the rest). Admins set them like the
operations' policies (`set_state_policy`, `delete_state_policy`, audited in
`RetentionChange`); `manage.py purge` applies them after the operations' policies, one
`PurgeRun` per policy with `rows_purged`.

A row may go once its policy's days have passed since it was superseded (a fact version:
its successor's `created_at`), recorded (an episode) or settled (an obligation's
`committed_at` or `cancelled_at`), and never while its run is unfinished: an open
obligation, a step not committed, an operation not terminal, or a live lease on the run
(`ledger_run_unfinished`, migration 0036). A current fact, a candidate and an open
obligation are never purged. PostgreSQL holds all of that twice: the SECURITY DEFINER
function `ledger_retention_purge_state` checks each row again by the database's clock, and
the tables' triggers refuse any other DELETE, whoever asks.

What the pick (`_rule`) keeps beyond that, so that nothing still referred to goes: a fact
version a conflict or a person's decision names, one a candidate contradicted, one an
operation that is still kept relied on (`record_intent(relies_on=)`: the desk shows it),
and every later version of a key whose older version is kept (versions go oldest first).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.utils import timezone

from ledger import access
from ledger.errors import InvalidInput
from ledger.inputs import check_choice, check_tenant_or_every, check_whole_number
from ledger.models import PurgeRun, RetentionChange, StateKind, StateRetentionPolicy

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

_RUN_FINISHED = "NOT ledger_run_unfinished({x}.run_id)"

# A fact version something still names: a conflict or a person's decision (the audit trail
# of facts, never purged), a candidate that contradicted it, or an operation still kept
# that relied on it. Over `{x}`, an alias of ledger_fact.
_FACT_NAMED = (
    "EXISTS (SELECT 1 FROM ledger_factconflict c WHERE {x}.id IN "
    "(c.current_id, c.candidate_id, c.chosen_id, c.resolved_fact_id)) "
    "OR EXISTS (SELECT 1 FROM ledger_factdecision d WHERE {x}.id IN (d.chosen_id, d.written_id)) "
    "OR EXISTS (SELECT 1 FROM ledger_fact k WHERE k.contradicts_id = {x}.id) "
    "OR {x}.id IN (SELECT (jsonb_array_elements_text(o.relies_on))::bigint "
    "FROM ledger_operation o WHERE o.relies_on <> '[]'::jsonb)"
)


@dataclass(frozen=True)
class Kind:
    """How the pick reads one kind: its table under alias `x`, the time its days count
    from (`since`), what must hold of a row beyond its age, run and policy."""

    table: str
    since: str
    joins: str
    settled: str


KINDS: dict[str, Kind] = {
    StateKind.FACTS: Kind(
        "ledger_fact", "s.created_at", "JOIN ledger_fact s ON s.id = x.superseded_by_id",
        # ... and no older version of its key kept (they go oldest first: a version's
        # successor links to it until it goes)
        "x.status = 'superseded' AND NOT (" + _FACT_NAMED.format(x="x") + ") "
        "AND NOT EXISTS (SELECT 1 FROM ledger_fact p WHERE p.tenant = x.tenant "
        "AND p.subject = x.subject AND p.predicate = x.predicate AND p.version < x.version "
        "AND (ledger_run_unfinished(p.run_id) OR " + _FACT_NAMED.format(x="p") + "))"),
    StateKind.EPISODES: Kind("ledger_episode", "x.created_at", "", "TRUE"),
    StateKind.OBLIGATIONS: Kind(
        "ledger_obligation", "coalesce(x.committed_at, x.cancelled_at)", "",
        "x.state <> 'open'"),
}


def _rule(policy: StateRetentionPolicy, now: datetime) -> tuple[str, list]:
    """FROM ... WHERE over alias `x` of the policy's table: what it may purge at `now`."""
    kind = KINDS[policy.kind]
    if policy.tenant:
        governs, params = "x.tenant = %s", [policy.tenant]
    else:
        governs = ("NOT EXISTS (SELECT 1 FROM ledger_stateretentionpolicy t "
                   "WHERE t.kind = %s AND t.tenant = x.tenant)")
        params = [policy.kind]
    cutoff = now - timedelta(days=policy.purge_after_days)
    sql = (f"FROM {kind.table} x {kind.joins} WHERE {kind.since} < %s AND {governs} "
           f"AND {kind.settled} AND {_RUN_FINISHED.format(x='x')}")
    return sql, [cutoff, *params]


def preview(now: datetime | None = None) -> list[tuple[StateRetentionPolicy, int]]:
    """Per state policy: how many rows the next purge would delete now (the purge's rule).
    One statement whatever the number of policies."""
    now = now or timezone.now()
    ordered = policies()
    if not ordered:
        return []
    parts, params = [], []
    for policy in ordered:
        sql, part_params = _rule(policy, now)
        parts.append(f"(SELECT count(*) {sql})")
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
            _in_batches()(
                lambda after, size, run=run, policy=policy: _batch(run, policy, now, size,
                                                                   after),
                before_each=lambda: None, done=result.purged_state_ids, sizer=sizer,
                result=result, between=between,
                report=lambda run=run, policy=policy: say(
                    f"{policy}: purged {run.rows_purged} so far"))
        run.finished_at = timezone.now()
        run.save(update_fields=["finished_at"])
        say(f"{policy}: {'would purge' if dry_run else 'purged'} {run.rows_purged} "
            f"{StateKind(policy.kind).label.lower()}")


def _in_batches():
    from ledger.retention import _in_batches  # ledger.retention imports this module

    return _in_batches


def _batch(run: PurgeRun, policy: StateRetentionPolicy, now, size: int, after):
    """Pick one batch by the rule, oldest first (a fact's older versions before it), and
    hand it to `ledger_retention_purge_state`, which checks each row again and deletes it.
    Not locked here (the purge's role holds no UPDATE on these tables, which FOR UPDATE
    needs, and a settled row never changes): a row another purge deleted meanwhile is
    simply not counted twice. Returns the ids it deleted and where the next batch starts."""
    sql, params = _rule(policy, now)
    since = KINDS[policy.kind].since
    if after is not None:
        sql += f" AND ({since}, x.id) > (%s, %s)"
        params = [*params, *after]
    with transaction.atomic(durable=True), connection.cursor() as cursor:
        cursor.execute(f"SELECT x.id, {since} {sql} ORDER BY {since}, x.id LIMIT %s",
                       [*params, size])
        picked = cursor.fetchall()
        if not picked:
            return [], after
        cursor.execute("SELECT ledger_retention_purge_state(%s, %s)",
                       [run.pk, [pk for pk, _ in picked]])
        ids = [pk for (pk,) in cursor.fetchall()]
    run.refresh_from_db()
    last_pk, last_since = picked[-1]
    return ids, (last_since, last_pk)
