"""The one writer of operation changes: who may make which move, and one statement each."""

import itertools
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from ledger import chain, leases, receipts, states, transitions
from ledger.errors import IllegalTransition, StaleFencingToken, StaleVersion
from ledger.models import ChainHead, Operation, OperationEvent
from ledger.states import ActorKind, State
from tests.factories import OperationFactory, RunFactory

ALL_PAIRS = list(itertools.product(State.values, State.values))
LEGAL = [(a, b) for a, b in ALL_PAIRS if states.is_legal(a, b)]
ILLEGAL = [(a, b) for a, b in ALL_PAIRS if not states.is_legal(a, b) and a != b]


def immediate_constraints():
    """Deferred triggers fire at commit; a test transaction never commits, so fire them now."""
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")


def writes(queries) -> list[str]:
    """The statements of a capture, without the savepoints of the test's transaction."""
    return [q["sql"] for q in queries
            if not q["sql"].startswith(("SAVEPOINT", "RELEASE SAVEPOINT"))]


def chain_seq(tenant="default") -> int:
    head = ChainHead.objects.filter(chain=chain.OPERATION_EVENTS.name, tenant=tenant).first()
    return 0 if head is None else head.seq


@pytest.mark.django_db
@pytest.mark.parametrize(("from_state", "to_state"), LEGAL)
def test_every_legal_transition_is_accepted_and_evented(from_state, to_state, reviewer):
    op = OperationFactory(state=from_state)
    version = op.version
    # A human-only move is accepted from a person only (the next test).
    by = ({"actor_kind": ActorKind.HUMAN, "decided_by": reviewer.pk}
          if states.is_human_only(from_state, to_state) else {"actor_kind": ActorKind.SYSTEM})
    with transaction.atomic():
        transitions._apply(op, to_state, reason="test", **by)
    immediate_constraints()
    op.refresh_from_db()
    assert (op.state, op.version) == (to_state, version + 1)
    event = OperationEvent.objects.get(operation=op, version=version + 1)
    assert (event.from_state, event.to_state) == (from_state, to_state)


@pytest.mark.django_db
@pytest.mark.parametrize(("from_state", "to_state"), ILLEGAL)
def test_every_illegal_transition_is_refused_by_the_api(from_state, to_state):
    op = OperationFactory(state=from_state)
    events_before = OperationEvent.objects.filter(operation=op).count()
    with pytest.raises(IllegalTransition, match=f"found {from_state} -> {to_state}"):
        transitions._apply(op, to_state, actor_kind=ActorKind.SYSTEM)
    op.refresh_from_db()
    assert op.state == from_state
    assert OperationEvent.objects.filter(operation=op).count() == events_before


@pytest.mark.django_db
@pytest.mark.parametrize(("from_state", "to_state"), sorted(states.HUMAN_ONLY))
def test_an_agent_cannot_make_a_human_decision(from_state, to_state):
    op = OperationFactory(state=from_state)
    with pytest.raises(IllegalTransition,
                       match="expected a person .* found an agent trying to"):
        transitions.by_agent(op, to_state, reason="not mine to decide")
    assert Operation.objects.get(pk=op.pk).state == from_state


@pytest.mark.django_db
@pytest.mark.parametrize(("from_state", "to_state"), sorted(states.HUMAN_ONLY))
def test_a_reconciler_cannot_make_a_human_decision(from_state, to_state):
    op = OperationFactory(state=from_state)
    with pytest.raises(IllegalTransition,
                       match="expected a person .* found reconciler worker-1 trying to"):
        transitions.by_reconciler(op, to_state, worker="worker-1", token=1,
                                  resource=f"reconcile:{op.operation_id}", reason="no")
    assert Operation.objects.get(pk=op.pk).state == from_state


@pytest.mark.django_db
@pytest.mark.parametrize(("from_state", "to_state"),
                         [pair for pair in LEGAL if pair not in states.HUMAN_ONLY])
def test_a_person_makes_only_human_decisions(from_state, to_state, reviewer):
    op = OperationFactory(state=from_state)
    with pytest.raises(IllegalTransition, match=f"found {from_state} -> {to_state}"):
        transitions.by_person(op, to_state, user=reviewer, reason="not a decision")
    assert Operation.objects.get(pk=op.pk).state == from_state


@pytest.mark.django_db
def test_a_decision_names_the_person_on_its_event(reviewer):
    op = OperationFactory(state=State.MANUAL_REVIEW)
    transitions.by_person(op, State.ABANDONED, user=reviewer, reason="never sent")
    event = OperationEvent.objects.get(operation=op, version=op.version)
    assert (event.actor_kind, event.actor_id, event.reason) == (
        ActorKind.HUMAN, "reviewer", "never sent")


@pytest.mark.django_db
def test_a_change_is_one_statement_of_row_and_event_which_the_sealer_links():
    op = OperationFactory(state=State.PLANNED)
    chain.seal()
    seq = chain_seq()
    with CaptureQueriesContext(connection) as queries:
        receipts.mark_submitted(op)
    assert len(writes(queries)) == 1
    assert "WITH changed AS (UPDATE ledger_operation" in writes(queries)[0]
    event = OperationEvent.objects.get(operation=op, version=2)
    # Written unsealed: the tenant's chain head is not touched on the write path.
    assert (event.chain_seq, event.chain_hash, chain_seq()) == (None, None, seq)
    assert chain.seal() == 1
    event.refresh_from_db()
    assert (event.chain_seq, chain_seq()) == (seq + 1, seq + 1)


