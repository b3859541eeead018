"""Tamper evidence: hash-chained events, verify_audit, purge anchors, the application role."""

import re
import threading

import pgtrigger
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, connections, transaction
from django.db.utils import DatabaseError
from django.utils import timezone

from ledger import chain, receipts, retention, selectors, transitions
from ledger.canonical import fingerprint
from ledger.management.commands.app_role import SCRIPT, create_app_role
from ledger.models import (
    AuditVerification,
    ChainAnchor,
    ChainHead,
    Operation,
    OperationEvent,
)
from ledger.states import State
from tests.factories import OperationFactory
from tests.support.processes import spawn
from tests.support.retention import complete_days_ago, raw_connection, retention_admin


def events_of(tenant="default"):
    return list(OperationEvent.objects.filter(tenant=tenant).order_by("chain_seq"))


# --- the chain ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_each_event_links_to_the_previous_one_of_its_tenant():
    OperationFactory(state=State.SUCCEEDED)
    OperationFactory(state=State.REJECTED, tenant="acme")
    OperationFactory(state=State.ABANDONED)
    assert chain.seal() == 8
    events = events_of("default")
    assert [e.chain_seq for e in events] == [1, 2, 3, 4, 5]  # 3 + 2 transitions
    assert [e.chain_seq for e in events_of("acme")] == [1, 2, 3]
    prev = chain.GENESIS
    for event in events:
        event.operation_ref = event.operation.operation_id
        assert event.chain_hash == chain.link_hash(
            chain.operation_event_payload(event), prev=prev, seq=event.chain_seq)
        prev = event.chain_hash
    head = ChainHead.objects.get(chain="operation_events", tenant="default")
    assert (head.seq, head.hash) == (5, prev)


@pytest.mark.django_db
def test_evidence_numbers_that_jsonb_rewrites_still_verify():
    op = receipts.record_intent("articles.create", "t", {"title": "x"})
    receipts.mark_submitted(op)
    receipts.mark_succeeded(op, evidence={"big": 1e20, "odd": 1.2345e21, "zero": -0.0,
                                          "small": 1e-7, "list": [0.1, 2 ** 70]})
    result = chain.verify(actor="test")
    assert result.is_intact, result.first_break


@pytest.mark.django_db
def test_a_transition_and_its_event_are_one_statement_off_the_chain_head():
    op = receipts.record_intent("articles.create", "t", {"title": "x"})
    # savepoint, one WITH statement (UPDATE operation, INSERT event), release
    with CaptureCount() as captured:
        receipts.mark_submitted(op)
    assert captured.count == 3
    [statement] = [sql for sql in captured.sql if "INSERT INTO ledger_operationevent" in sql]
    assert "UPDATE ledger_operation" in statement
    assert not any("ledger_chainhead" in sql for sql in captured.sql)


class CaptureCount:
    def __enter__(self):
        from django.test.utils import CaptureQueriesContext

        self._ctx = CaptureQueriesContext(connection)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self.sql = [q["sql"] for q in self._ctx.captured_queries]
        self.count = len(self.sql)


def test_link_outside_a_transaction_is_refused(db):
    with pytest.raises(RuntimeError, match="inside the writer's transaction"):
        # pytest-django wraps the test in a transaction; leave it to show the guard.
        connection.in_atomic_block = False
        try:
            chain.link("operation_events", "default", {"x": 1})
        finally:
            connection.in_atomic_block = True


@pytest.mark.django_db(transaction=True)
def test_concurrent_writers_of_one_tenant_never_fork_the_chain():
    ops = [OperationFactory() for _ in range(8)]
    errors = []
    barrier = threading.Barrier(len(ops))

    def finish(op):
        try:
            barrier.wait()
            receipts.mark_submitted(op)
            receipts.mark_succeeded(op)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=finish, args=(op,)) for op in ops]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    chain.seal()
    assert [e.chain_seq for e in events_of()] == list(range(1, 8 * 3 + 1))
    assert chain.verify(actor="test").is_intact


