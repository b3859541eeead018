"""The sealer: events are written unsealed and linked into their tenant's chain after the
commit, by `ledger.chain.seal` through `ledger_seal_events`, and by nothing else."""

import signal
import threading
import time
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, connections, transaction
from django.utils import timezone

from ledger import chain, health, metrics, receipts, retention
from ledger.management.commands.app_role import create_app_role
from ledger.models import ChainHead, Operation, OperationEvent
from ledger.states import State
from tests.factories import OperationFactory
from tests.support.processes import spawn
from tests.support.retention import complete_days_ago, raw_connection, retention_admin


def unsealed_count() -> int:
    return OperationEvent.objects.filter(chain_seq__isnull=True).count()


def head(tenant="default") -> tuple[int, str]:
    found = ChainHead.objects.filter(chain="operation_events", tenant=tenant).first()
    return (found.seq, found.hash) if found else (0, chain.GENESIS)


# --- sealing ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_events_are_written_unsealed_and_sealed_in_id_order_per_tenant():
    OperationFactory(state=State.SUCCEEDED)
    OperationFactory(state=State.SUCCEEDED, tenant="acme")
    assert unsealed_count() == 6 and not ChainHead.objects.exists()
    assert chain.seal(limit=2) == 6  # batches of two, until nothing is left
    for tenant in ("default", "acme"):
        events = list(OperationEvent.objects.filter(tenant=tenant).order_by("id"))
        assert [e.chain_seq for e in events] == [1, 2, 3]
        assert head(tenant) == (3, events[-1].chain_hash)
    assert chain.seal() == 0
    assert chain.verify(actor="test").is_intact


@pytest.mark.django_db
def test_verify_seals_first_and_reports_what_committed_after_as_the_unsealed_tail():
    OperationFactory(state=State.SUCCEEDED)
    result = chain.verify(actor="test", seal_first=False)
    assert result.is_intact
    [entry] = result.record.heads
    assert (entry["tenant"], entry["seq"], entry["unsealed"]) == ("default", 0, 3)
    result = chain.verify(actor="test")
    assert result.is_intact and unsealed_count() == 0
    assert "unsealed" not in result.record.heads[0]


@pytest.mark.django_db
def test_verify_audit_without_sealing_names_the_tail():
    OperationFactory(state=State.SUCCEEDED)
    out = StringIO()
    call_command("verify_audit", no_seal=True, stdout=out)
    assert "audit trail intact: 0 links" in out.getvalue()
    assert "3 committed event(s) not sealed yet" in out.getvalue()
    out = StringIO()
    call_command("verify_audit", stdout=out)
    assert "audit trail intact: 3 links" in out.getvalue() and "not sealed" not in out.getvalue()


@pytest.mark.django_db
def test_the_unsealed_tail_shows_in_health_and_metrics_until_sealed():
    OperationFactory(state=State.PLANNED)
    later = timezone.now() + timedelta(minutes=5)
    [tail] = chain.unsealed()
    assert (tail.tenant, tail.events) == ("default", 1)
    check = next(c for c in health.run(now=later).checks if c.name == "sealer_lag")
    assert not check.ok and "expected the oldest unsealed event to wait under" in check.detail
    text = metrics.render(now=later).decode()
    assert 'ledger_unsealed_events{tenant="default"} 1.0' in text
    lag = float(text.split("\nledger_sealer_max_lag_seconds ")[1].split()[0])
    assert 290 < lag < 310
    chain.seal()
    check = next(c for c in health.run(now=later).checks if c.name == "sealer_lag")
    assert check.ok
    assert "ledger_sealer_max_lag_seconds 0.0" in metrics.render(now=later).decode()


@pytest.mark.django_db(transaction=True)
def test_two_sealers_at_once_never_fork_a_chain():
    for i in range(60):
        receipts.record_intent("articles.create", "t", {"n": i}, idempotency_key=f"k-{i}")
    counts, errors = [], []
    barrier = threading.Barrier(2)

    def sealer():
        try:
            barrier.wait()
            total = 0
            while unsealed_count():
                total += chain.seal(limit=7)
            counts.append(total)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=sealer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert sum(counts) == 60
    seqs = sorted(OperationEvent.objects.values_list("chain_seq", flat=True))
    assert seqs == list(range(1, 61))
    assert chain.verify(actor="test").is_intact


@pytest.mark.django_db(transaction=True)
def test_reconcile_seals_what_its_pass_wrote():
    OperationFactory(state=State.OUTCOME_UNKNOWN)
    call_command("reconcile", once=True, stdout=StringIO())
    assert unsealed_count() == 0
    call_command("reconcile", once=True, no_seal=True, stdout=StringIO())
    assert unsealed_count() == 0  # nothing new was written; --no-seal leaves the tail alone


