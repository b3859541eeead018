"""Obligations: idempotent open, exactly-once commit under races, cancel, overdue."""

from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from ledger import leases, obligations, runs
from ledger.canonical import REDACTED
from ledger.errors import (
    AlreadyCommitted,
    IdempotencyKeyReused,
    IllegalTransition,
    InvalidInput,
    StaleFencingToken,
)
from ledger.models import Obligation, ObligationState
from tests.support.concurrency import join, run_threads


@pytest.fixture
def run(db):
    return runs.start("Publish the quarterly report", run_id="run-obl")


@pytest.mark.django_db
def test_open_is_idempotent_on_the_key(run):
    first = obligations.open(run, "email.send", "send-report-email")
    again = obligations.open("run-obl", "email.send", "send-report-email",
                             deadline=timezone.now())
    assert first.pk == again.pk
    assert (again.state, again.deadline, again.tenant) == ("open", None, "default")
    assert Obligation.objects.count() == 1


@pytest.mark.django_db
def test_the_same_key_for_another_kind_or_run_is_refused(run):
    obligations.open(run, "email.send", "k-1")
    other = runs.start("Another task", run_id="run-other")
    with pytest.raises(IdempotencyKeyReused, match="found it naming email.send of run run-obl"):
        obligations.open(other, "email.send", "k-1")
    with pytest.raises(IdempotencyKeyReused):
        obligations.open(run, "sms.send", "k-1")
    assert Obligation.objects.count() == 1


@pytest.mark.django_db
def test_commit_records_the_result_once(run):
    obligations.open(run, "email.send", "k-1")
    committed = obligations.commit("k-1", {"message_id": "m-1"})
    assert (committed.state, committed.result) == ("committed", {"message_id": "m-1"})
    assert committed.committed_at is not None
    with pytest.raises(AlreadyCommitted, match="found it committed at") as info:
        obligations.commit("k-1", {"message_id": "m-2"})
    assert info.value.result == {"message_id": "m-1"}
    assert info.value.obligation.pk == committed.pk
    assert Obligation.objects.get().result == {"message_id": "m-1"}


@pytest.mark.django_db
def test_committing_the_same_result_again_still_says_it_was_already_committed(run):
    obligations.open(run, "email.send", "k-1")
    obligations.commit("k-1", "ok")
    with pytest.raises(AlreadyCommitted) as info:
        obligations.commit("k-1", "ok")
    assert info.value.result == "ok"


@pytest.mark.django_db(transaction=True)
def test_sixteen_threads_commit_the_same_obligation_one_wins_and_every_loser_sees_its_result():
    run = runs.start("Race", run_id="run-race")
    obligations.open(run, "payment.capture", "capture-order-17")
    threads, results, errors = run_threads(
        16, lambda i: obligations.commit("capture-order-17", {"captured_by": f"worker-{i}"})
    )
    join(threads)
    assert len(results) == 1, errors
    winner = results[0].result
    assert len(errors) == 15
    assert all(isinstance(e, AlreadyCommitted) and e.result == winner for e in errors)
    stored = Obligation.objects.get(key="capture-order-17")
    assert (stored.state, stored.result) == ("committed", winner)


@pytest.mark.django_db(transaction=True)
def test_sixteen_threads_opening_the_same_key_make_one_obligation():
    run = runs.start("Race", run_id="run-race")
    threads, results, errors = run_threads(
        16, lambda i: obligations.open(run, "email.send", "only-once").pk
    )
    join(threads)
    assert errors == [] and len(set(results)) == 1
    assert Obligation.objects.count() == 1


@pytest.mark.django_db
def test_cancel_settles_an_open_obligation_and_is_idempotent(run):
    obligations.open(run, "email.send", "k-1")
    cancelled = obligations.cancel("k-1", reason="the customer unsubscribed")
    assert (cancelled.state, cancelled.cancel_reason) == ("cancelled", "the customer unsubscribed")
    assert obligations.cancel("k-1", reason="again").cancel_reason == "the customer unsubscribed"
    with pytest.raises(IllegalTransition, match="found it cancelled"):
        obligations.commit("k-1", "sent anyway")


@pytest.mark.django_db
def test_a_committed_obligation_cannot_be_cancelled(run):
    obligations.open(run, "email.send", "k-1")
    obligations.commit("k-1", "sent")
    with pytest.raises(AlreadyCommitted) as info:
        obligations.cancel("k-1", reason="too late")
    assert info.value.result == "sent"


