"""receipts.acknowledge: a person settles the conflict flag of a terminal operation."""

import pytest

from ledger import chain, receipts, selectors
from ledger.errors import IllegalTransition, InvalidInput, PermissionDenied, StaleVersion
from ledger.models import Operation, OperationEvent
from ledger.models.operations import Conflict
from ledger.states import ActorKind, State
from tests.factories import OperationFactory, UserFactory, add_evidence
from tests.support.concurrency import join, run_threads


def succeeded(intent, *, key=None, tenant="default"):
    op = receipts.record_intent("articles.create", "https://cms.example/a", intent,
                                idempotency_key=key, tenant=tenant)
    receipts.mark_submitted(op)
    return receipts.mark_succeeded(op, external_id=f"art-{key}")


def twins(tenant="default"):
    """Two operations with one fingerprint (two keys) that both succeeded: both flagged."""
    intent = {"title": "Launch", "body": "same words"}
    first = succeeded(intent, key="k1", tenant=tenant)
    second = succeeded(intent, key="k2", tenant=tenant)
    return Operation.objects.get(pk=first.pk), second


def human_flag_events(op):
    return list(OperationEvent.objects.filter(operation=op, actor_kind=ActorKind.HUMAN,
                                              from_state=op.state, to_state=op.state))


@pytest.mark.django_db
def test_acknowledging_one_twin_settles_both_and_each_carries_its_audited_event(reviewer):
    first, second = twins()
    assert (first.conflict, second.conflict) == (Conflict.DUPLICATE, Conflict.DUPLICATE)
    assert len(selectors.review_queue(reviewer).items) == 2
    versions = (first.version, second.version)

    op = receipts.acknowledge(first, user=reviewer, reason="intended: two launch posts")
    assert (op.conflict, op.version) == ("", versions[0] + 1)
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.conflict, second.conflict) == ("", "")
    assert (first.version, second.version) == (versions[0] + 1, versions[1] + 1)
    assert (first.state, second.state) == (State.SUCCEEDED, State.SUCCEEDED)
    [mine] = human_flag_events(first)
    [theirs] = human_flag_events(second)
    assert (mine.actor_id, mine.version) == ("reviewer", first.version)
    assert mine.reason == "acknowledged duplicate: intended: two launch posts"
    assert mine.evidence == {"conflict": {"from": "duplicate", "to": ""},
                             "settles": [second.operation_id]}
    assert theirs.reason == (f"acknowledged duplicate with {first.operation_id}: "
                             "intended: two launch posts")
    assert theirs.evidence["acknowledged_with"] == first.operation_id
    assert selectors.review_queue(reviewer).items == []
    # In the audit log and the tenant's hash chain like every decision.
    audit = selectors.audit_page(reviewer, selectors.AuditFilters(actor="reviewer"))
    assert {event.pk for event in audit.items} == {mine.pk, theirs.pk}
    assert chain.verify(actor="test").is_intact


@pytest.mark.django_db
def test_a_later_success_with_the_same_fingerprint_flags_the_set_again(reviewer):
    first, second = twins()
    receipts.acknowledge(first, user=reviewer, reason="intended")
    third = succeeded({"title": "Launch", "body": "same words"}, key="k3")
    assert third.conflict == Conflict.DUPLICATE
    assert set(Operation.objects.values_list("conflict", flat=True)) == {"duplicate"}


