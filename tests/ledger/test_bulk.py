"""Bulk decisions: each item on its own version, skipped ones reported, none twice."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from ledger import bulk, errors, receipts
from ledger.models import Operation, OperationEvent
from ledger.states import ActorKind, State
from tests.factories import OperationFactory, UserFactory


def seen(ops):
    return [(op.operation_id, op.version) for op in ops]


@pytest.mark.django_db
def test_200_items_with_10_changed_by_another_reviewer_decide_190_and_skip_10(reviewer):
    ops = [OperationFactory(state=State.OUTCOME_UNKNOWN) for _ in range(200)]
    items = seen(ops)  # what the reviewer's page showed
    other = UserFactory(username="other", role="reviewer")
    changed = ops[95:105]
    for op in changed:
        receipts.resolve(op, State.SUCCEEDED, user=other, reason="found it")
    before = OperationEvent.objects.count()

    result = bulk.resolve_many(items, State.ABANDONED, user=reviewer, reason="never sent")

    assert len(result.decided) == 190 and len(result.skipped) == 10
    assert {op_id for op_id, _ in result.skipped} == {op.operation_id for op in changed}
    assert all("changed meanwhile" in why and "other" in why for _, why in result.skipped)
    assert len(set(result.decided)) == 190
    assert OperationEvent.objects.count() - before == 190  # one event each, at most 200
    assert Operation.objects.filter(state=State.ABANDONED).count() == 190
    assert OperationEvent.objects.filter(actor_kind=ActorKind.HUMAN, actor_id="reviewer",
                                         to_state=State.ABANDONED).count() == 190


@pytest.mark.django_db
def test_an_item_listed_twice_is_decided_once(reviewer):
    op = OperationFactory(state=State.MANUAL_REVIEW)
    result = bulk.resolve_many(seen([op, op]), State.ABANDONED, user=reviewer, reason="gone")
    assert result.decided == [op.operation_id]
    assert result.skipped == [(op.operation_id, "listed twice; decided once")]


@pytest.mark.django_db
def test_items_the_reviewer_may_not_decide_are_skipped_with_why(reviewer):
    never = OperationFactory(state=State.OUTCOME_UNKNOWN, retry_policy="never")
    other_tenant = OperationFactory(state=State.OUTCOME_UNKNOWN, tenant="acme")
    result = bulk.resolve_many(seen([never, other_tenant]), State.SAFE_TO_RETRY,
                               user=reviewer, reason="checked")
    assert result.decided == []
    why = dict(result.skipped)
    assert why[never.operation_id].startswith("not permitted: expected permission "
                                              "ledger.override_retry_policy")
    assert why[other_tenant.operation_id] == "not found among your tenants"


@pytest.mark.django_db
def test_a_viewer_decides_nothing_and_the_cap_holds(viewer, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    with pytest.raises(errors.PermissionDenied):
        bulk.resolve_many(seen([op]), State.ABANDONED, user=viewer, reason="no")
    with pytest.raises(errors.InvalidInput, match=f"at most {bulk.BULK_CAP}"):
        bulk.resolve_many([(op.operation_id, 1)] * (bulk.BULK_CAP + 1), State.ABANDONED,
                          user=reviewer, reason="too many")
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN


@pytest.mark.django_db
def test_each_decided_item_costs_the_same_few_queries(reviewer):
    def queries(n):
        ops = [OperationFactory(state=State.OUTCOME_UNKNOWN) for _ in range(n)]
        with CaptureQueriesContext(connection) as captured:
            assert len(bulk.resolve_many(seen(ops), State.ABANDONED, user=reviewer,
                                         reason="batch").decided) == n
        return len(captured)

    queries(1)  # the user's permissions and tenants, cached from here on
    # The fetch of all items, then per item whether it takes two people (one look at the
    # consequential policies) and its decision statement inside its own transaction (a
    # savepoint and its release in the test's transaction).
    assert (queries(5), queries(15)) == (1 + 4 * 5, 1 + 4 * 15)