@pytest.mark.django_db
def test_committing_an_unknown_key_is_refused(run):
    with pytest.raises(InvalidInput, match="expected an open obligation with key 'nope'"):
        obligations.commit("nope", 1)


@pytest.mark.django_db
def test_secrets_in_a_result_never_reach_the_database(run):
    obligations.open(run, "api.call", "k-1")
    obligations.commit("k-1", {"id": 7, "api_key": "sk-live-1"})
    assert Obligation.objects.get().result == {"id": 7, "api_key": REDACTED}


@pytest.mark.django_db
def test_overdue_lists_open_obligations_past_their_deadline(run):
    now = timezone.now()
    obligations.open(run, "email.send", "late", deadline=now - timedelta(hours=2))
    obligations.open(run, "email.send", "later", deadline=now - timedelta(minutes=5))
    obligations.open(run, "email.send", "in-time", deadline=now + timedelta(hours=1))
    obligations.open(run, "email.send", "no-deadline")
    obligations.open(run, "email.send", "done", deadline=now - timedelta(hours=3))
    obligations.commit("done", "sent")
    acme = runs.start("Other tenant", tenant="acme", run_id="run-acme")
    obligations.open(acme, "email.send", "acme-late", deadline=now - timedelta(hours=1))
    assert [o.key for o in obligations.overdue(tenants={"default"})] == ["late", "later"]
    assert [o.key for o in obligations.overdue()] == ["late", "acme-late", "later"]
    assert [o.key for o in Obligation.objects.overdue(now=now - timedelta(hours=1, minutes=30))
            ] == ["late"]


@pytest.mark.django_db
def test_a_stale_fencing_token_cannot_commit(run):
    old = leases.acquire(run.lease_resource, "worker-a", timedelta(seconds=1))
    obligations.open(run, "email.send", "k-1", fencing_token=old)
    runs.resume(run.run_id, worker="worker-a")  # a newer token, held by the same worker
    with pytest.raises(StaleFencingToken):
        obligations.commit("k-1", "late write", fencing_token=old)
    assert Obligation.objects.get().state == ObligationState.OPEN


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": ""}, "expected kind to be a non-empty string"),
        ({"key": " "}, "expected key to be a non-empty string"),
        ({"deadline": "tomorrow"}, "expected deadline to be a timezone-aware datetime"),
        ({"run": "no-such-run"}, "expected run 'no-such-run' to exist"),
    ],
)
def test_bad_input_gets_a_clear_error_and_writes_nothing(run, kwargs, message):
    args = {"run": run, "kind": "email.send", "key": "k-1"}
    args.update(kwargs)
    with pytest.raises(InvalidInput, match=message):
        obligations.open(args.pop("run"), args.pop("kind"), args.pop("key"), **args)
    assert Obligation.objects.count() == 0


@pytest.mark.django_db
def test_a_result_that_is_not_json_is_refused(run):
    obligations.open(run, "email.send", "k-1")
    with pytest.raises(InvalidInput, match="expected result to hold only JSON values"):
        obligations.commit("k-1", object())
    assert Obligation.objects.get().state == "open"


def raw(sql, params=()):
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)


@pytest.mark.django_db
@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE ledger_obligation SET result = '\"forged\"' WHERE key = %s",
        "UPDATE ledger_obligation SET state = 'open', committed_at = NULL WHERE key = %s",
        "UPDATE ledger_obligation SET deadline = now() WHERE key = %s",
        "DELETE FROM ledger_obligation WHERE key = %s",
    ],
)
def test_a_committed_obligation_never_changes_even_by_a_raw_query(run, sql):
    obligations.open(run, "email.send", "k-1")
    obligations.commit("k-1", "sent")
    with pytest.raises(IntegrityError, match="expected"):
        raw(sql, ["k-1"])
    stored = Obligation.objects.get()
    assert (stored.state, stored.result) == ("committed", "sent")


@pytest.mark.django_db
def test_an_open_obligation_keeps_its_key_and_run_even_by_a_raw_query(run):
    obligations.open(run, "email.send", "k-1")
    with pytest.raises(IntegrityError, match="expected its key, run, kind"):
        raw("UPDATE ledger_obligation SET key = 'k-2' WHERE key = 'k-1'")
    with pytest.raises(IntegrityError, match="obligation_commit_time_recorded"):
        raw("UPDATE ledger_obligation SET state = 'committed' WHERE key = 'k-1'")