@pytest.mark.django_db(transaction=True)
def test_a_writer_of_a_tenant_never_waits_for_another_writers_commit():
    """The chain is off the commit path: a transaction that wrote an event of a tenant and
    has not committed holds nothing another writer of that tenant needs."""
    written, release = threading.Event(), threading.Event()
    errors = []

    def hold_an_uncommitted_write():
        try:
            with transaction.atomic():  # a receipt's first write, left uncommitted
                now = timezone.now()
                intent = {"title": "held"}
                assert transitions.record(Operation(
                    operation_id=receipts.new_operation_id(now), tenant="default",
                    operation="articles.create", target="t", intent=intent,
                    intent_fingerprint=fingerprint(intent), idempotency_key="held-open",
                    created_at=now, state_changed_at=now))
                written.set()
                release.wait(30)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_an_uncommitted_write)
    holder.start()
    try:
        assert written.wait(30)
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '2s'")  # a wait on the holder would fail
        op = receipts.record_intent("articles.create", "t", {"title": "other"},
                                    idempotency_key="not-waiting")
        receipts.mark_submitted(op)
        receipts.mark_succeeded(op)
        assert chain.seal() == 3  # the holder's event is not committed: not sealed
    finally:
        release.set()
        holder.join()
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = 0")
    assert errors == []
    assert chain.seal() == 1  # committed now: linked after the others
    assert [e.chain_seq for e in events_of()] == [1, 2, 3, 4]
    assert events_of()[-1].operation.idempotency_key == "held-open"
    assert chain.verify(actor="test").is_intact


# --- verify_audit -------------------------------------------------------------------------


@pytest.mark.django_db
def test_verify_audit_passes_on_an_untouched_trail_and_records_when(capsys):
    OperationFactory(state=State.SUCCEEDED)
    OperationFactory(state=State.SUCCEEDED, tenant="acme")
    call_command("verify_audit", actor="test")
    assert "audit trail intact: 6 links in 2 chains" in capsys.readouterr().out
    record = AuditVerification.objects.get()
    assert (record.is_intact, record.links_checked, record.first_break) == (True, 6, None)
    status = selectors.audit_status(tenants={"acme"})
    assert [(h["tenant"], h["seq"]) for h in status["heads"]] == [("acme", 3)]
    assert status["last_verification"] == record


def tamper(sql, params):
    """Change the audit trail as a superuser would, with every trigger bypassed."""
    with raw_connection() as raw:
        raw.execute("SET session_replication_role = replica")
        raw.execute(sql, params)


@pytest.mark.django_db(transaction=True)
def test_an_event_altered_behind_the_triggers_is_found_and_named():
    OperationFactory(state=State.SUCCEEDED)
    victim = OperationFactory(state=State.SUCCEEDED)
    OperationFactory(state=State.SUCCEEDED)
    chain.seal()  # tamper evidence covers sealed events
    event = OperationEvent.objects.get(operation=victim, version=3)
    tamper("UPDATE ledger_operationevent SET actor_id = 'someone else' WHERE id = %s",
           [event.pk])
    with pytest.raises(CommandError) as raised:
        call_command("verify_audit", actor="test")
    message = str(raised.value)
    assert f"event_id {event.pk}" in message
    assert f"operation_id {victim.operation_id}" in message
    assert f"found {event.chain_hash}" in message
    assert re.search(r"expected [0-9a-f]{64}", message)
    record = AuditVerification.objects.get()
    assert not record.is_intact and record.first_break["event_id"] == event.pk


@pytest.mark.django_db(transaction=True)
def test_verify_audit_exits_non_zero_on_a_break():
    op = OperationFactory(state=State.SUCCEEDED)
    chain.seal()
    tamper("UPDATE ledger_operationevent SET reason = 'nothing happened' "
           "WHERE operation_id = %s AND version = 1", [op.pk])
    child = spawn("""
        from django.core.management import execute_from_command_line
        execute_from_command_line(["manage.py", "verify_audit"])
    """)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 1, (out, err)
    assert f"operation_id {op.operation_id}" in err


@pytest.mark.django_db(transaction=True)
def test_a_deleted_event_is_a_missing_link():
    ops = [OperationFactory(state=State.SUCCEEDED) for _ in range(2)]
    chain.seal()
    gone = OperationEvent.objects.get(operation=ops[0], version=2)
    tamper("DELETE FROM ledger_operationevent WHERE id = %s", [gone.pk])
    result = chain.verify(actor="test")
    assert result.first_break.seq == gone.chain_seq + 1
    assert "missing and no purge anchor" in result.first_break.message


