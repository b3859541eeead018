"""The one writer of OperationEvent rows.

Every change of an operation, its event and the event's link in the tenant's hash chain
(`ledger.chain`) are written by one SQL statement here: the change (an INSERT or a
compare-and-set UPDATE of `ledger_operation`) is a CTE whose returned row feeds the chain
head's upsert and the event INSERT. They cannot come apart, and a change that matches no
row writes no event and leaves the chain alone. The chain head stays locked until the
transaction ends, so the writers of one tenant take turns. Evidence and reasons are
agent- or person-written: secrets are masked before they are stored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from types import SimpleNamespace
from typing import Any

from django.db import connection

from ledger import chain
from ledger.canonical import check_json, redact, scrub_text
from ledger.models import Operation, OperationEvent

_OPERATION = Operation._meta
_EVENT = OperationEvent._meta


def event_values(
    *,
    from_state: str,
    to_state: str,
    version: int,
    actor_kind: str,
    actor_id: str = "",
    reason: str = "",
    evidence: Any = None,
    fencing_token: int | None = None,
    now: datetime,
) -> dict[str, Any]:
    """The event's fields (all but operation and tenant, which come from the changed row)."""
    if evidence is not None:
        check_json(evidence, what="evidence")
        evidence = chain.normalize(redact(evidence))
    return {
        "version": version,
        "from_state": from_state,
        "to_state": to_state,
        "actor_kind": actor_kind,
        "actor_id": (actor_id or "")[:200],
        "reason": scrub_text(reason or ""),
        "evidence": evidence,
        "fencing_token": fencing_token,
        "created_at": now,
    }


def _prep(meta, values: Mapping[str, Any]) -> tuple[list[str], list[Any]]:
    columns, params = [], []
    for name, value in values.items():
        field = meta.get_field(name)
        columns.append(connection.ops.quote_name(field.column))
        params.append(field.get_db_prep_save(value, connection))
    return columns, params


def _with_event(
    change_sql: str, change_params: Sequence[Any], operation_id: str, tenant: str,
    event: Mapping[str, Any],
):
    columns, params = _prep(_EVENT, event)
    payload = chain.operation_event_payload(
        SimpleNamespace(tenant=tenant, operation_ref=operation_id, **event)
    )
    link_sql, link_params = chain.link_cte(chain.OPERATION_EVENTS.name, "changed", payload)
    sql = (
        f"WITH changed AS ({change_sql} RETURNING id, tenant), linked AS ({link_sql}) "
        f"INSERT INTO {_EVENT.db_table} (operation_id, tenant, chain_seq, chain_hash, "
        f"{', '.join(columns)}) "
        "SELECT changed.id, changed.tenant, linked.seq, linked.hash, "
        f"{', '.join(['%s'] * len(params))} FROM changed, linked "
        "RETURNING operation_id"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [*change_params, *link_params, *params])
        row = cursor.fetchone()
    return row[0] if row else None


def insert_operation_with_event(values: Mapping[str, Any], event: Mapping[str, Any]):
    """INSERT the operation unless its (tenant, operation, idempotency_key) exists.

    Returns the new primary key, or None when the key was taken (nothing written).
    """
    columns, params = _prep(_OPERATION, values)
    change = (
        f"INSERT INTO {_OPERATION.db_table} ({', '.join(columns)}) "
        f"VALUES ({', '.join(['%s'] * len(params))}) "
        "ON CONFLICT (tenant, operation, idempotency_key) WHERE idempotency_key > '' DO NOTHING"
    )
    return _with_event(change, params, values["operation_id"], values["tenant"], event)


def update_operation_with_event(
    op: Operation, *, state: str, version: int, changes: Mapping[str, Any],
    event: Mapping[str, Any],
) -> bool:
    """Compare-and-set: apply `changes` only if the row is still at (state, version)."""
    columns, params = _prep(_OPERATION, changes)
    change = (
        f"UPDATE {_OPERATION.db_table} SET {', '.join(f'{c} = %s' for c in columns)} "
        "WHERE id = %s AND state = %s AND version = %s"
    )
    return _with_event(
        change, [*params, op.pk, state, version], op.operation_id, op.tenant, event
    ) is not None
