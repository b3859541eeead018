"""`record_intent(submit=True)`: a new intent and its submission in one transaction, one
commit (the decorator's default), every rule of the two kept: the replay, the call in
flight, the approval gate, the fence, the event of each move. One transaction is read from
PostgreSQL itself: the operation's row and both its events carry the same xmin."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection

from ledger import approvals, receipts, runs
from ledger.errors import ApprovalRequired, InFlight, InvalidInput, StaleFencingToken
from ledger.models import Operation, OperationEvent
from ledger.states import State
from tests.ledger.test_fence import take_over

INTENT = {"title": "Quarterly report", "body": "numbers"}


def transactions(op) -> list[tuple[int, str, int]]:
    """(version, to_state, xmin) of each event of `op`, in order; xmin is the writing
    transaction's id."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT version, to_state, xmin::text::bigint FROM ledger_operationevent "
                       "WHERE operation_id = %s ORDER BY version", [op.pk])
        return cursor.fetchall()


@pytest.mark.django_db(transaction=True)
def test_a_new_intent_and_its_submission_are_one_transaction():
    op = receipts.record_intent("articles.create", "https://cms.example", INTENT,
                                idempotency_key="k-1", submit=True,
                                in_flight_for=timedelta(seconds=30))
    assert (op.state, op.version, op.recorded_now, op.submitted_now) == (
        State.SUBMITTED, 2, True, True)
    events = transactions(op)
    assert [(v, s) for v, s, _ in events] == [(1, State.PLANNED), (2, State.SUBMITTED)]
    assert events[0][2] == events[1][2]  # one transaction wrote both
    stored = Operation.objects.get(pk=op.pk)
    assert stored.state == State.SUBMITTED
    assert stored.in_flight_until - stored.submitted_at == timedelta(seconds=30)
    # apart, as before: two transactions
    apart = receipts.record_intent("articles.create", "https://cms.example", INTENT,
                                   idempotency_key="k-2")
    receipts.mark_submitted(apart)
    first, second = transactions(apart)
    assert first[2] != second[2]


@pytest.mark.django_db(transaction=True)
def test_a_replay_of_a_submitted_key_is_not_submitted_again():
    op = receipts.record_intent("articles.create", "https://cms.example", INTENT,
                                idempotency_key="k-1", submit=True)
    again = receipts.record_intent("articles.create", "https://cms.example", INTENT,
                                   idempotency_key="k-1", submit=True)
    assert (again.pk, again.state, again.recorded_now, again.submitted_now) == (
        op.pk, State.SUBMITTED, False, False)
    assert OperationEvent.objects.filter(operation_id=op.pk).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_found_planned_intent_is_submitted_by_the_call():
    planned = receipts.record_intent("articles.create", "https://cms.example", INTENT,
                                     idempotency_key="k-1")
    op = receipts.record_intent("articles.create", "https://cms.example", INTENT,
                                idempotency_key="k-1", submit=True)
    assert (op.pk, op.state, op.recorded_now, op.submitted_now) == (
        planned.pk, State.SUBMITTED, False, True)


@pytest.mark.django_db(transaction=True)
def test_an_approval_policy_blocks_the_submission_and_the_intent_stays_recorded(admin_user):
    approvals.set_policy("payments.*", user=admin_user)
    with pytest.raises(ApprovalRequired, match="found 0") as refused:
        receipts.record_intent("payments.send", "https://pay.example", {"amount": 100},
                               idempotency_key="pay-1", submit=True)
    op = Operation.objects.get(idempotency_key="pay-1")
    assert (op.state, op.version) == (State.PLANNED, 1)
    assert [s for _, s, _ in transactions(op)] == [State.PLANNED]
    assert refused.value.recorded_operation.pk == op.pk


@pytest.mark.django_db(transaction=True)
def test_a_stale_fencing_token_blocks_the_submission_and_the_intent_stays_recorded():
    run = runs.start("Ship order 17", run_id="run-17")
    runs.add_step(run, "charge")
    old, new = take_over(run)
    for token in (None, old):
        with pytest.raises(StaleFencingToken, match=f"current token {new}|found none"):
            receipts.record_intent("charges.create", "https://pay.example", INTENT, run=run,
                                   step="charge", submit=True, fencing_token=token)
    op = Operation.objects.get()
    assert (op.state, op.version) == (State.PLANNED, 1)
    done = receipts.record_intent("charges.create", "https://pay.example", INTENT, run=run,
                                  step="charge", submit=True, fencing_token=new)
    assert (done.pk, done.state, done.submitted_now) == (op.pk, State.SUBMITTED, True)
    assert list(done.events.filter(version=2).values_list("fencing_token", flat=True)) == [new]


@pytest.mark.django_db
def test_submission_arguments_without_submit_are_refused_before_anything_is_written():
    with pytest.raises(InvalidInput, match="only with submit=True"):
        receipts.record_intent("articles.create", "https://cms.example", INTENT,
                               fencing_token=3)
    with pytest.raises(InvalidInput, match="in_flight_for"):
        receipts.record_intent("articles.create", "https://cms.example", INTENT, submit=True,
                               in_flight_for=timedelta(days=30))
    assert not Operation.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_decorator_records_and_submits_in_one_transaction_by_default():
    sent = []

    @receipts.action("articles.create", target="https://cms.example",
                     key=lambda title: f"article-{title}")
    def publish(title):
        sent.append(title)
        return {"id": f"cms-{title}"}

    @receipts.action("articles.create", target="https://cms.example", submit=False,
                     key=lambda title: f"article-{title}")
    def publish_apart(title):
        sent.append(title)
        return {"id": f"cms-{title}"}

    assert publish("a") == {"id": "cms-a"}
    assert publish_apart("b") == {"id": "cms-b"}
    one, apart = (Operation.objects.get(idempotency_key=f"article-{t}") for t in "ab")
    assert [s for _, s, _ in transactions(one)] == [State.PLANNED, State.SUBMITTED,
                                                    State.SUCCEEDED]
    planned, submitted, succeeded = transactions(one)
    assert planned[2] == submitted[2] != succeeded[2]
    planned, submitted, succeeded = transactions(apart)
    assert len({planned[2], submitted[2], succeeded[2]}) == 3
    # the same key again: the stored result, not sent again
    assert publish("a") == {"id": "cms-a"} and sent == ["a", "b"]


@pytest.mark.django_db(transaction=True)
def test_the_decorator_never_sends_a_call_in_flight():
    @receipts.action("articles.create", target="https://cms.example",
                     key=lambda title: f"article-{title}")
    def publish(title):
        raise AssertionError("expected no send of a call in flight")

    receipts.record_intent("articles.create", "https://cms.example", {"title": "a"},
                           idempotency_key="article-a", submit=True)
    with pytest.raises(InFlight):
        publish("a")


@pytest.mark.django_db(transaction=True)
def test_of_two_callers_racing_on_a_new_key_one_submits_it():
    import threading

    barrier = threading.Barrier(4)
    found = []

    def caller():
        from django.db import connection as own

        try:
            barrier.wait(timeout=30)
            op = receipts.record_intent("articles.create", "https://cms.example", INTENT,
                                        idempotency_key="race-1", submit=True)
            found.append((op.pk, op.state, op.submitted_now))
        finally:
            own.close()

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(found) == 4
    assert len({pk for pk, _, _ in found}) == 1
    assert {state for _, state, _ in found} == {State.SUBMITTED}
    assert sorted(now for _, _, now in found) == [False, False, False, True]
    op = Operation.objects.get(idempotency_key="race-1")
    assert [s for _, s, _ in transactions(op)] == [State.PLANNED, State.SUBMITTED]