@pytest.mark.django_db(transaction=True)
def test_removing_the_newest_events_is_found_through_the_chain_head():
    op = OperationFactory(state=State.SUCCEEDED)
    chain.seal()
    tamper("DELETE FROM ledger_operationevent WHERE operation_id = %s AND version = 3", [op.pk])
    result = chain.verify(actor="test")
    assert not result.is_intact
    assert "chain head is not the last link" in result.first_break.message


# --- purge anchors ------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_purge_followed_by_verify_audit_passes(capsys):
    user = retention_admin()
    retention.set_policy("*", purge_after_days=10, user=user)
    # Interleave purged and kept operations in one chain, and purge the newest events too.
    kept_early = OperationFactory(state=State.OUTCOME_UNKNOWN)
    purged = [OperationFactory(state=State.SUCCEEDED) for _ in range(3)]
    kept_late = OperationFactory(state=State.SUCCEEDED)
    purged.append(OperationFactory(state=State.REJECTED))
    for op in purged:
        complete_days_ago(op, 11)
    retention.purge(actor="test", batch=2)
    assert set(Operation.objects.values_list("pk", flat=True)) == {kept_early.pk, kept_late.pk}
    head = ChainHead.objects.get(tenant="default")
    assert ChainAnchor.objects.filter(tenant="default", seq=head.seq, hash=head.hash).exists()
    call_command("verify_audit", actor="test")
    assert "audit trail intact" in capsys.readouterr().out
    # New events after the purge continue the same chain.
    receipts.mark_submitted(OperationFactory())
    assert chain.verify(actor="test").is_intact


@pytest.mark.django_db
def test_events_stay_append_only_outside_the_purge():
    op = OperationFactory(state=State.SUCCEEDED)
    with pytest.raises(DatabaseError), transaction.atomic():
        OperationEvent.objects.filter(operation=op).update(reason="rewritten")
    with pytest.raises(DatabaseError), transaction.atomic():
        OperationEvent.objects.filter(operation=op).delete()
    open_op = OperationFactory(state=State.MANUAL_REVIEW)
    # Its events refuse to lose it (ON DELETE RESTRICT, migration 0029)...
    with pytest.raises(DatabaseError, match="referenced from table \"ledger_operationevent\""), \
            transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("DELETE FROM ledger_operation WHERE id = %s", [open_op.pk])
    # ...and with its events gone, as the purge's own sanction may do, it is still not
    # deleted: it is not terminal.
    with pytest.raises(DatabaseError, match="expected a terminal operation"), \
            transaction.atomic(), connection.cursor() as cursor:
        _delete_under_the_purges_sanction(cursor, [open_op.pk])
    assert Operation.objects.filter(pk=open_op.pk).exists()


def _delete_under_the_purges_sanction(cursor, ids):
    """What ledger_retention_purge does (the referring rows first, then the operations), as
    the tables' owner with its setting, but without its own checks: the trigger's turn."""
    cursor.execute("SET LOCAL ledger.sanctioned = 'retention'")
    for table in ("ledger_operationevent", "ledger_evidence"):
        cursor.execute(f"DELETE FROM {table} WHERE operation_id = ANY(%s)", [ids])
    cursor.execute("DELETE FROM ledger_operation WHERE id = ANY(%s)", [ids])


@pytest.mark.django_db
def test_one_unfinished_operation_refuses_a_whole_delete_statement():
    # The purge deletes a batch in one statement; the check runs once over all its rows.
    done = [OperationFactory(state=State.SUCCEEDED) for _ in range(3)]
    open_op = OperationFactory(state=State.MANUAL_REVIEW)
    ids = [op.pk for op in [*done, open_op]]
    with pytest.raises(DatabaseError, match=rf"operation {open_op.operation_id}: expected a "
                                            r"terminal operation .* found state manual_review"), \
            transaction.atomic(), connection.cursor() as cursor:
        _delete_under_the_purges_sanction(cursor, ids)
    assert Operation.objects.filter(pk__in=ids).count() == 4


@pytest.mark.django_db
def test_events_and_evidence_refuse_even_a_statement_that_matches_nothing():
    for table in ("ledger_operationevent", "ledger_evidence"):
        for sql in (f"DELETE FROM {table} WHERE id = -1",
                    f"UPDATE {table} SET created_at = now() WHERE id = -1"):
            with pytest.raises(DatabaseError, match=f"Cannot update or delete rows from {table}"), \
                    transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(sql)


