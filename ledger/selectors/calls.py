"""Reads of an agent's earlier calls, which the MCP gateway decides its default idempotency
key with (docs/agents/gateway.md, "The default key"): the last call with the same intent,
and whether another call came between it and now.

The gateway records who called and what each call touches in the intent (`intent.mcp`:
`gateway`, its name; `caller`, the agent key's; `resources`, keyed digests of the
resources the call names), and these reads find calls by them. Both are reads of the
caller's own tenant, which `api.service` checks the agent key sees before it asks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Q

from ledger.models import ApprovalRequest, Operation
from ledger.prepared import prepared_cursor


@dataclass(frozen=True)
class EarlierCall:
    """An earlier call, as much of its operation as a default key is decided with."""

    id: int
    state: str
    state_changed_at: datetime
    idempotency_key: str
    operation_id: str
    operation: str


_COLUMNS = ("id", "state", "state_changed_at", "idempotency_key", "operation_id", "operation")

# Every earlier call with the fingerprint, through its index (an ORDER BY id LIMIT 1 would
# let the planner walk the primary key back through all history); on every call under a
# default key, so prepared: PostgreSQL plans it once per connection.
_EARLIER = (f"SELECT {', '.join(_COLUMNS)} FROM {Operation._meta.db_table} "
            "WHERE tenant = %s AND operation = %s AND intent_fingerprint = %s")


def earlier_call(tenant: str, operation: str, intent_fingerprint: str) -> EarlierCall | None:
    """The latest operation of `tenant` and `operation` with this intent fingerprint (the
    last earlier call with the same intent), or None. One prepared statement."""
    with prepared_cursor() as cursor:
        cursor.execute(_EARLIER, [tenant, operation, intent_fingerprint])
        rows = cursor.fetchall()
    return EarlierCall(*max(rows)) if rows else None


def call_between(tenant: str, after: EarlierCall, *, gateway: str, caller: str,
                 resources: Iterable[str] = ()) -> EarlierCall | None:
    """The first call through `gateway` in `tenant` recorded after `after` that is either a
    call of the same operation by `caller` or a call (of any tool, by anyone) naming one of
    `resources`: what makes a same-intent call after it not a retry. None when there is
    none. One query."""
    same = Q(operation=after.operation, intent__mcp__caller=caller)
    for resource in resources:
        same |= Q(intent__mcp__resources__contains=[resource])
    row = (Operation.objects.filter(tenant=tenant, id__gt=after.id, intent__mcp__gateway=gateway)
           .filter(same).order_by("id").values_list(*_COLUMNS).first())
    return EarlierCall(*row) if row is not None else None


def approval_pending(op: Operation) -> bool:
    """Whether the agent's request of `op`'s approval is on the desk, not yet decided."""
    return ApprovalRequest.objects.filter(operation_id=op.pk,
                                          status=ApprovalRequest.Status.PENDING).exists()
