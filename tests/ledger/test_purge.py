"""manage.py purge: batches, dry runs, interruption, properties, and purging under load."""

import threading
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, connections
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger import chain, receipts, retention
from ledger.errors import InvalidInput
from ledger.models import Evidence, Operation, OperationEvent, PurgeRun
from ledger.selectors import retention as retention_reads
from ledger.states import TERMINAL, State
from tests.factories import OperationFactory
from tests.support.retention import complete_days_ago, raw_connection, retention_admin


@pytest.fixture
def thirty_days(db):
    user = retention_admin()
    return retention.set_policy("*", purge_after_days=30, redact_after_days=None, user=user)


def aged(state, days, **kwargs):
    op = OperationFactory(state=state, **kwargs)
    complete_days_ago(op, days)
    return op


@pytest.mark.django_db
def test_purge_removes_old_terminal_operations_with_their_events_and_evidence(thirty_days):
    old = [aged(state, 31) for state in sorted(TERMINAL)]
    Evidence.objects.create(operation=old[0], reconciler="r", verdict="found",
                            created_at=timezone.now())
    young = aged(State.SUCCEEDED, 29)
    stuck = aged(State.OUTCOME_UNKNOWN, 400)

    call_command("purge", actor="cron", batch=2)

    assert set(Operation.objects.values_list("pk", flat=True)) == {young.pk, stuck.pk}
    assert not OperationEvent.objects.filter(operation_id__in=[o.pk for o in old]).exists()
    assert not Evidence.objects.exists()
    run = PurgeRun.objects.get(state_policy=None)
    ids = sorted(o.operation_id for o in old)
    assert (run.operations_purged, run.events_purged, run.evidence_purged) == (3, 8, 1)
    assert (run.first_operation_id, run.last_operation_id) == (ids[0], ids[-1])
    assert (run.actor, run.batch_size, run.dry_run) == ("cron", 2, False)
    assert run.finished_at >= run.started_at


@pytest.mark.django_db
def test_purge_keeps_an_operation_until_its_events_are_old_enough(db):
    user = retention_admin()
    retention.set_policy("*", purge_after_days=10, keep_events_days=60, user=user)
    kept, purged = aged(State.SUCCEEDED, 30), aged(State.SUCCEEDED, 61)
    result = retention.purge(actor="test")
    assert result.purged_operation_ids == [purged.operation_id]
    assert Operation.objects.filter(pk=kept.pk).exists()


@pytest.mark.django_db
def test_dry_run_changes_nothing_and_records_what_it_would_do(thirty_days, capsys):
    ops = [aged(State.SUCCEEDED, 40) for _ in range(3)]
    events = OperationEvent.objects.count()
    call_command("purge", "--dry-run", actor="cron")
    assert Operation.objects.count() == 3 and OperationEvent.objects.count() == events
    run = PurgeRun.objects.get(state_policy=None)
    assert (run.dry_run, run.operations_purged, run.events_purged) == (True, 3, 9)
    assert run.first_operation_id == min(o.operation_id for o in ops)
    assert "would purge 3 operations" in capsys.readouterr().out


@pytest.mark.django_db
def test_purge_shows_progress_per_batch(thirty_days, capsys):
    for _ in range(5):
        aged(State.REJECTED, 40)
    call_command("purge", "--batch", "2", actor="cron")
    out = capsys.readouterr().out
    assert "purged 2 operations so far" in out
    assert "purged 4 operations so far" in out
    assert "purged 5 operations so far" in out
    assert "purged 5 operations, redacted 0, in 1 policies" in out


@pytest.mark.django_db
def test_the_command_pauses_after_each_batch_outside_its_transaction(thirty_days, monkeypatch):
    for _ in range(5):
        aged(State.REJECTED, 40)
    slept = []

    def sleep(seconds):
        slept.append((seconds, Operation.objects.count()))

    monkeypatch.setattr(retention.time, "sleep", sleep)
    call_command("purge", "--batch", "2", "--pause-ms", "25", actor="cron")
    # After each of the three batches, with that batch already committed and visible.
    assert slept == [(0.025, 3), (0.025, 1), (0.025, 0)]
    slept.clear()
    call_command("purge", "--batch", "2", actor="cron")  # nothing left: no batch, no pause
    assert slept == []


