"""The two-person rule on the desk: a proposal shown on the operation page and in the
queue, completed by a second reviewer; the proposer cannot complete it; a stale page."""

import pytest
from django.test import Client
from django.urls import reverse

from ledger import approvals
from ledger.models import ResolutionProposal
from ledger.states import State
from tests.factories import OperationFactory, UserFactory, drive


@pytest.fixture
def stuck_payment(admin_user):
    """A payment under a consequential policy, approved by two people, now outcome_unknown."""
    approvers = [UserFactory(username=f"approver{n}", role="reviewer") for n in (1, 2)]
    approvals.set_policy("payments.*", user=admin_user, consequential=True)
    op = OperationFactory(operation="payments.send")
    for approver in approvers:
        approvals.approve(op, user=approver, reason="looks right")
    return drive(op, State.OUTCOME_UNKNOWN)


def logged_in(username):
    client = Client()
    client.force_login(UserFactory(username=username, role="reviewer"))
    return client


def decide(client, op, to_state, *, version, reason="checked the bank"):
    return client.post(reverse("review:resolve", args=[op.operation_id]),
                       {"to_state": to_state, "reason": reason, "version": version},
                       follow=True)


@pytest.mark.django_db
def test_a_proposal_is_shown_then_a_second_reviewer_completes_it(stuck_payment):
    op, ada, bob = stuck_payment, logged_in("ada"), logged_in("bob")
    page = decide(ada, op, State.SUCCEEDED, version=op.version).content.decode()
    assert "Proposed: Mark succeeded" in page
    assert "Proposed: succeeded by ada, needs a second person" in page
    assert "You proposed it" in page
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN
    queue = bob.get(reverse("review:queue")).content.decode()
    assert "proposed: succeeded by ada, needs a second person" in queue
    page = bob.get(reverse("review:operation", args=[op.operation_id])).content.decode()
    assert "Choosing the same decision completes it" in page
    page = decide(bob, op, State.SUCCEEDED, version=op.version,
                  reason="confirmed").content.decode()
    assert "Recorded: Mark succeeded" in page
    assert "completed by a second person" in page and "proposed by ada" in page
    op.refresh_from_db()
    assert op.state == State.SUCCEEDED
    assert op.events.get(version=op.version).decided_by.username == "bob"


@pytest.mark.django_db
def test_the_proposer_cannot_complete_it_on_the_desk(stuck_payment):
    op, ada = stuck_payment, logged_in("ada")
    decide(ada, op, State.ABANDONED, version=op.version)
    page = decide(ada, op, State.ABANDONED, version=op.version).content.decode()
    assert "Nothing recorded" in page and "other than ada" in page
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN
    assert ResolutionProposal.objects.filter(operation=op).count() == 1


@pytest.mark.django_db
def test_a_decision_on_a_stale_page_records_nothing(stuck_payment):
    op, ada = stuck_payment, logged_in("ada")
    page = decide(ada, op, State.SUCCEEDED, version=op.version - 1).content.decode()
    # still open: offered again for one-key confirmation, nothing recorded (no proposal)
    assert "Not recorded yet" in page and "data-confirm" in page
    assert not ResolutionProposal.objects.exists()
