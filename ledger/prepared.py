"""Server-side prepared statements for the ledger's hot paths.

The SQL of a receipt's write, an idempotency look-up, a reconciler's claim or a lease
change is the same text call after call with other values. Bound on the server, psycopg
prepares each text once per connection (the connection's `prepare_threshold`, set in
settings) and PostgreSQL reuses its plan instead of planning at every call: bench/ P1 and
P3 measure what it saves. Django's own queries keep client-side binding and are never
prepared.
"""

from __future__ import annotations

from django.db import connection
from django.db.backends.postgresql.base import ServerBindingCursor
from django.db.backends.utils import CursorWrapper


def prepared_cursor() -> CursorWrapper:
    """A Django cursor whose statements are bound on the server, hence prepared.

    For the ledger's hot statements, whose SQL text repeats call after call with other
    values: with the connection's `prepare_threshold` (settings: 0) psycopg prepares each
    on first use and PostgreSQL reuses its plan, which saves more than the plan costs to
    keep. Django's cursor wrapper stays around it, so execute_wrapper, query logging and
    error translation see these statements like any other. With `prepare_threshold` None
    (LEDGER_PREPARED_STATEMENTS=0) the same statements run unprepared.
    """
    connection.ensure_connection()
    connection.validate_thread_sharing()
    with connection.wrap_database_errors:
        cursor = ServerBindingCursor(connection.connection)
    if connection.queries_logged:
        return connection.make_debug_cursor(cursor)
    return connection.make_cursor(cursor)