@pytest.mark.django_db
@pytest.mark.parametrize("pause", [timedelta(seconds=-1), timedelta(minutes=2), 0.01])
def test_a_pause_out_of_range_is_refused_before_anything_is_written(thirty_days, pause):
    aged(State.REJECTED, 40)
    with pytest.raises(InvalidInput, match="expected pause to be a timedelta"):
        retention.purge(actor="cron", pause=pause)
    assert not PurgeRun.objects.exists() and Operation.objects.count() == 1
    with pytest.raises(CommandError, match="expected --pause-ms of 0 or more, found -5"):
        call_command("purge", "--pause-ms", "-5")


def test_a_slow_batch_halves_the_next_and_quick_ones_grow_it_back_to_the_most_asked():
    sizer = retention.BatchSizer(250, timedelta(milliseconds=50))
    sizes = []
    for seconds in [0.020, 0.060, 0.060, 0.040, 0.200, 0.200, 0.200, 0.200, 0.010, 0.010]:
        sizer.took(seconds)
        sizes.append(sizer.size)
    # 20 ms: under half the target, already the most; 60 ms: halved twice; 40 ms: kept;
    # 200 ms: halved down to MIN_BATCH (10) and no lower; 10 ms: a quarter more each time
    assert sizes == [250, 125, 62, 62, 31, 15, 10, 10, 12, 15]
    for _ in range(30):
        sizer.took(0.001)
    assert sizer.size == 250
    small = retention.BatchSizer(4, timedelta(milliseconds=50))
    small.took(1.0)
    assert small.size == 4  # a batch asked for below MIN_BATCH is not shrunk further


@pytest.mark.django_db
def test_batches_that_take_longer_than_the_target_make_the_next_ones_smaller(thirty_days):
    ops = [aged(State.SUCCEEDED, 40) for _ in range(35)]
    # Every real batch takes longer than a microsecond: 20, then 10 (MIN_BATCH), then 10.
    result = retention.purge(actor="test", batch=20, batch_target=timedelta(microseconds=1))
    assert result.batch_sizes == [20, 10, 10]
    assert sorted(result.purged_operation_ids) == sorted(o.operation_id for o in ops)
    assert not Operation.objects.exists()
    # the run records the most asked for
    assert PurgeRun.objects.get(state_policy=None).batch_size == 20


@pytest.mark.django_db
@pytest.mark.parametrize("target", [timedelta(0), timedelta(seconds=-1), timedelta(minutes=2),
                                    0.05])
def test_a_batch_target_out_of_range_is_refused_before_anything_is_written(thirty_days, target):
    aged(State.REJECTED, 40)
    with pytest.raises(InvalidInput, match="expected batch_target to be a (positive )?timedelta"):
        retention.purge(actor="cron", batch_target=target)
    assert not PurgeRun.objects.exists() and Operation.objects.count() == 1
    with pytest.raises(CommandError, match="expected --batch-target-ms of 1 or more, found 0"):
        call_command("purge", "--batch-target-ms", "0")
    assert Operation.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("option", ["--pause-ms", "--batch-target-ms"])
def test_a_duration_too_large_for_a_timedelta_is_refused_with_the_limit(thirty_days, option):
    aged(State.REJECTED, 40)
    with pytest.raises(CommandError, match=f"expected {option} of 60000 or less, found "
                                           f"{10**20}"):
        call_command("purge", option, str(10**20))
    assert not PurgeRun.objects.exists() and Operation.objects.count() == 1


@pytest.mark.django_db
def test_bad_batch_size_is_refused(thirty_days):
    with pytest.raises(CommandError, match="expected batch to be from 1 to 10000"):
        call_command("purge", "--batch", "0")
    assert not PurgeRun.objects.exists()


@pytest.mark.django_db
def test_an_interrupted_purge_keeps_its_finished_batches_and_a_rerun_completes(thirty_days):
    ops = [aged(State.SUCCEEDED, 40) for _ in range(5)]

    def interrupt_after_first_batch(message):
        if "so far" in message:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        retention.purge(actor="test", batch=2, progress=interrupt_after_first_batch)
    interrupted = PurgeRun.objects.get(state_policy=None)
    assert (interrupted.operations_purged, interrupted.finished_at) == (2, None)
    assert Operation.objects.count() == 3

    retention.purge(actor="test", batch=2)
    assert not Operation.objects.filter(pk__in=[o.pk for o in ops]).exists()
    assert PurgeRun.objects.filter(state_policy=None).latest("id").operations_purged == 3
    assert chain.verify(actor="test").is_intact


@pytest.mark.django_db(transaction=True)
def test_purge_skips_a_row_another_transaction_holds_and_takes_it_on_the_next_run():
    user = retention_admin()
    retention.set_policy("*", purge_after_days=30, user=user)
    held, free = aged(State.SUCCEEDED, 40), aged(State.SUCCEEDED, 40)
    with raw_connection() as other:
        with other.transaction():
            other.execute("SELECT 1 FROM ledger_operation WHERE id = %s FOR UPDATE", [held.pk])
            assert retention.purge(actor="test").purged_operation_ids == [free.operation_id]
    assert retention.purge(actor="test").purged_operation_ids == [held.operation_id]