@pytest.mark.django_db(transaction=True)
def test_the_seal_command_seals_once():
    OperationFactory(state=State.SUCCEEDED)
    call_command("seal", once=True, stdout=StringIO())
    assert unsealed_count() == 0
    assert head() == (3, OperationEvent.objects.order_by("-id").first().chain_hash)


# --- only the sealer, only once --------------------------------------------------------------


def seal_call(cursor, tenant, ids, hashes, prev_seq=0, prev_hash=chain.GENESIS):
    cursor.execute("SELECT ledger_seal_events(%s, %s, %s, %s, %s)",
                   [tenant, ids, hashes, prev_seq, prev_hash])


def refused(statement, *params) -> DatabaseError:
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        with connection.cursor() as cursor:
            statement(cursor, *params)
    return caught.value


@pytest.mark.django_db
def test_an_event_link_is_set_by_the_sealer_function_alone_and_only_once():
    op = OperationFactory(state=State.SUCCEEDED)
    first = op.events.order_by("id").first()
    digest = "a" * 64
    # Not by an UPDATE, even the table owner's, even of the chain columns alone.
    error = refused(lambda c: c.execute(
        "UPDATE ledger_operationevent SET chain_seq = 1, chain_hash = %s WHERE id = %s",
        [digest, first.pk]))
    assert "expected only INSERT (it is append-only" in str(error)
    # An owner claiming the sealer's setting still changes nothing but an unset link.
    def as_owner_in_seal_mode(cursor, sql, params):
        cursor.execute("SET LOCAL ledger.sanctioned = 'seal'")
        cursor.execute(sql, params)

    error = refused(as_owner_in_seal_mode, "UPDATE ledger_operationevent SET reason = 'x', "
                    "chain_seq = 1, chain_hash = %s WHERE id = %s", [digest, first.pk])
    assert "expected the sealer to set an unsealed event's chain_seq and chain_hash and " \
           "nothing else, found chain_seq unset -> 1 and other columns changed" in str(error)
    # The function: from the head it was given, unsealed events of that tenant, whole.
    error = refused(seal_call, "default", [first.pk], [digest], 5, "b" * 64)
    assert error.__cause__.sqlstate == "40001"
    assert "expected the chain head of operation_events/default at 5:" in str(error)
    error = refused(seal_call, "acme", [first.pk], [digest])
    assert "expected 1 unsealed events of tenant acme to seal, found 0" in str(error)
    error = refused(seal_call, "default", [first.pk], [])
    assert "expected as many hashes as events to seal, at least one, found 1 events and 0" \
           in str(error)
    chain.seal()
    first.refresh_from_db()
    sealed_hash = first.chain_hash
    error = refused(seal_call, "default", [first.pk], [digest], *head())
    assert "expected 1 unsealed events of tenant default to seal, found 0" in str(error)
    error = refused(as_owner_in_seal_mode, "UPDATE ledger_operationevent SET chain_seq = 99 "
                    "WHERE id = %s", [first.pk])
    assert "found chain_seq 1 -> 99" in str(error)
    first.refresh_from_db()
    assert (first.chain_seq, first.chain_hash) == (1, sealed_hash)


@pytest.mark.django_db
def test_a_half_sealed_event_is_refused():
    op = OperationFactory(state=State.PLANNED)
    event = op.events.get()
    error = refused(lambda c: c.execute(
        "INSERT INTO ledger_operationevent (operation_id, tenant, version, from_state, "
        "to_state, actor_kind, actor_id, reason, created_at, chain_seq) "
        "VALUES (%s, 'default', 2, 'planned', 'abandoned', 'agent', '', '', now(), 7)",
        [event.operation_id]))
    # Refused before the constraint event_sealed_whole: no event is written linked at all.
    assert error.__cause__.sqlstate == "42501", error
    assert "expected it written unsealed" in str(error) and "found chain_seq 7" in str(error)


@pytest.mark.django_db
def test_the_app_role_seals_through_the_function_and_cannot_write_links_itself():
    OperationFactory(state=State.SUCCEEDED)
    create_app_role("ledger_app_test")
    with connection.cursor() as cursor:
        cursor.execute("SET ROLE ledger_app_test")
        try:
            event = OperationEvent.objects.order_by("id").first()
            error = refused(lambda c: c.execute(
                "UPDATE ledger_operationevent SET chain_seq = 1, chain_hash = %s "
                "WHERE id = %s", ["a" * 64, event.pk]))
            assert error.__cause__.sqlstate == "42501"
            assert chain.seal() == 3
            assert chain.verify(actor="test").is_intact
        finally:
            cursor.execute("RESET ROLE")


