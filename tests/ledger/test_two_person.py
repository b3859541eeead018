"""The two-person rule on receipts.resolve: a consequential pattern (or safe_to_retry on a
`never` operation) takes a proposer and a different person completing the same decision."""

import pytest
from django.db import IntegrityError, connection, connections, transaction

from ledger import approvals, bulk, errors, receipts, transitions
from ledger.models import Operation, OperationEvent, ResolutionProposal
from ledger.states import ActorKind, State
from tests.factories import (
    OperationFactory,
    UserFactory,
    drive,
    ensure_roles,
    reconciler_lease,
)
from tests.support.concurrency import join, run_threads


@pytest.fixture
def consequential(admin_user):
    return approvals.set_policy("payments.*", user=admin_user, consequential=True)


@pytest.fixture
def ada(db):
    return UserFactory(username="ada", role="reviewer")


@pytest.fixture
def bob(db):
    return UserFactory(username="bob", role="reviewer")


@pytest.fixture
def stuck_payment(consequential):
    """A payment approved by two people before it was sent, now outcome_unknown."""
    approvers = [UserFactory(username=f"approver{n}", role="reviewer") for n in (1, 2)]

    def make():
        op = OperationFactory(operation="payments.send")
        for approver in approvers:
            approvals.approve(op, user=approver, reason="looks right")
        return drive(op, State.OUTCOME_UNKNOWN)
    return make


@pytest.mark.django_db
def test_the_first_resolve_records_a_proposal_and_changes_nothing(stuck_payment, ada):
    op = stuck_payment()
    version = op.version
    returned = receipts.resolve(op, State.SUCCEEDED, user=ada, reason="seen in the bank")
    assert returned is op and (op.state, op.version) == (State.OUTCOME_UNKNOWN, version)
    op.refresh_from_db()
    assert (op.state, op.version) == (State.OUTCOME_UNKNOWN, version)
    proposal = approvals.pending_proposal(op)
    assert (proposal.to_state, proposal.version, proposal.proposed_by, proposal.reason) == (
        State.SUCCEEDED, version, ada, "seen in the bank")
    assert str(proposal) == "proposed: succeeded by ada, needs a second person"
    assert not op.events.filter(version__gt=version).exists()


@pytest.mark.django_db
def test_a_second_person_completes_it_and_the_event_names_both(stuck_payment, ada, bob):
    op = stuck_payment()
    receipts.resolve(op, State.SUCCEEDED, user=ada, reason="seen in the bank",
                     external_id="tx-7")
    receipts.resolve(op, State.SUCCEEDED, user=bob, reason="confirmed")
    op.refresh_from_db()
    assert (op.state, op.external_id) == (State.SUCCEEDED, "tx-7")
    event = op.events.get(version=op.version)
    assert (event.decided_by, event.actor_id, event.reason) == (bob, "bob", "confirmed")
    two = event.evidence["two_person"]
    assert (two["proposed_by"], two["proposed_by_id"], two["proposal_reason"]) == (
        "ada", ada.pk, "seen in the bank")
    assert approvals.pending_proposal(op) is None


@pytest.mark.django_db
def test_the_proposer_cannot_complete_their_own_proposal(stuck_payment, ada):
    op = stuck_payment()
    receipts.resolve(op, State.ABANDONED, user=ada, reason="never sent")
    with pytest.raises(errors.SecondPersonRequired, match="other than ada"):
        receipts.resolve(op, State.ABANDONED, user=ada, reason="really never sent")
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN
    assert ResolutionProposal.objects.filter(operation=op).count() == 1


@pytest.mark.django_db
def test_a_different_decision_replaces_the_proposal_and_decides_nothing(stuck_payment, ada,
                                                                      bob):
    op = stuck_payment()
    receipts.resolve(op, State.SUCCEEDED, user=ada, reason="seen")
    receipts.resolve(op, State.ABANDONED, user=bob, reason="not in the bank")
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN
    pending = approvals.pending_proposal(op)
    assert (pending.to_state, pending.proposed_by) == (State.ABANDONED, bob)
    # Ada agreeing with Bob completes Bob's proposal.
    receipts.resolve(op, State.ABANDONED, user=ada, reason="agreed")
    op.refresh_from_db()
    assert op.state == State.ABANDONED
    assert op.events.get(version=op.version).evidence["two_person"]["proposed_by"] == "bob"


@pytest.mark.django_db
def test_a_proposal_of_a_version_that_changed_since_is_stale(stuck_payment, ada, bob):
    op = stuck_payment()
    receipts.resolve(op, State.SUCCEEDED, user=ada, reason="seen")
    seen = op.version
    moved = Operation.objects.get(pk=op.pk)
    for state in (State.RECONCILING, State.MANUAL_REVIEW):  # a reconciler found two matches
        with transaction.atomic():
            transitions._apply(moved, state, actor_kind=ActorKind.RECONCILER,
                               fencing_token=reconciler_lease(moved),
                               actor_id="reconciler", reason="two matches")
    with pytest.raises(errors.StaleVersion):
        receipts.resolve(op, State.SUCCEEDED, user=bob, reason="confirmed",
                         expected_version=seen)
    assert approvals.pending_proposal(moved) is None
    # At the new version Bob's resolve is only a proposal again.
    receipts.resolve(moved, State.SUCCEEDED, user=bob, reason="confirmed")
    moved.refresh_from_db()
    assert moved.state == State.MANUAL_REVIEW
    assert approvals.pending_proposal(moved).proposed_by == bob