@pytest.mark.django_db(transaction=True)
def test_each_batch_starts_after_the_last_one_picked_and_what_it_passed_waits_for_next_run():
    user = retention_admin()
    retention.set_policy("*", purge_after_days=30, user=user)
    ops = [aged(State.SUCCEEDED, 50 - i) for i in range(6)]  # oldest first
    picks = []
    with connection.execute_wrapper(
            lambda execute, sql, params, many, context: (
                picks.append(params) if "FOR UPDATE SKIP LOCKED" in sql else None,
                execute(sql, params, many, context))[1]):
        with raw_connection() as other:
            with other.transaction():  # the oldest is locked while the first batch runs
                other.execute("SELECT 1 FROM ledger_operation WHERE id = %s FOR UPDATE",
                              [ops[0].pk])
                purged = retention.purge(actor="test", batch=2).purged_operation_ids
    # in batches of 2, 2, 1 (identifiers of one second sort by their random tail)
    assert sorted(purged) == sorted(o.operation_id for o in ops[1:])
    # the first pick starts from the oldest; each later one after the last row picked
    assert len(picks) == 4 and ops[2].pk in picks[1] and ops[4].pk in picks[2]
    assert ops[0].pk not in [p for params in picks for p in params]
    assert retention.purge(actor="test").purged_operation_ids == [ops[0].operation_id]


@pytest.mark.django_db(transaction=True)
def test_what_agents_commit_during_a_purge_is_sealed_before_the_next_batch(thirty_days):
    ops = [aged(State.SUCCEEDED, 40) for _ in range(4)]
    written = []

    def agent_writes_after_each_batch(message):
        if "so far" in message:
            written.append(receipts.record_intent(
                "email.send", "smtp://mail.example", {"n": len(written)},
                idempotency_key=f"during-purge-{len(written)}"))

    result = retention.purge(actor="test", batch=2, progress=agent_writes_after_each_batch)
    assert sorted(result.purged_operation_ids) == sorted(o.operation_id for o in ops)
    assert len(result.batch_seconds) == 2 and all(s > 0 for s in result.batch_seconds)
    # each write was sealed before the purge looked for its next batch (the purge's own
    # seal at its start ran before both)
    events = OperationEvent.objects.filter(operation__in=written)
    assert events.count() == 2 and not events.filter(chain_seq=None).exists()
    assert chain.verify(actor="test").is_intact


def _watch_sanctioned_functions(seen):
    """An execute wrapper noting each purge or redact function call with the
    synchronous_commit of its transaction."""
    def watch(execute, sql, params, many, context):
        if sql.startswith("SELECT ledger_retention_"):
            with context["connection"].cursor() as cursor:
                cursor.execute("SELECT current_setting('synchronous_commit')")
                seen.append((sql.split("(")[0].removeprefix("SELECT "), cursor.fetchone()[0]))
        return execute(sql, params, many, context)
    return watch


@pytest.mark.django_db(transaction=True)
def test_purge_batches_do_not_wait_for_the_wal_flush_but_the_purge_returns_durable():
    retention.set_policy("*", purge_after_days=30, redact_after_days=None,
                         user=retention_admin())
    for _ in range(3):
        aged(State.SUCCEEDED, 40)
    seen, written = [], []

    def after_batch(message):  # where the WAL ends after each batch's commit
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_wal_insert_lsn()")
            written.append(cursor.fetchone()[0])

    with connection.execute_wrapper(_watch_sanctioned_functions(seen)):
        result = retention.purge(actor="test", batch=2, progress=after_batch)
    assert len(result.purged_operation_ids) == 3
    assert seen == [("ledger_retention_purge", "off")] * 2
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('synchronous_commit'), "
                       "pg_current_wal_flush_lsn() >= %s::pg_lsn", [written[-2]])
        # the setting ended with each batch's transaction, and the last batch was on disk
        # when the purge returned (the run's synchronous finish flushed the WAL before it)
        assert cursor.fetchone() == ("on", True)


