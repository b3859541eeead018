"""Events as they were written before PostgreSQL set the chain's columns (migration 0043)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection

from ledger.models import OperationEvent
from tests.support.retention import raw_connection


def chain_columns_trigger() -> str:
    """The installed name of the trigger `event_chain_columns` of operation events."""
    [trigger] = [t for t in OperationEvent._meta.triggers if t.name == "event_chain_columns"]
    return trigger.get_pgid(OperationEvent)


@contextmanager
def written_in_format(chain_format: int) -> Iterator[None]:
    """Events written inside are written as before migration 0043, in `chain_format` (1 or
    2): the owner switches the trigger `event_chain_columns` off for the block (so they
    carry no content and the column's default format 1), then sets their format."""
    if chain_format not in (1, 2):
        raise ValueError(f"expected an old chain format, 1 or 2, found {chain_format}")
    before = OperationEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0
    table, trigger = OperationEvent._meta.db_table, chain_columns_trigger()
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} DISABLE TRIGGER {trigger}")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table} ENABLE TRIGGER {trigger}")
    written = OperationEvent.objects.filter(id__gt=before)
    assert not written.filter(chain_seq__isnull=False).exists(), (
        "expected the old events unsealed until their format is set, found some sealed")
    if chain_format != 1:
        with raw_connection() as raw:
            raw.execute("SET session_replication_role = replica")
            raw.execute(f"UPDATE {table} SET chain_format = %s WHERE id > %s",
                        [chain_format, before])
