"""Operations read as plain rows on the hot paths, skipping the ORM's query compilation.

A reconciler's claim, the stale-submission sweep and the idempotency look-up of
`record_intent` run the same SELECT call after call; written out once and prepared
(`ledger.prepared`), each reads its rows with `OPERATION_COLUMNS` and turns them into
Operations with `operation_from_row`, converted as the ORM would. `ModelRows` does the same
for another model (an agent reading its receipt back: the events, the evidence, the
approval request).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import connection

from ledger.models import Operation

_FIELDS = Operation._meta.concrete_fields
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
    would (the JSON intent decoded)."""
    values = list(row[:len(_FIELDS)])
    for i, field in _CONVERTED:
        values[i] = field.from_db_value(values[i], None, connection)
    return Operation.from_db(connection.alias, _ATTNAMES, values)


class ModelRows:
    """A model's rows read by a statement written out once: `columns` (every concrete
    column, in the order `instance` reads them) and `instance(row)`, converted as the ORM
    would."""

    def __init__(self, model):
        self.model = model
        self.table = model._meta.db_table
        self.fields = model._meta.concrete_fields
        self.attnames = [f.attname for f in self.fields]
        self.converted = [(i, f) for i, f in enumerate(self.fields)
                          if hasattr(f, "from_db_value")]
        self.columns = ", ".join(connection.ops.quote_name(f.column) for f in self.fields)

    def column(self, field_name: str) -> str:
        return connection.ops.quote_name(self.model._meta.get_field(field_name).column)

    def instance(self, row: Sequence[Any]):
        values = list(row[:len(self.fields)])
        for i, field in self.converted:
            values[i] = field.from_db_value(values[i], None, connection)
        return self.model.from_db(connection.alias, self.attnames, values)