@pytest.mark.django_db(transaction=True)
def test_a_redaction_batch_still_waits_for_the_wal_flush():
    retention.set_policy("*", purge_after_days=30, redact_after_days=10, user=retention_admin())
    aged(State.SUCCEEDED, 40)
    aged(State.SUCCEEDED, 20)
    seen = []
    with connection.execute_wrapper(_watch_sanctioned_functions(seen)):
        result = retention.purge(actor="test")
    assert len(result.purged_operation_ids) == len(result.redacted_operation_ids) == 1
    assert seen == [("ledger_retention_purge", "off"), ("ledger_retention_redact", "on")]


@pytest.mark.django_db
def test_the_purge_command_reports_its_batches_and_the_longest(thirty_days, capsys):
    for _ in range(3):
        aged(State.SUCCEEDED, 40)
    call_command("purge", "--batch", "2", actor="cron")
    assert "purged 3 operations, redacted 0, in 1 policies; 2 batches of 2-2, the longest " in (
        capsys.readouterr().out)


@pytest.mark.django_db(transaction=True)
def test_a_row_being_corrected_during_the_purge_is_skipped_and_then_no_longer_old_enough():
    """The rule is evaluated on the row as it is when the purge takes it, not as counted."""
    user = retention_admin()
    retention.set_policy("*", purge_after_days=30, user=user)
    op = aged(State.SUCCEEDED, 40)
    other = raw_connection()
    other.execute("BEGIN")
    # A settled receipt is frozen: the correction is a superuser's, with the triggers off.
    other.execute("SET LOCAL session_replication_role = replica")
    other.execute("UPDATE ledger_operation SET completed_at = now() WHERE id = %s", [op.pk])
    # The purge's batch query skips the locked row now; once the correction commits, the
    # same row is no longer old enough.
    first = retention.purge(actor="test")
    other.execute("COMMIT")
    other.close()
    second = retention.purge(actor="test")
    assert first.purged_operation_ids == second.purged_operation_ids == []
    assert Operation.objects.filter(pk=op.pk).exists()


# --- the property: never a non-terminal operation, always every eligible one ------------

NAMES = ["articles.create", "articles.update", "mail.send", "mail_x.send", "mailyx.send"]
PATTERNS = ["*", "articles.*", "articles.create", "*.send", "mail.*", "mail_x.*", "m?il*"]
TENANTS = ["default", "acme"]

operations = st.lists(
    st.tuples(st.sampled_from(list(State)), st.sampled_from(NAMES), st.sampled_from(TENANTS),
              st.integers(min_value=0, max_value=60)),
    min_size=1, max_size=10,
)
policies = st.dictionaries(
    st.tuples(st.sampled_from(PATTERNS), st.sampled_from(["", *TENANTS])),
    st.tuples(st.integers(1, 40), st.integers(1, 40)),  # purge days, keep-events days
    max_size=4,
)

# Each example starts from an empty ledger; its verifications go too, or the heads they
# recorded would rightly make the next example's fresh chains look rewritten.
RESET = ("TRUNCATE ledger_operation, ledger_operationevent, ledger_evidence, ledger_chainhead, "
         "ledger_chainanchor, ledger_redaction, ledger_purgerun, ledger_retentionpolicy, "
         "ledger_retentionchange, ledger_auditverification, ledger_approval, "
         "ledger_approvalrequest, ledger_claim, ledger_operationnote, "
         "ledger_resolutionproposal, ledger_notificationsent")


@pytest.mark.django_db(transaction=True)
@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=operations, rules=policies, with_default=st.booleans())
def test_purge_never_removes_a_non_terminal_operation_and_removes_every_eligible_one(
    ops, rules, with_default
):
    with connection.cursor() as cursor:
        cursor.execute(RESET)
    user = retention_admin()
    if with_default:
        rules = {("*", ""): (365, 365), **rules}
    for (pattern, tenant), (purge_days, keep_days) in rules.items():
        retention.set_policy(pattern, tenant=tenant, purge_after_days=purge_days,
                             keep_events_days=keep_days, user=user)
    now = timezone.now()
    made = []
    for state, name, tenant, days in ops:
        op = OperationFactory(state=state, operation=name, tenant=tenant)
        complete_days_ago(op, days + 0.5, now=now)  # also sets it on non-terminal ones
        made.append(op)

    ordered = retention.policies_by_specificity()
    expected = set()
    for op in made:
        governing = retention.resolve_policy(op.operation, op.tenant, ordered)
        if (governing is not None and op.state in TERMINAL
                and op.completed_at < now - timedelta(days=governing.purge_horizon_days)):
            expected.add(op.operation_id)
    previewed = sum(p.operations for p in retention_reads.preview(now=now))

    result = retention.purge(actor="property", batch=3, now=now)

    remaining = set(Operation.objects.values_list("operation_id", flat=True))
    assert set(result.purged_operation_ids) == expected
    assert remaining == {op.operation_id for op in made} - expected
    assert all(op.operation_id in remaining for op in made if op.state not in TERMINAL)
    assert previewed == len(expected)
    assert chain.verify(actor="property").is_intact