# --- purge -----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_purge_seals_first_and_the_function_refuses_an_unsealed_operation():
    user = retention_admin()
    retention.set_policy("*", purge_after_days=10, user=user)
    old = OperationFactory(state=State.SUCCEEDED)
    complete_days_ago(old, 11)
    run = retention._start_run(retention.policies_by_specificity()[0], actor="test", batch=1,
                               dry_run=False)
    error = refused(lambda c: c.execute("SELECT ledger_retention_purge(%s, %s)",
                                        [run.pk, [old.pk]]))
    assert (f"operation {old.operation_id}: expected every event sealed into the chain before "
            "the purge (ledger.chain.seal), found version 1 unsealed") in str(error)
    assert Operation.objects.filter(pk=old.pk).exists()
    # The batch picker skips it (as it skips what commits after purge's own seal)...
    ordered = retention.policies_by_specificity()
    assert retention._purge_batch(run, ordered[0], ordered, timezone.now(), 10, None) == ([], None)
    # ...and purge seals first, so it goes.
    retention.purge(actor="test")
    assert not Operation.objects.filter(pk=old.pk).exists()
    assert chain.verify(actor="test").is_intact


# --- a sealer killed mid-batch ---------------------------------------------------------------


def sealer_backends(raw) -> list[tuple]:
    return raw.execute("SELECT pid, state, xact_start IS NOT NULL FROM pg_stat_activity "
                       "WHERE application_name = 'ledger seal' "
                       "AND datname = current_database()").fetchall()  # not another worker's


@pytest.mark.django_db(transaction=True)
def test_a_sealer_killed_mid_batch_leaves_whole_batches_and_the_next_one_finishes():
    for i in range(400):
        receipts.record_intent("articles.create", "t", {"n": i}, idempotency_key=f"kill-{i}")
    child = spawn("""
        from django.core.management import call_command
        call_command("seal", limit=40, interval=0.05)
    """)
    killed_in_transaction = False
    with raw_connection() as raw:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            sealed = raw.execute("SELECT count(*) FROM ledger_operationevent "
                                 "WHERE chain_seq IS NOT NULL").fetchone()[0]
            in_transaction = [b for b in sealer_backends(raw) if b[2]]
            if sealed >= 80 and in_transaction:
                child.send_signal(signal.SIGKILL)
                killed_in_transaction = True
                break
            time.sleep(0.002)
        child.wait(30)
        assert killed_in_transaction, "the sealer finished before it could be killed mid-batch"
        while sealer_backends(raw) and time.monotonic() < deadline:  # the server notices
            time.sleep(0.05)
        sealed = raw.execute("SELECT count(*), max(chain_seq) FROM ledger_operationevent "
                             "WHERE chain_seq IS NOT NULL").fetchone()
    assert child.returncode == -signal.SIGKILL
    assert sealed[0] % 40 == 0 and sealed[0] == sealed[1]  # whole batches, no gap
    assert head() == (sealed[0], OperationEvent.objects.get(chain_seq=sealed[0]).chain_hash)
    partial = chain.verify(actor="test", seal_first=False)
    assert partial.is_intact
    if sealed[0] < 400:
        assert partial.record.heads[0]["unsealed"] == 400 - sealed[0]
    call_command("seal", once=True, stdout=StringIO())
    assert unsealed_count() == 0
    assert chain.verify(actor="test").is_intact



@pytest.mark.django_db(transaction=True)
def test_verify_reads_one_snapshot_while_writers_and_a_sealer_commit():
    """Real threads: agents write and a sealer seals while verify_audit walks, again and
    again; every walk sees heads, links, the unsealed tail and the rows from one moment."""
    stop = threading.Event()
    errors = []

    def agent(n):
        try:
            i = 0
            while not stop.is_set():
                op = receipts.record_intent("articles.create", "t", {"n": n, "i": i},
                                            idempotency_key=f"snap-{n}-{i}")
                receipts.mark_submitted(op)
                receipts.mark_succeeded(op, external_id=f"a-{n}-{i}")
                i += 1
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    def sealing():
        try:
            while not stop.is_set():
                chain.seal(limit=5)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=agent, args=(n,)) for n in range(2)]
    threads.append(threading.Thread(target=sealing))
    for thread in threads:
        thread.start()
    try:
        for _ in range(15):
            result = chain.verify(actor="test", seal_first=False)
            assert result.is_intact, result.first_break
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert errors == []
    assert chain.verify(actor="test").is_intact
