"""The one writer of OperationEvent rows.

Every change of an operation, its event and the event's link in the tenant's hash chain
(`ledger.chain`) are written by one SQL statement here: the change (an INSERT or a
compare-and-set UPDATE of `ledger_operation`) is a CTE whose returned row feeds the chain
head's upsert and the event INSERT. They cannot come apart, and a change that matches no
row writes no event and leaves the chain alone. The chain head stays locked until the
transaction ends, so the writers of one tenant take turns. Evidence and reasons are
agent- or person-written: secrets are masked before they are stored.

These statements run on every receipt, so they are bound on the server and prepared
(`ledger.prepared`): PostgreSQL plans each shape once per connection.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import SimpleNamespace
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.models import Field

from ledger import chain
from ledger.canonical import check_json, redact, scrub_text
from ledger.models import Operation, OperationEvent
from ledger.prepared import prepared_cursor

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


_FIELDS = _OPERATION.concrete_fields
_ATTNAMES = [f.attname for f in _FIELDS]
_CONVERTED = [(i, f) for i, f in enumerate(_FIELDS) if hasattr(f, "from_db_value")]


def operation_columns(alias: str = "") -> str:
    """Every column of ledger_operation (qualified by `alias` if given), in the order
    `operation_from_row` reads them."""
    prefix = f"{alias}." if alias else ""
    return ", ".join(prefix + connection.ops.quote_name(f.column) for f in _FIELDS)


OPERATION_COLUMNS = operation_columns()


def operation_from_row(row: Sequence[Any]) -> Operation:
    """An Operation from a row that starts with `operation_columns()`, converted as the ORM
    would (the JSON intent decoded), for hot reads that skip the ORM's query compilation."""
    values = list(row[:len(_FIELDS)])
    for i, field in _CONVERTED:
        values[i] = field.from_db_value(values[i], None, connection)
    return Operation.from_db(connection.alias, _ATTNAMES, values)


@functools.cache
def _fields(meta, names: tuple[str, ...]) -> tuple[list[str], list[Field]]:
    fields = [meta.get_field(name) for name in names]
    return [connection.ops.quote_name(field.column) for field in fields], fields


def _prep(meta, values: Mapping[str, Any]) -> tuple[list[str], list[Any]]:
    # On every write: the columns of a set of names are looked up once, and the connection
    # proxy is resolved once per call rather than once per value.
    columns, fields = _fields(meta, tuple(values))
    db = connections[DEFAULT_DB_ALIAS]
    return list(columns), [f.get_db_prep_save(v, db) for f, v in zip(fields, values.values(),
                                                                      strict=True)]


def _with_event(
    change_sql: str, change_params: Sequence[Any], operation_id: str, tenant: str,
    event: Mapping[str, Any], *, also: str = "",
):
    columns, params = _prep(_EVENT, event)
    payload = chain.operation_event_payload(
        SimpleNamespace(tenant=tenant, operation_ref=operation_id, **event)
    )
    link_sql, link_params = chain.link_cte(chain.OPERATION_EVENTS.name, "changed", payload)
    sql = (
        "WITH changed AS "
        f"({change_sql} RETURNING id, tenant, operation, intent_fingerprint, conflict), "
        f"{also}linked AS ({link_sql}), "
        f"event AS (INSERT INTO {_EVENT.db_table} (operation_id, tenant, chain_seq, "
        f"chain_hash, {', '.join(columns)}) "
        "SELECT changed.id, changed.tenant, linked.seq, linked.hash, "
        f"{', '.join(['%s'] * len(params))} FROM changed, linked RETURNING operation_id) "
        "SELECT changed.id, changed.conflict FROM changed JOIN event ON event.operation_id = "
        "changed.id"
    )
    with prepared_cursor() as cursor:
        cursor.execute(sql, [*change_params, *link_params, *params])
        return cursor.fetchone()


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
    row = _with_event(change, params, values["operation_id"], values["tenant"], event)
    return row[0] if row else None


# Other succeeded operations of the same (tenant, operation, fingerprint) as `row`.
_TWINS = (
    "SELECT 1 FROM ledger_operation twin WHERE twin.tenant = {row}.tenant "
    "AND twin.operation = {row}.operation AND twin.intent_fingerprint = {row}.intent_fingerprint "
    "AND twin.state = 'succeeded' AND twin.id <> {row}.id"
)


def update_operation_with_event(
    op: Operation, *, state: str, version: int, changes: Mapping[str, Any],
    event: Mapping[str, Any], mark_duplicates: bool = False,
) -> str | None:
    """Compare-and-set: apply `changes` only if the row is still at (state, version).

    Returns the row's `conflict` after the change, or None when no row matched (nothing
    was written).

    `mark_duplicates` (a move to succeeded): if another operation with the same tenant,
    operation and fingerprint has succeeded too, both get `conflict = 'duplicate'`, in the
    same statement.
    """
    changes = dict(changes)
    conflict = changes.pop("conflict", None) if mark_duplicates else None
    columns, params = _prep(_OPERATION, changes)
    sets = [f"{c} = %s" for c in columns]
    also = ""
    if mark_duplicates:
        otherwise = "conflict" if conflict is None else "%s"
        sets.append(
            f"conflict = CASE WHEN EXISTS ({_TWINS.format(row=_OPERATION.db_table)}) "
            f"THEN 'duplicate' ELSE {otherwise} END"
        )
        if conflict is not None:
            params.append(conflict)
        also = (
            f"twins AS (UPDATE {_OPERATION.db_table} twin SET conflict = 'duplicate' "
            "FROM changed WHERE twin.tenant = changed.tenant "
            "AND twin.operation = changed.operation "
            "AND twin.intent_fingerprint = changed.intent_fingerprint "
            "AND twin.state = 'succeeded' AND twin.id <> changed.id "
            "AND twin.conflict <> 'duplicate' RETURNING twin.id), "
        )
    change = (
        f"UPDATE {_OPERATION.db_table} SET {', '.join(sets)} "
        "WHERE id = %s AND state = %s AND version = %s"
    )
    row = _with_event(
        change, [*params, op.pk, state, version], op.operation_id, op.tenant, event, also=also
    )
    return row[1] if row else None
