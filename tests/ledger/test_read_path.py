"""The one read path as the API uses it: an agent key is a principal like a user (one
tenant filter, one fetch-and-check per noun), the operations' pages on the one keyset
pagination, and the two-person proposals' status as the desk shows it."""

from datetime import timedelta

import pytest

from ledger import agent_keys, approvals, obligations, receipts, runs, selectors
from ledger.errors import InvalidInput, NotFound
from ledger.selectors.approvals import (
    PROPOSAL_COMPLETED,
    PROPOSAL_PENDING,
    PROPOSAL_REPLACED,
    PROPOSAL_STALE,
)
from ledger.states import State
from tests.factories import OperationFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def root(db):
    user = UserFactory(username="readpath-root", tenants=[])
    user.is_superuser = True
    user.save(update_fields=["is_superuser"])
    return user


@pytest.fixture
def key(root):
    return agent_keys.create("readpath-bot", tenants=["default"], user=root)[0]


def test_an_agent_key_fetches_and_checks_like_a_user(key, reviewer):
    ours = OperationFactory()
    theirs = OperationFactory(tenant="acme")
    run = runs.start("ours", run_id="run-ours")
    other_run = runs.start("theirs", tenant="acme", run_id="run-theirs")
    obligations.open(run, "email", "ob-ours")
    obligations.open(other_run, "email", "ob-theirs")

    for principal in (key, reviewer):
        assert selectors.access_operation(principal, ours.operation_id) == ours
        assert selectors.access_run(principal, "run-ours") == run
        assert selectors.access_obligation(principal, "ob-ours").key == "ob-ours"
        with pytest.raises(NotFound, match="among the tenants you may see"):
            selectors.access_operation(principal, theirs.operation_id)
        with pytest.raises(NotFound, match="among the tenants you may see"):
            selectors.access_run(principal, "run-theirs")
        with pytest.raises(NotFound, match="among the tenants you may see"):
            selectors.access_obligation(principal, "ob-theirs")


@pytest.mark.parametrize(("fetch", "too_long", "malformed"), [
    (selectors.access_operation, "x" * 41, "x\x00y"),
    (selectors.access_run, "r" * 101, " run-ours"),
    (selectors.access_obligation, "k" * 201, "ob\nours"),
])
def test_an_id_of_the_wrong_length_is_not_found_and_a_malformed_one_refused(
    reviewer, fetch, too_long, malformed
):
    with pytest.raises(NotFound, match="expected an? (operation id|run id|obligation key)"):
        fetch(reviewer, too_long)
    with pytest.raises(NotFound):
        fetch(reviewer, 42)
    with pytest.raises(InvalidInput):
        fetch(reviewer, malformed)


def test_a_read_made_with_the_keys_authentication_answers_once(key, django_assert_num_queries):
    op = OperationFactory()
    selectors.remember_read(key, op.operation_id, op)
    with django_assert_num_queries(0):
        assert selectors.access_operation(key, op.operation_id) is op
    with django_assert_num_queries(1):  # used once: the next look-up asks PostgreSQL
        assert selectors.access_operation(key, op.operation_id) == op
    selectors.remember_read(key, op.operation_id, None)  # read with the key: not visible
    with pytest.raises(NotFound):
        selectors.access_operation(key, op.operation_id)


def test_operations_pages_newest_first_on_their_ids_of_visible_tenants(
    key, django_assert_num_queries
):
    made = [OperationFactory(intent={"n": n}) for n in range(5)]
    OperationFactory(tenant="acme")
    newest_first = sorted((op.operation_id for op in made), reverse=True)

    with django_assert_num_queries(1):
        first = selectors.operations_page(key, per_page=2)
    second = selectors.operations_page(key, per_page=2, cursor=first.next_cursor)
    last = selectors.operations_page(key, per_page=2, cursor=second.next_cursor)

    seen = [op.operation_id for page in (first, second, last) for op in page.items]
    assert seen == newest_first
    assert first.next_cursor == newest_first[1] and last.next_cursor == ""
    assert selectors.operations_page(key, state=State.SUCCEEDED).items == []
    with pytest.raises(InvalidInput, match="page size between 1 and 200"):
        selectors.operations_page(key, per_page=201)


def test_the_proposals_status_is_read_as_the_desk_shows_it(root):
    alice = UserFactory(username="alice", role="reviewer")
    bob = UserFactory(username="bob", role="reviewer")
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    approvals.set_policy("articles.*", user=root, approvals_needed=1, consequential=True,
                         ttl=timedelta(hours=1))

    receipts.resolve(op, State.ABANDONED, user=alice, reason="never sent")
    assert op.proposal_recorded is True
    receipts.resolve(op, State.SUCCEEDED, user=bob, reason="seen in the CMS")  # replaces
    pending = selectors.pending_proposal(op)
    panel = selectors.proposals_of(op, op.events.order_by("version"))
    assert [p.status for p in panel.rows] == [PROPOSAL_REPLACED,
                                              PROPOSAL_PENDING]
    assert panel.pending == pending and pending.proposed_by == bob

    receipts.resolve(op, State.SUCCEEDED, user=alice, reason="agreed")
    assert op.proposal_recorded is False and op.state == State.SUCCEEDED
    panel = selectors.proposals_of(op, op.events.order_by("version"))
    assert [p.status for p in panel.rows] == [PROPOSAL_STALE,
                                              PROPOSAL_COMPLETED]
    assert panel.pending is None