@pytest.mark.django_db
def test_safe_to_retry_on_a_never_operation_takes_two_people(admin_user):
    other_admin = UserFactory(username="admin2", role="admin")
    op = OperationFactory(state=State.MANUAL_REVIEW, retry_policy="never")
    receipts.resolve(op, State.SAFE_TO_RETRY, user=admin_user, reason="checked by phone")
    assert op.state == State.MANUAL_REVIEW
    receipts.resolve(op, State.SAFE_TO_RETRY, user=other_admin, reason="checked twice")
    assert op.state == State.SAFE_TO_RETRY
    # Abandoning a `never` operation without a consequential policy takes one person.
    single = OperationFactory(state=State.MANUAL_REVIEW, retry_policy="never")
    receipts.resolve(single, State.ABANDONED, user=admin_user, reason="gave up")
    assert single.state == State.ABANDONED


@pytest.mark.django_db
def test_operations_no_consequential_policy_matches_take_one_person(stuck_payment, ada):
    op = OperationFactory(operation="articles.create", state=State.OUTCOME_UNKNOWN)
    receipts.resolve(op, State.SUCCEEDED, user=ada, reason="in the CMS")
    assert op.state == State.SUCCEEDED


@pytest.mark.django_db
def test_postgres_refuses_a_single_persons_decision(stuck_payment, ada, bob):
    op = stuck_payment()
    with pytest.raises(IntegrityError, match="expected two people"):
        transitions.by_person(op, State.SUCCEEDED, user=ada, reason="alone")
    op = Operation.objects.get(pk=op.pk)
    # Ada's own proposal does not let Ada decide alone either.
    receipts.resolve(op, State.SUCCEEDED, user=ada, reason="seen")
    with pytest.raises(IntegrityError, match="expected two people"):
        transitions.by_person(op, State.SUCCEEDED, user=ada, reason="alone")
    # A proposal of another decision is not this one.
    with pytest.raises(IntegrityError, match="expected two people"):
        transitions.by_person(op, State.ABANDONED, user=bob, reason="other")
    transitions.by_person(op, State.SUCCEEDED, user=bob, reason="agreed")
    assert op.state == State.SUCCEEDED


@pytest.mark.django_db
def test_proposals_are_append_only(stuck_payment, ada):
    op = stuck_payment()
    receipts.resolve(op, State.SUCCEEDED, user=ada, reason="seen")
    with pytest.raises(Exception, match="append-only"), transaction.atomic(), \
            connection.cursor() as cursor:
        cursor.execute("UPDATE ledger_resolutionproposal SET proposed_by_name = 'bob'")


@pytest.mark.django_db
def test_a_proposal_needs_the_permission_and_the_tenant(stuck_payment, viewer):
    op = stuck_payment()
    with pytest.raises(errors.PermissionDenied):
        receipts.resolve(op, State.SUCCEEDED, user=viewer, reason="seen")
    outsider = UserFactory(username="outsider", role="reviewer", tenants=["acme"])
    with pytest.raises(errors.PermissionDenied):
        receipts.resolve(op, State.SUCCEEDED, user=outsider, reason="seen")
    assert not ResolutionProposal.objects.exists()


@pytest.mark.django_db
def test_bulk_records_proposals_reports_them_skipped_and_a_second_bulk_completes(
        stuck_payment, ada, bob):
    ops = [stuck_payment() for _ in range(3)]
    plain = OperationFactory(operation="articles.create", state=State.OUTCOME_UNKNOWN)
    items = [(op.operation_id, op.version) for op in [*ops, plain]]
    first = bulk.resolve_many(items, State.ABANDONED, user=ada, reason="never sent")
    assert first.decided == [plain.operation_id]
    assert [(i, why.split(" (")[0]) for i, why in first.skipped] == [
        (op.operation_id, "consequential: needs a second person") for op in ops]
    again = bulk.resolve_many(items[:3], State.ABANDONED, user=ada, reason="never sent")
    assert again.decided == [] and all("other than ada" in why for _, why in again.skipped)
    second = bulk.resolve_many(items[:3], State.ABANDONED, user=bob, reason="agreed")
    assert second.decided == [op.operation_id for op in ops]
    assert OperationEvent.objects.filter(operation__in=ops, to_state=State.ABANDONED,
                                         decided_by=bob).count() == 3


@pytest.mark.django_db(transaction=True)
def test_two_people_resolving_at_once_make_one_proposal_and_one_decision():
    """Real threads: the row lock orders them; the first proposes, the second (a different
    person, the same decision) completes it. Never two decisions, never a lone one."""
    ensure_roles()
    admin = UserFactory(username="admin", role="admin")
    approvals.set_policy("payments.*", user=admin, consequential=True)
    people = [UserFactory(username=name, role="reviewer") for name in ("ada", "bob")]
    op = OperationFactory(operation="payments.send")
    for approver in (admin, *people):  # three approvals: the gate asks two
        approvals.approve(op, user=approver, reason="ok")
    drive(op, State.OUTCOME_UNKNOWN)
    version = op.version

    def resolve(i):
        mine = Operation.objects.get(pk=op.pk)
        receipts.resolve(mine, State.ABANDONED, user=people[i], reason=f"by {i}",
                         expected_version=version)
        return people[i].username

    threads, results, failures = run_threads(2, resolve)
    join(threads)
    connections.close_all()
    assert failures == [] and sorted(results) == ["ada", "bob"]
    op.refresh_from_db()
    assert (op.state, op.version) == (State.ABANDONED, version + 1)
    [proposal] = ResolutionProposal.objects.filter(operation=op)
    event = op.events.get(version=op.version)
    assert event.decided_by_id != proposal.proposed_by_id
    assert event.evidence["two_person"]["proposed_by"] == proposal.proposed_by_name
