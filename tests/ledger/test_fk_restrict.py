"""The tables that refer to an operation refuse, at once, to lose it (migration 0029): ON
DELETE RESTRICT, not deferred, so the purge deletes the referring rows first and nothing,
its sanction included, can leave an event, a piece of evidence or a note without its
operation."""

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from ledger import retention
from ledger.models import Evidence, Operation, OperationEvent
from ledger.states import State
from tests.factories import OperationFactory
from tests.support.retention import complete_days_ago, retention_admin


def _references():
    with connection.cursor() as cursor:
        cursor.execute("""
            SELECT c.conrelid::regclass::text, c.confdeltype, c.condeferrable, c.convalidated
              FROM pg_constraint c
             WHERE c.confrelid = 'ledger_operation'::regclass AND c.contype = 'f'
             ORDER BY 1""")
        return cursor.fetchall()


@pytest.mark.django_db
def test_every_table_that_refers_to_an_operation_restricts_its_deletion_at_once():
    found = _references()
    # RESTRICT ('r'), never deferrable, validated: a migration that alters one of these
    # fields makes Django re-create the key as NO ACTION DEFERRABLE, which this catches.
    assert [row for row in found if row[1:] != ("r", False, True)] == []
    assert {table for table, *_ in found} >= {
        "ledger_operationevent", "ledger_evidence", "ledger_claim", "ledger_operationnote",
        "ledger_resolutionproposal", "ledger_notificationsent", "ledger_approval",
        "ledger_approvalrequest"}


@pytest.mark.django_db
def test_even_the_purges_sanction_cannot_delete_an_operation_that_events_still_refer_to():
    op = OperationFactory(state=State.SUCCEEDED)
    complete_days_ago(op, 400)
    assert OperationEvent.objects.filter(operation=op).exists()
    # PostgreSQL 15 says "is still referenced from table", 18 "is referenced from table".
    with pytest.raises(IntegrityError, match="referenced from table \"ledger_operationevent\""):
        with transaction.atomic(), connection.cursor() as cursor:
            # What the purge function sets for itself, as the tables' owner; the delete is
            # refused at the statement, not at a commit that might never come.
            cursor.execute("SET LOCAL ledger.sanctioned = 'retention'")
            cursor.execute("DELETE FROM ledger_operation WHERE id = %s", [op.pk])
    assert Operation.objects.filter(pk=op.pk).exists()


@pytest.mark.django_db
def test_the_purge_still_removes_an_operation_with_everything_that_refers_to_it():
    retention.set_policy("*", purge_after_days=30, redact_after_days=None,
                         user=retention_admin())
    op = OperationFactory(state=State.SUCCEEDED)
    complete_days_ago(op, 40)
    Evidence.objects.create(operation=op, reconciler="r", verdict="found",
                            created_at=timezone.now())
    result = retention.purge(actor="test")
    assert result.purged_operation_ids == [op.operation_id]
    assert not Operation.objects.filter(pk=op.pk).exists()
    assert not OperationEvent.objects.filter(operation_id=op.pk).exists()
    assert not Evidence.objects.filter(operation_id=op.pk).exists()