@pytest.mark.django_db
def test_a_new_receipt_is_one_statement_of_row_event_and_link():
    with CaptureQueriesContext(connection) as queries:
        op = receipts.record_intent("articles.create", "t", {"title": "x"},
                                    idempotency_key="k-one-statement")
    inserts = [sql for sql in writes(queries) if "INSERT INTO ledger_operation" in sql]
    assert len(inserts) == 1
    assert "WITH changed AS (INSERT INTO ledger_operation" in inserts[0]
    assert list(op.events.values_list("version", "to_state")) == [(1, State.PLANNED)]


def test_the_change_statement_shows_its_three_parts_in_order():
    sql = transitions.CHANGE_OPERATION
    parts = [sql.index(name) for name in
             ("WITH changed AS (UPDATE", "duplicates AS (UPDATE", "event AS (INSERT")]
    assert parts == sorted(parts)
    assert sql.startswith("WITH changed AS (UPDATE ledger_operation")
    assert "ledger_chainhead" not in sql


@pytest.mark.django_db
def test_a_taken_key_records_nothing():
    first = receipts.record_intent("articles.create", "t", {"title": "x"},
                                   idempotency_key="k-taken")
    now = timezone.now()
    twin = Operation(operation_id=receipts.new_operation_id(now), tenant=first.tenant,
                     operation=first.operation, target="t", intent=first.intent,
                     intent_fingerprint=first.intent_fingerprint,
                     idempotency_key="k-taken", created_at=now, state_changed_at=now)
    seq = chain_seq()
    assert transitions.record(twin) is False
    assert twin.pk is None
    assert Operation.objects.count() == 1
    assert chain_seq() == seq


@pytest.mark.django_db
def test_the_loser_of_a_compare_and_set_writes_nothing_and_learns_who_won(reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    stale = Operation.objects.get(pk=op.pk)
    transitions.by_person(op, State.ABANDONED, user=reviewer, reason="first")
    events, seq = OperationEvent.objects.count(), chain_seq()
    with pytest.raises(StaleVersion, match="found version 4 .*abandoned.* by human reviewer"):
        transitions.by_person(stale, State.SUCCEEDED, user=reviewer, reason="second")
    assert (OperationEvent.objects.count(), chain_seq()) == (events, seq)


@pytest.mark.django_db
def test_a_move_to_succeeded_marks_both_twins_duplicate_in_the_same_statement():
    intent = {"title": "Same article"}
    first = OperationFactory(state=State.SUCCEEDED, intent=intent, idempotency_key="twin-1")
    second = OperationFactory(state=State.SUBMITTED, intent=intent, idempotency_key="twin-2")
    assert Operation.objects.get(pk=first.pk).conflict == ""
    with CaptureQueriesContext(connection) as queries:
        receipts.mark_succeeded(second, external_id="article-2")
    assert len(writes(queries)) == 1
    assert second.conflict == "duplicate"
    assert Operation.objects.get(pk=first.pk).conflict == "duplicate"


@pytest.mark.django_db
def test_a_move_elsewhere_leaves_succeeded_twins_alone():
    intent = {"title": "Same article"}
    first = OperationFactory(state=State.SUCCEEDED, intent=intent, idempotency_key="twin-1")
    second = OperationFactory(state=State.SUBMITTED, intent=intent, idempotency_key="twin-2")
    receipts.mark_outcome_unknown(second, error_code="Timeout")
    assert Operation.objects.get(pk=first.pk).conflict == ""
    assert Operation.objects.get(pk=second.pk).conflict == ""


@pytest.mark.django_db
def test_a_stale_fencing_token_is_checked_before_anything_is_written():
    run = RunFactory()
    old = leases.acquire(run.lease_resource, "agent-1", timedelta(minutes=5))
    leases.release(run.lease_resource, "agent-1", old)
    leases.acquire(run.lease_resource, "agent-2", timedelta(minutes=5))
    op = receipts.record_intent("articles.create", "t", {"title": "x"}, run=run)
    events = OperationEvent.objects.count()
    with pytest.raises(StaleFencingToken):
        transitions.by_agent(op, State.SUBMITTED, reason="late", fencing_token=old)
    assert Operation.objects.get(pk=op.pk).state == State.PLANNED
    assert OperationEvent.objects.count() == events


@pytest.mark.django_db
def test_the_sweep_records_an_unknown_outcome_as_the_system():
    op = OperationFactory(state=State.SUBMITTED)
    with transaction.atomic():
        transitions.by_sweep(op, reason="sender gone", evidence={"run": None})
    event = OperationEvent.objects.get(operation=op, version=op.version)
    assert (op.state, op.error_code) == (State.OUTCOME_UNKNOWN, "SenderGone")
    assert (event.actor_kind, event.actor_id, event.evidence) == (
        ActorKind.SYSTEM, "sweep_stale_submissions", {"run": None})