# --- the application role -----------------------------------------------------------------

AUDIT_TABLES = ["ledger_operationevent", "ledger_evidence", "ledger_retentionchange",
                "ledger_redaction", "ledger_chainanchor", "ledger_factdecision",
                "ledger_episode", "ledger_tenantaccesschange", "ledger_agentkeychange",
                "ledger_approval", "ledger_approvalpolicychange", "ledger_resolutionproposal",
                "ledger_operationnote", "ledger_notificationchannelchange",
                "ledger_deliveryattempt", "ledger_auditcheckpoint", "ledger_recordlink",
                "ledger_coveragereading", "ledger_unknownoutcomepolicychange"]


def test_the_role_script_covers_every_append_only_table():
    from django.apps import apps

    protected = {
        model._meta.db_table
        for model in apps.get_app_config("ledger").get_models()
        if any(isinstance(t, pgtrigger.Protect) for t in getattr(model._meta, "triggers", []))
    }
    # In the script's ledger_writes, the append-only tables get INSERT at most.
    writes = dict(re.findall(r"'(ledger_\w+)', '([^']*)'", SCRIPT.read_text()))
    insert_only = {table for table, granted in writes.items() if granted in ("INSERT", "")}
    assert protected == set(AUDIT_TABLES)
    assert protected <= insert_only


@pytest.mark.django_db
def test_the_app_role_cannot_update_delete_or_truncate_audit_tables_but_can_write():
    OperationFactory(state=State.SUCCEEDED)
    create_app_role("ledger_app_test")
    with connection.cursor() as cursor:
        cursor.execute("SET ROLE ledger_app_test")
        for table in AUDIT_TABLES:
            for statement in (f"UPDATE {table} SET id = id", f"DELETE FROM {table}",
                              f"TRUNCATE {table}"):
                with pytest.raises(DatabaseError) as refused, transaction.atomic():
                    cursor.execute(statement)
                assert refused.value.__cause__.sqlstate == "42501", statement  # no privilege
        # What the application does every day still works under the role.
        op = receipts.record_intent("articles.create", "t", {"title": "as the app"})
        receipts.mark_submitted(op)
        receipts.mark_succeeded(op, external_id="a-1")
        cursor.execute("SELECT current_user")
        assert cursor.fetchone() == ("ledger_app_test",)
        cursor.execute("RESET ROLE")
    assert Operation.objects.get(pk=op.pk).state == State.SUCCEEDED


def decide_a_conflict(subject: str):
    from ledger import facts
    from ledger.models import FactConflict

    facts.assert_fact(subject, "status", "paid", source="agent-a")
    facts.assert_fact(subject, "status", "refunded", source="agent-b")
    conflict = FactConflict.objects.get(subject=subject)
    facts.resolve_conflict(conflict, winner="candidate", user=retention_admin(f"r-{subject}"),
                           reason="the bank statement shows the refund")
    return conflict.decisions.get()


@pytest.mark.django_db(transaction=True)
def test_human_decisions_on_facts_are_chained_and_verify():
    first, second = decide_a_conflict("order-1"), decide_a_conflict("order-2")
    assert (first.chain_seq, second.chain_seq, first.chain_hash) == (None, None, "")
    chain.seal()  # written unsealed; linked by the sealer alone
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.chain_seq, second.chain_seq) == (1, 2)
    assert chain.verify(actor="test").is_intact


@pytest.mark.django_db(transaction=True)
def test_a_fact_decision_altered_behind_the_triggers_is_found_and_named():
    decide_a_conflict("order-1")
    victim = decide_a_conflict("order-2")
    chain.seal()
    tamper("UPDATE ledger_factdecision SET reason = 'no reason' WHERE id = %s", [victim.pk])
    result = chain.verify(actor="test")
    assert not result.is_intact
    assert result.first_break.chain == "fact_decisions"
    assert result.first_break.ids == {"fact_decision_id": victim.pk,
                                      "conflict_id": victim.conflict_id}
    # The records chain names it too (and would before the sealer linked it).
    [record] = result.records_differing
    assert (record.ids["source"], record.ids["row_id"]) == ("fact_decision", victim.pk)
    assert "differs from its last record link in reason" in record.message
