"""Helpers for the retention tests: age operations, make admins, read raw connections."""

from __future__ import annotations

from datetime import timedelta

import psycopg
from django.db import connection
from django.utils import timezone

from ledger.chain_content import time_sql
from tests.factories import UserFactory


def complete_days_ago(op, days: float, *, now=None) -> None:
    """Move `op.completed_at` `days` into the past with a raw UPDATE, as a superuser would:
    a settled receipt is frozen (`operation_unchanged_when_terminal`), so the UPDATE runs
    with the triggers off (`session_replication_role = replica`). Done even for a
    non-terminal operation, to show that age alone never makes one purgeable.

    Its last event, when not sealed yet, is aged with it (what format 4 covers); a sealed
    one is not (that would be a rewrite verify_audit reports).

    Also fires the deferred "every change has its event" checks of the writes so far: a
    non-transactional test never commits, and a purge deletes the events those checks
    would look for at the end of the test.
    """
    when = (now or timezone.now()) - timedelta(days=days)
    with connection.cursor() as cursor:
        cursor.execute("SET session_replication_role = replica")
        cursor.execute("UPDATE ledger_operation SET completed_at = %s WHERE id = %s",
                       [when, op.pk])
        # As if it had completed then: its last event, if not sealed yet, says so too (the
        # chain covers completed_at from format 4: ledger.chain_content).
        cursor.execute(
            "UPDATE ledger_operationevent e SET content = jsonb_set(e.content, "
            f"'{{completed_at}}', to_jsonb({time_sql('o.completed_at')})) "
            "FROM ledger_operation o WHERE o.id = %s AND e.operation_id = o.id "
            "AND e.version = o.version AND e.chain_seq IS NULL AND e.content ? 'completed_at'",
            [op.pk])
        cursor.execute("RESET session_replication_role")
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cursor.execute("SET CONSTRAINTS ALL DEFERRED")
    op.completed_at = when


def retention_admin(username: str = "retention-admin"):
    """A superuser: has every permission even after a transactional test flushed the groups."""
    user = UserFactory(username=username, tenants=[])
    user.is_superuser = True
    user.save(update_fields=["is_superuser"])
    return user


def raw_connection() -> psycopg.Connection:
    """A new superuser connection to the test database, outside Django, autocommit."""
    settings = connection.settings_dict
    return psycopg.connect(
        host=settings["HOST"], port=settings["PORT"] or None, dbname=settings["NAME"],
        user=settings["USER"], password=settings["PASSWORD"] or None, autocommit=True,
    )
