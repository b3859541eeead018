"""The state table, enforced by the API and by PostgreSQL's trigger."""

import itertools

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, connection, transaction
from django.db.models import F

from ledger import receipts, states
from ledger.models import Operation, OperationEvent
from ledger.states import State
from tests.factories import OperationFactory, machine_path

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
    with pytest.raises(IntegrityError,
                       match="expected the statement changing it to version 3 .*found none"):
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


# --- every other set derives from TRANSITIONS and HUMAN_DECISIONS -------------------------


def test_human_only_pairs_are_the_human_decisions():
    assert {
        (from_state, to_state)
        for from_state, decisions in states.HUMAN_DECISIONS.items() for to_state in decisions
    } == states.HUMAN_ONLY
    assert all(states.is_legal(a, b) for a, b in states.HUMAN_ONLY)


def test_the_queue_waits_on_the_states_a_person_decides_from():
    assert states.QUEUE_STATES == (State.OUTCOME_UNKNOWN, State.MANUAL_REVIEW)
    assert tuple(states.HUMAN_DECISIONS) == states.QUEUE_STATES
    assert set(states.HUMAN_DECISIONS) == states.NEEDS_REVIEW


def test_resolutions_are_every_human_decision_in_desk_order():
    assert states.RESOLUTIONS == (State.SUCCEEDED, State.SAFE_TO_RETRY, State.ABANDONED)
    for from_state in State.values:
        assert states.resolutions_from(from_state) == list(
            states.HUMAN_DECISIONS.get(from_state, ()))


def test_terminal_states_are_those_nothing_may_follow():
    assert {s for s in State.values if not states.targets(s)} == states.TERMINAL


def test_a_human_decision_the_table_does_not_allow_stops_the_import(monkeypatch):
    monkeypatch.setitem(states.HUMAN_DECISIONS, State.MANUAL_REVIEW,
                        (State.SUCCEEDED, State.SUBMITTED))
    with pytest.raises(ImproperlyConfigured, match=r"found \['submitted'\]"):
        states._check_tables()


def test_a_state_without_a_row_in_the_table_stops_the_import(monkeypatch):
    monkeypatch.delitem(states.TRANSITIONS, State.ABANDONED)
    with pytest.raises(ImproperlyConfigured, match="a row for every state"):
        states._check_tables()


@pytest.mark.parametrize("to_state", State.values)
def test_factories_walk_the_table_without_human_decisions(to_state):
    path = machine_path(to_state)
    steps = list(zip([State.PLANNED, *path], path, strict=False))
    assert all(states.is_legal(a, b) and not states.is_human_only(a, b) for a, b in steps)
    assert (path[-1] if path else State.PLANNED) == to_state


def test_factory_paths_follow_a_change_of_the_table(monkeypatch):
    # Were manual_review reachable straight from outcome_unknown, the factories would take it.
    monkeypatch.setitem(states.TRANSITIONS, State.OUTCOME_UNKNOWN,
                        states.TRANSITIONS[State.OUTCOME_UNKNOWN] | {State.MANUAL_REVIEW})
    assert machine_path(State.MANUAL_REVIEW) == [
        State.SUBMITTED, State.OUTCOME_UNKNOWN, State.MANUAL_REVIEW]


# --- the trigger in the migrations is the table's ----------------------------------------


def installed_transition_check() -> str:
    """The body of the function behind the transition trigger, as the migrations left it."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT p.prosrc FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
             WHERE t.tgrelid = 'ledger_operation'::regclass
               AND t.tgname LIKE 'pgtrigger_operation_transition_check_%%'
            """
        )
        rows = cursor.fetchall()
    assert len(rows) == 1, f"expected one transition trigger, found {len(rows)}"
    return rows[0][0]


@pytest.mark.django_db
def test_the_migrated_trigger_matches_the_transition_table():
    assert states.transition_check_sql() in installed_transition_check()


@pytest.mark.django_db
def test_a_changed_table_would_no_longer_match_the_migrated_trigger(monkeypatch):
    monkeypatch.setitem(states.TRANSITIONS, State.MANUAL_REVIEW,
                        states.TRANSITIONS[State.MANUAL_REVIEW] | {State.OUTCOME_UNKNOWN})
    assert states.transition_check_sql() not in installed_transition_check()