# --- purging while agents and reviewers work ----------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_purge_under_load_removes_only_what_was_eligible_when_deleted_and_loses_nothing():
    user = retention_admin()
    retention.set_policy("*", purge_after_days=10, user=user)
    old_done = [aged(state, 20) for state in sorted(TERMINAL) for _ in range(6)]
    to_resolve = [aged(State.OUTCOME_UNKNOWN, 20) for _ in range(6)]
    to_touch = old_done[::4]
    created, touched, purged, errors = [], [], [], []
    stop = threading.Event()

    def worker(body):
        def run():
            try:
                body()
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)
            finally:
                connections.close_all()
        return threading.Thread(target=run)

    def agent(n):
        for i in range(8):
            op = receipts.record_intent("articles.create", "t", {"agent": n, "i": i})
            created.append(op.operation_id)
            with receipts.submit(op):
                pass

    def reviewer():
        for op in to_resolve:
            receipts.resolve(op, State.ABANDONED, user=user, reason="gave up")

    def corrector():
        # A late correction: the operation finished later than recorded, so it is young.
        # A settled receipt is frozen: the correction is a superuser's, with the triggers off.
        with connection.cursor() as cursor:
            cursor.execute("SET session_replication_role = replica")
            for op in to_touch:
                cursor.execute("UPDATE ledger_operation SET completed_at = now() "
                               "WHERE id = %s", [op.pk])
                if cursor.rowcount:
                    touched.append(op.operation_id)

    def purger():
        while not stop.is_set():
            purged.extend(retention.purge(actor="load", batch=2).purged_operation_ids)

    threads = [worker(lambda n=n: agent(n)) for n in range(2)]
    threads += [worker(reviewer), worker(corrector)]
    purge_thread = worker(purger)
    purge_thread.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    purge_thread.join()
    purged.extend(retention.purge(actor="final").purged_operation_ids)

    assert errors == []
    old_ids = {op.operation_id for op in old_done}
    assert set(purged) <= old_ids and len(purged) == len(set(purged))
    assert set(purged) == old_ids - set(touched)
    remaining = set(Operation.objects.values_list("operation_id", flat=True))
    everything = old_ids | {op.operation_id for op in to_resolve} | set(created)
    assert remaining == everything - set(purged)
    assert Operation.objects.filter(operation_id__in=[o.operation_id for o in to_resolve],
                                    state=State.ABANDONED).count() == len(to_resolve)
    for op in Operation.objects.all():
        versions = list(OperationEvent.objects.filter(operation=op)
                        .values_list("version", flat=True).order_by("version"))
        assert versions == list(range(1, op.version + 1)), op.operation_id
    # The chain is intact; the superuser's correction, without an event, is what verification
    # reports (the chain covers completed_at), operation by operation, and nothing else.
    result = chain.verify(actor="load")
    assert {(found.ids["operation_id"], found.message) for found in result.differing} == {
        (ref, "the operation row differs from its last event in completed_at: it was changed "
              "out of band") for ref in touched}, result.first_break


@pytest.mark.django_db
def test_purge_keeps_operations_of_a_run_with_an_open_obligation_or_fact_conflict(thirty_days):
    from ledger import facts, obligations, runs

    pending, disputed, done = (runs.start(f"run {name}") for name in ("a", "b", "c"))
    with_obligation = aged(State.SUCCEEDED, 31, run=pending)
    with_conflict = aged(State.SUCCEEDED, 31, run=disputed)
    free = aged(State.SUCCEEDED, 31, run=done)
    obligations.open(pending, "invoice.send", "open-obligation-key")
    facts.assert_fact("order-1", "status", "paid", source="agent", run=disputed)
    facts.assert_fact("order-1", "status", "refunded", source="agent", run=disputed)
    obligations.open(done, "invoice.send", "done-obligation-key")
    obligations.commit("done-obligation-key", {"sent": True})

    call_command("purge", actor="cron")

    kept = set(Operation.objects.values_list("pk", flat=True))
    assert {with_obligation.pk, with_conflict.pk} <= kept
    assert free.pk not in kept

    obligations.commit("open-obligation-key", {"sent": True})
    call_command("purge", actor="cron")
    assert not Operation.objects.filter(pk=with_obligation.pk).exists()
    assert Operation.objects.filter(pk=with_conflict.pk).exists()
