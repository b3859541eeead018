"""The desk's search reads OperationSearch, the strings beside each operation (migration
0051): PostgreSQL writes them when the operation is inserted and when its external id is
set, removes them with the operation, and lets no role write them; a transition that
changes neither touches them."""

from __future__ import annotations

import pytest
from django.db import connection

from ledger import receipts, retention
from ledger.models import Operation, OperationSearch
from ledger.selectors.operations import QueueFilters, review_queue
from ledger.states import State
from tests.conftest import TEST_LOGINS
from tests.factories import OperationFactory
from tests.support.processes import run_as
from tests.support.retention import complete_days_ago, retention_admin


def _succeeded(external_id: str) -> Operation:
    op = OperationFactory(state=State.SUBMITTED)
    return receipts.mark_succeeded(op, external_id=external_id)


def _rows(op) -> dict[str, tuple[str, str, int]]:
    """kind -> (tenant, text, xmin) of the operation's search rows."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT kind, tenant, text, xmin::text::bigint "
                       "FROM ledger_operationsearch WHERE operation_id = %s", [op.pk])
        return {kind: (tenant, text, xmin) for kind, tenant, text, xmin in cursor.fetchall()}


@pytest.mark.django_db
def test_an_operation_s_id_and_key_are_written_at_insert_its_external_id_when_set():
    op = receipts.record_intent("articles.create", "https://cms.example", {"title": "T"},
                                tenant="acme", idempotency_key="order-7781")
    rows = _rows(op)
    assert {k: v[:2] for k, v in rows.items()} == {
        "receipt": ("acme", f"{op.operation_id}\x1forder-7781")}

    receipts.mark_submitted(op)
    # the transition wrote the operation's row again, and nothing here
    assert _rows(op) == rows

    receipts.mark_succeeded(op, external_id="cms-99120")
    after = _rows(op)
    assert after["receipt"] == rows["receipt"]
    assert after["external"][:2] == ("acme", "cms-99120")


@pytest.mark.django_db
def test_an_external_id_changed_later_is_kept_in_step():
    op = _succeeded("ext-first")
    assert _rows(op)["external"][1] == "ext-first"
    # A settled receipt is frozen, and an external id changes only with its event; as the
    # tables' owner may, those rules are set aside here (inside the test's transaction):
    # the search's triggers follow whatever change gets through.
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # the writes so far: checked now
        cursor.execute("ALTER TABLE ledger_operation DISABLE TRIGGER USER")
        for name in ("ledger_operation_search_insert", "ledger_operation_search_update",
                     "ledger_operation_search_delete"):
            cursor.execute(f"ALTER TABLE ledger_operation ENABLE TRIGGER {name}")
        cursor.execute("UPDATE ledger_operation SET external_id = 'ext-second' WHERE id = %s",
                       [op.pk])
        assert _rows(op)["external"][1] == "ext-second"
        cursor.execute("UPDATE ledger_operation SET external_id = '' WHERE id = %s", [op.pk])
        assert set(_rows(op)) == {"receipt"}


@pytest.mark.django_db
def test_the_queue_finds_an_external_id_set_by_a_transition(reviewer):
    op = receipts.record_intent("articles.create", "https://cms.example", {"title": "T"},
                                idempotency_key="k-1")
    receipts.mark_submitted(op)
    receipts.mark_outcome_unknown(op, error_code="TimeoutError")
    assert review_queue(reviewer, QueueFilters(search="zq-4471")).items == []
    receipts.resolve(op, State.SUCCEEDED, user=reviewer, reason="found it in the CMS",
                     external_id="cms-zq-4471")
    found = review_queue(reviewer, QueueFilters(search="zq-4471")).items
    assert [row.operation_id for row in found] == [op.operation_id]


@pytest.mark.django_db
def test_the_purge_removes_the_rows_with_their_operation():
    retention.set_policy("*", purge_after_days=30, redact_after_days=None,
                         user=retention_admin())
    gone = _succeeded("ext-gone")
    kept = _succeeded("ext-kept")
    complete_days_ago(gone, 40)
    assert retention.purge(actor="test").purged_operation_ids == [gone.operation_id]
    assert not OperationSearch.objects.filter(operation_id=gone.pk).exists()
    assert set(_rows(kept)) == {"receipt", "external"}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["agent", "reconciler", "desk"])
def test_no_role_writes_the_search_rows(kind):
    op = _succeeded("ext-1")
    before = _rows(op)
    found = run_as(TEST_LOGINS[kind], f"""
from django.db import connection, transaction
from ledger import errors
result = {{}}
for name, sql in [
    ("insert", "INSERT INTO ledger_operationsearch (operation_id, kind, tenant, text) "
               "VALUES ({op.pk}, 'forged', 'default', 'forged')"),
    ("update", "UPDATE ledger_operationsearch SET text = 'forged' WHERE operation_id = {op.pk}"),
    ("delete", "DELETE FROM ledger_operationsearch WHERE operation_id = {op.pk}"),
]:
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql)
    except errors.PermissionDenied as exc:
        result[name] = [getattr(exc.__cause__, "sqlstate", None), str(exc)]
    else:
        result[name] = ["accepted", ""]
with connection.cursor() as cursor:
    cursor.execute("SELECT count(*) FROM ledger_operationsearch WHERE operation_id = {op.pk}")
    result["reads"] = cursor.fetchone()[0]
""")
    assert found.pop("reads") == 2
    for name, (sqlstate, message) in found.items():
        assert sqlstate == "42501", (name, found[name])
        assert "ledger_operationsearch" in message and "expected" in message, message
    assert _rows(op) == before
    assert Operation.objects.filter(pk=op.pk).exists()