@pytest.mark.django_db
def test_an_ambiguous_flag_left_on_a_terminal_operation_can_be_acknowledged(reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    add_evidence(op, verdict="ambiguous", to_state=State.RECONCILING,
                 observed={"matches": [{"id": "a"}, {"id": "b"}]})
    assert op.conflict == Conflict.AMBIGUOUS
    # A terminal operation that still carries the flag (written as the reconciler would).
    add_evidence(op, verdict="found", to_state=State.SUCCEEDED,
                 observed={"matches": [{"id": "a"}, {"id": "b"}]})
    op = Operation.objects.get(pk=op.pk)
    assert (op.state, op.conflict) == (State.SUCCEEDED, Conflict.AMBIGUOUS)
    receipts.acknowledge(op, user=reviewer, reason="both are ours: a and b")
    op.refresh_from_db()
    assert op.conflict == "" and len(human_flag_events(op)) == 1


@pytest.mark.django_db
def test_acknowledging_leaves_operations_of_other_fingerprints_alone(reviewer):
    first, second = twins()
    other = succeeded({"title": "Other"}, key="k9")
    assert other.conflict == ""
    receipts.acknowledge(second, user=reviewer, reason="checked")
    assert set(Operation.objects.values_list("conflict", flat=True)) == {""}
    assert human_flag_events(other) == []


@pytest.mark.django_db
def test_a_viewer_is_refused_and_nothing_is_written(viewer):
    first, second = twins()
    with pytest.raises(PermissionDenied, match="ledger.resolve_operation"):
        receipts.acknowledge(first, user=viewer, reason="fine")
    assert set(Operation.objects.values_list("conflict", flat=True)) == {"duplicate"}
    assert OperationEvent.objects.filter(actor_kind=ActorKind.HUMAN).count() == 0


@pytest.mark.django_db
def test_a_reviewer_without_the_tenant_grant_is_refused():
    first, second = twins(tenant="globex")
    acme = UserFactory(username="acme-only", role="reviewer", tenants=["acme"])
    with pytest.raises(PermissionDenied, match="tenant 'globex'"):
        receipts.acknowledge(first, user=acme, reason="fine")
    first.refresh_from_db()
    assert first.conflict == Conflict.DUPLICATE


@pytest.mark.django_db
@pytest.mark.parametrize("reason", ["", "   ", None])
def test_a_reason_is_required(reviewer, reason):
    first, second = twins()
    with pytest.raises(InvalidInput, match="non-empty reason"):
        receipts.acknowledge(first, user=reviewer, reason=reason)
    first.refresh_from_db()
    assert first.conflict == Conflict.DUPLICATE


@pytest.mark.django_db
def test_an_operation_without_a_flag_or_not_terminal_is_refused(reviewer):
    plain = succeeded({"title": "Alone"}, key="alone")
    with pytest.raises(IllegalTransition, match="with a conflict flag to acknowledge, found "
                                                "succeeded with no flag"):
        receipts.acknowledge(plain, user=reviewer, reason="nothing")
    waiting = OperationFactory(state=State.OUTCOME_UNKNOWN)
    add_evidence(waiting, verdict="ambiguous", to_state=State.RECONCILING,
                 observed={"matches": [{"id": "a"}, {"id": "b"}]})
    add_evidence(waiting, verdict="ambiguous", to_state=State.MANUAL_REVIEW,
                 observed={"matches": [{"id": "a"}, {"id": "b"}]})
    waiting = Operation.objects.get(pk=waiting.pk)
    assert waiting.conflict == Conflict.AMBIGUOUS
    with pytest.raises(IllegalTransition, match="found manual_review with flag ambiguous"):
        receipts.acknowledge(waiting, user=reviewer, reason="a person resolves it instead")
    assert OperationEvent.objects.filter(actor_kind=ActorKind.HUMAN).count() == 0


@pytest.mark.django_db
def test_a_stale_version_is_refused_naming_who_settled_it_first(reviewer):
    first, second = twins()
    seen = second.version
    alice = UserFactory(username="alice", role="reviewer")
    receipts.acknowledge(first, user=alice, reason="alice checked")
    with pytest.raises(StaleVersion, match="alice") as caught:
        receipts.acknowledge(second, user=reviewer, reason="me too", expected_version=seen)
    assert caught.value.current.conflict == ""
    assert len(human_flag_events(Operation.objects.get(pk=second.pk))) == 1


@pytest.mark.django_db(transaction=True)
def test_two_reviewers_acknowledging_the_two_twins_at_once_record_one_settlement():
    first, second = twins()
    people = [UserFactory(username=f"r{i}", role="reviewer") for i in range(2)]
    ops = [first, second]

    def acknowledge(i):
        op = Operation.objects.get(pk=ops[i].pk)
        return receipts.acknowledge(op, user=people[i], reason=f"r{i} checked",
                                    expected_version=ops[i].version)

    threads, results, errors = run_threads(2, acknowledge)
    join(threads)
    assert len(results) == 1 and [type(e) for e in errors] == [StaleVersion]
    events = OperationEvent.objects.filter(actor_kind=ActorKind.HUMAN)
    assert events.count() == 2  # one per twin, both by the winner
    assert {e.actor_id for e in events} == {results[0].events.filter(
        actor_kind=ActorKind.HUMAN).get().actor_id}
    assert set(Operation.objects.values_list("conflict", flat=True)) == {""}


@pytest.mark.django_db
def test_retention_keeps_a_flagged_operation_until_it_is_acknowledged(reviewer):
    from ledger import retention
    from tests.support.retention import complete_days_ago, retention_admin

    retention.set_policy("*", purge_after_days=30, redact_after_days=None,
                         user=retention_admin())
    first, second = twins()
    for op in (first, second):
        complete_days_ago(op, 40)
    assert retention.purge(actor="test").purged_operation_ids == []
    receipts.acknowledge(first, user=reviewer, reason="intended")
    complete_days_ago(first, 40)  # also fires the deferred event checks before the purge
    purged = retention.purge(actor="test").purged_operation_ids
    assert sorted(purged) == sorted([first.operation_id, second.operation_id])
