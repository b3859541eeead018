"""The state table, enforced by the API and by PostgreSQL's trigger."""

import itertools

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.models import F

from ledger import receipts, states, transitions
from ledger.errors import IllegalTransition
from ledger.models import Operation, OperationEvent
from ledger.states import ActorKind, State
from tests.factories import OperationFactory

ALL_PAIRS = list(itertools.product(State.values, State.values))
LEGAL = [(a, b) for a, b in ALL_PAIRS if states.is_legal(a, b)]
ILLEGAL = [(a, b) for a, b in ALL_PAIRS if not states.is_legal(a, b) and a != b]


def immediate_constraints():
    """Deferred triggers fire at commit; a test transaction never commits, so fire them now."""
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")


def test_transition_table_matches_the_design():
    assert states.targets(State.PLANNED) == ["abandoned", "submitted"]
    assert states.targets(State.SUBMITTED) == ["outcome_unknown", "rejected", "succeeded"]
    assert states.targets(State.OUTCOME_UNKNOWN) == [
        "abandoned", "reconciling", "safe_to_retry", "succeeded"
    ]
    assert states.targets(State.RECONCILING) == [
        "manual_review", "outcome_unknown", "safe_to_retry", "succeeded"
    ]
    assert states.targets(State.MANUAL_REVIEW) == ["abandoned", "safe_to_retry", "succeeded"]
    assert states.targets(State.SAFE_TO_RETRY) == ["abandoned", "submitted"]
    assert {"succeeded", "rejected", "abandoned"} == states.TERMINAL


@pytest.mark.django_db
@pytest.mark.parametrize(("from_state", "to_state"), LEGAL)
def test_every_legal_transition_is_accepted_and_evented(from_state, to_state):
    op = OperationFactory(state=from_state)
    version = op.version
    with transaction.atomic():
        transitions._apply(op, to_state, actor_kind=ActorKind.SYSTEM, reason="test")
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
@pytest.mark.parametrize(("from_state", "to_state"), ILLEGAL)
def test_every_illegal_transition_is_refused_by_a_raw_update(from_state, to_state):
    op = OperationFactory(state=from_state)
    with pytest.raises(IntegrityError, match="illegal transition"), transaction.atomic():
        Operation.objects.filter(pk=op.pk).update(state=to_state, version=F("version") + 1)
    op.refresh_from_db()
    assert op.state == from_state


@pytest.mark.django_db
def test_a_raw_legal_update_without_its_event_is_refused():
    op = OperationFactory(state=State.SUBMITTED)
    immediate_constraints()
    with pytest.raises(IntegrityError, match="expected an event recording version 3"):
        with transaction.atomic():
            Operation.objects.filter(pk=op.pk).update(state=State.SUCCEEDED, version=3)


@pytest.mark.django_db
@pytest.mark.parametrize("version_delta", [0, 2, -1])
def test_a_state_change_whose_version_does_not_step_by_one_is_refused(version_delta):
    op = OperationFactory(state=State.SUBMITTED)
    with pytest.raises(IntegrityError, match="expected version 3"), transaction.atomic():
        Operation.objects.filter(pk=op.pk).update(
            state=State.SUCCEEDED, version=op.version + version_delta
        )


@pytest.mark.django_db
def test_a_version_change_without_a_state_change_is_refused():
    op = OperationFactory(state=State.SUBMITTED)
    with pytest.raises(IntegrityError, match="expected version 2 unchanged"):
        with transaction.atomic():
            Operation.objects.filter(pk=op.pk).update(version=F("version") + 1)


@pytest.mark.django_db
def test_a_receipt_cannot_be_inserted_past_planned():
    op = OperationFactory.build()
    op.state, op.operation_id, op.intent_fingerprint = State.SUCCEEDED, "x-1", "sha256:0"
    op.idempotency_key = "raw-insert"
    from django.utils import timezone

    op.created_at = op.state_changed_at = timezone.now()
    with pytest.raises(IntegrityError, match="expected a new receipt in state planned"):
        with transaction.atomic():
            op.save()


@pytest.mark.django_db
def test_identity_columns_cannot_be_changed():
    op = OperationFactory(state=State.SUBMITTED)
    with pytest.raises(IntegrityError, match="expected its identity"), transaction.atomic():
        Operation.objects.filter(pk=op.pk).update(idempotency_key="another")


@pytest.mark.django_db
def test_events_refuse_update_and_delete():
    op = OperationFactory(state=State.SUCCEEDED)
    with pytest.raises(Exception, match="Cannot update or delete"), transaction.atomic():
        OperationEvent.objects.filter(operation=op).update(reason="rewritten")
    with pytest.raises(Exception, match="Cannot update or delete"), transaction.atomic():
        OperationEvent.objects.filter(operation=op).delete()
    assert OperationEvent.objects.filter(operation=op).count() == 3


@pytest.mark.django_db(transaction=True)
def test_a_whole_lifecycle_commits_with_the_deferred_checks():
    op = receipts.record_intent("articles.create", "t", {"title": "x"})
    receipts.mark_submitted(op)
    receipts.mark_outcome_unknown(op, error_code="timeout")
    op.refresh_from_db()
    assert (op.state, op.version) == (State.OUTCOME_UNKNOWN, 3)
    assert list(op.events.values_list("version", flat=True)) == [1, 2, 3]
