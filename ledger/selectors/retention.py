"""Reads of retention: what the next purge would do per policy, how much the ledger holds,
and the page that shows both with the recent purges and policy changes (admins).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection
from django.utils import timezone

from ledger import access, retention, retention_state
from ledger.errors import NotFound
from ledger.models import PurgeRun, RetentionChange, RetentionPolicy, StateRetentionPolicy
from ledger.retention import PolicyPreview


@dataclass(frozen=True)
class TableSize:
    table: str
    rows: int
    total_bytes: int


LEDGER_TABLES = (
    "ledger_operation", "ledger_operationevent", "ledger_evidence", "ledger_redaction",
    "ledger_chainanchor", "ledger_purgerun", "ledger_retentionchange", "ledger_fact",
    "ledger_factconflict", "ledger_factdecision", "ledger_obligation", "ledger_episode",
    "ledger_run", "ledger_step",
)


def preview(*, now: datetime | None = None) -> list[PolicyPreview]:
    """Per policy (most specific first): what the next purge would delete and redact now.

    One statement whatever the number of policies; the same rule the purge applies.
    """
    now = now or timezone.now()
    ordered = retention.policies_by_specificity()
    return retention.preview_policies(ordered, ordered=ordered, now=now)


def table_sizes() -> list[TableSize]:
    """Rows (exact) and on-disk size with indexes and TOAST of the ledger's big tables.

    One statement.
    """
    sql = " UNION ALL ".join(
        f"SELECT '{table}', count(*), pg_total_relation_size('{table}') FROM {table}"
        for table in LEDGER_TABLES
    )
    with connection.cursor() as cursor:
        cursor.execute(sql)
        rows = sorted(cursor.fetchall(), key=lambda row: LEDGER_TABLES.index(row[0]))
    return [TableSize(table=table, rows=count, total_bytes=total) for table, count, total in rows]


def retention_overview(user, *, now: datetime | None = None) -> dict[str, Any]:
    """What the desk's retention page shows: per-policy preview (operations', then execution
    state's), the ledger's size, the recent purge runs of each and the policy changes. A fixed
    number of queries whatever the number of policies. Needs `ledger.view_retentionpolicy`
    (PermissionDenied otherwise).
    """
    access.require_perm(user, "ledger.view_retentionpolicy", doing="see retention")
    runs = PurgeRun.objects.order_by("-started_at", "-id")
    return {
        "previews": preview(now=now),
        "state_previews": retention_state.preview(now),
        "tables": table_sizes(),
        "last_runs": list(runs.filter(state_policy__isnull=True)
                          .exclude(policy_snapshot__has_key="kind")[:10]),
        "last_state_runs": list(runs.filter(policy_snapshot__has_key="kind")[:10]),
        "changes": list(RetentionChange.objects.order_by("-changed_at", "-id")[:20]),
    }


def access_policy(user, pk: int) -> RetentionPolicy:
    """The retention policy `pk`, for a user holding `ledger.view_retentionpolicy`
    (PermissionDenied otherwise); errors.NotFound when there is none (someone may have
    deleted it). Policies belong to no single tenant's data: the permission decides."""
    access.require_perm(user, "ledger.view_retentionpolicy", doing="see retention")
    policy = RetentionPolicy.objects.filter(pk=pk).first()
    if policy is None:
        raise NotFound(f"expected retention policy #{pk}, found none")
    return policy


def access_state_policy(user, pk: int) -> StateRetentionPolicy:
    """The execution-state retention policy `pk`, as `access_policy` for operations'."""
    access.require_perm(user, "ledger.view_retentionpolicy", doing="see retention")
    policy = StateRetentionPolicy.objects.filter(pk=pk).first()
    if policy is None:
        raise NotFound(f"expected state retention policy #{pk}, found none")
    return policy
