"""The approval desk: the awaiting list, approve / deny / edit-and-approve, the two-person
rule, refusals (viewer, other tenant, CSRF, stale version) and the policies page."""

import json

import pytest
from django.test import Client
from django.urls import reverse

from ledger import approvals, receipts
from ledger.models import Approval, ApprovalPolicy, ApprovalRequest, Operation, OperationEvent
from ledger.states import State
from review.templatetags.desk import operation_url
from tests.factories import OperationFactory, UserFactory


def decide_url(op):
    return reverse("review:approval_decide", args=[op.operation_id])


def decide(client, op, action, *, reason="", intent=None, version=None, **extra):
    data = {"action": action, "reason": reason,
            "version": op.version if version is None else version}
    if intent is not None:
        data["intent"] = intent
    return client.post(decide_url(op), data, **extra)


@pytest.fixture
def policy(admin_user):
    return approvals.set_policy("payments.*", user=admin_user)


@pytest.fixture
def awaiting(policy):
    op = OperationFactory(operation="payments.send", intent={"to": "acct-1", "amount": 100})
    approvals.request(op, note="invoice <b>7</b> from ACME", actor="agent-7")
    return op


@pytest.mark.django_db
def test_the_awaiting_list_shows_the_request_with_its_note_and_intent(client, reviewer,
                                                                      awaiting):
    OperationFactory(operation="payments.send")  # under the policy, but nobody asked
    client.force_login(reviewer)
    page = client.get(reverse("review:awaiting")).content.decode()
    assert awaiting.operation_id in page and page.count("data-operation=") == 1
    assert "invoice &lt;b&gt;7&lt;/b&gt; from ACME" in page  # agent text escaped
    assert "0 of 1" in page
    detail = client.get(operation_url(awaiting)).content.decode()
    assert "Agent's note" in detail and "agent-7" in detail
    assert 'name="action" value="approve"' in detail


@pytest.mark.django_db
def test_the_awaiting_list_runs_a_fixed_number_of_queries(client, reviewer, policy,
                                                          django_assert_num_queries):
    for n in range(3):
        approvals.request(OperationFactory(operation="payments.send"), note=f"n{n}")
    client.force_login(reviewer)
    client.get(reverse("review:awaiting"))
    with django_assert_num_queries(6):
        client.get(reverse("review:awaiting"))
    for n in range(5):
        approvals.request(OperationFactory(operation="payments.send"), note=f"m{n}")
    with django_assert_num_queries(6):
        response = client.get(reverse("review:awaiting"))
    assert response.content.decode().count("data-operation=") == 8


@pytest.mark.django_db
def test_approve_records_the_approval_and_the_agent_may_send(client, reviewer, awaiting):
    client.force_login(reviewer)
    response = decide(client, awaiting, "approve", reason="invoice matches")
    assert response.status_code == 302 and response["Location"] == operation_url(awaiting)
    [approval] = Approval.objects.filter(operation=awaiting)
    assert (approval.decided_by, approval.reason, approval.version) == (reviewer,
                                                                        "invoice matches", 1)
    assert receipts.mark_submitted(awaiting).state == State.SUBMITTED
    page = client.get(operation_url(awaiting)).content.decode()
    assert "Recorded: Approve" in page and "invoice matches" in page


@pytest.mark.django_db
def test_deny_needs_a_reason_then_abandons(client, reviewer, awaiting):
    client.force_login(reviewer)
    response = decide(client, awaiting, "deny", reason="  ")
    assert response.status_code == 422 and "A reason is required to deny." in \
        response.content.decode()
    assert not Approval.objects.exists()
    response = decide(client, awaiting, "deny", reason="unknown supplier",
                      headers={"HX-Request": "true"})
    assert response.status_code == 200
    assert 'id="decision"' in response.content.decode()
    awaiting.refresh_from_db()
    assert (awaiting.state, awaiting.error_detail) == (State.ABANDONED, "unknown supplier")


@pytest.mark.django_db
def test_edit_and_approve_sends_the_edited_intent(client, reviewer, awaiting):
    client.force_login(reviewer)
    edited = json.dumps({"to": "acct-1", "amount": 50})
    response = decide(client, awaiting, "edit", reason="cap", intent=edited)
    assert response.status_code == 302
    current = Operation.objects.get(pk=awaiting.pk)
    assert current.intent == {"to": "acct-1", "amount": 50} and current.version == 2
    assert current.idempotency_key == awaiting.idempotency_key
    assert receipts.mark_submitted(current).state == State.SUBMITTED
    assert OperationEvent.objects.filter(operation=awaiting, from_state="planned",
                                         to_state="planned").count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("text, says", [
    ("{not json", "expected the edited intent to be JSON"),
    ("[1, 2]", "expected the edited intent to be a JSON object"),
    ("", "expected the edited intent to be a non-empty string"),
])
def test_an_edited_intent_that_is_not_a_json_object_is_refused(client, reviewer, awaiting,
                                                               text, says):
    client.force_login(reviewer)
    response = decide(client, awaiting, "edit", intent=text)
    assert response.status_code == 422 and says in response.content.decode()
    assert not Approval.objects.exists()


@pytest.mark.django_db
def test_a_decision_on_a_version_that_changed_is_refused_with_409(client, reviewer,
                                                                  awaiting):
    client.force_login(reviewer)
    seen = awaiting.version
    approvals.approve(awaiting, user=UserFactory(username="fast", role="reviewer"),
                      intent={"to": "acct-9", "amount": 1})
    response = decide(client, awaiting, "approve", version=seen,
                      headers={"HX-Request": "true"})
    assert response.status_code == 409
    assert "Nothing recorded: fast" in response.content.decode()
    assert Approval.objects.filter(decided_by=reviewer).count() == 0


@pytest.mark.django_db
def test_two_people_the_proposer_cannot_approve_again(client, reviewer, admin_user):
    approvals.set_policy("payments.*", user=admin_user, consequential=True)
    op = OperationFactory(operation="payments.send")
    client.force_login(reviewer)
    assert decide(client, op, "approve", reason="proposing").status_code == 302
    page = client.get(operation_url(op)).content.decode()
    assert "Proposed by reviewer" in page and "1 of 2" in page
    response = decide(client, op, "approve")
    assert response.status_code == 409 and "other than reviewer" in response.content.decode()
    second = Client()
    second.force_login(UserFactory(username="second", role="reviewer"))
    assert decide(second, op, "approve", reason="agreed").status_code == 302
    assert receipts.mark_submitted(op).state == State.SUBMITTED
    assert [(a.decided_by_name, a.reason) for a in Approval.objects.filter(operation=op)] == [
        ("reviewer", "proposing"), ("second", "agreed")]


@pytest.mark.django_db
def test_a_viewer_is_refused_and_sees_no_form(client, viewer, awaiting):
    client.force_login(viewer)
    assert decide(client, awaiting, "approve").status_code == 403
    page = client.get(operation_url(awaiting)).content.decode()
    assert 'name="action"' not in page and "cannot approve" in page
    assert not Approval.objects.exists()


@pytest.mark.django_db
def test_another_tenants_operation_is_not_found(client, awaiting, other_tenant_reviewer):
    client.force_login(other_tenant_reviewer)
    assert decide(client, awaiting, "approve").status_code == 404
    assert awaiting.operation_id not in client.get(reverse("review:awaiting")).content.decode()
    assert not Approval.objects.exists()


@pytest.mark.django_db
def test_a_decision_without_the_csrf_token_is_refused(reviewer, awaiting):
    client = Client(enforce_csrf_checks=True)
    client.force_login(reviewer)
    assert decide(client, awaiting, "approve").status_code == 403
    assert not Approval.objects.exists()


@pytest.mark.django_db
def test_the_policies_page_is_for_admins(client, admin_user, reviewer):
    client.force_login(reviewer)
    assert client.get(reverse("review:approval_policies")).status_code == 403
    assert client.post(reverse("review:approval_policy_set"), {
        "pattern": "payments.*", "tenant": "default", "approvals_needed": 1,
        "ttl_hours": 24}).status_code == 403
    client.force_login(admin_user)
    response = client.post(reverse("review:approval_policy_set"), {
        "pattern": "payments.*", "tenant": "default", "approvals_needed": 2, "ttl_hours": 4,
        "consequential": "on", "requires_approval": "on"})
    assert response.status_code == 302
    policy = ApprovalPolicy.objects.get()
    assert (policy.approvals_needed, policy.consequential, policy.approval_ttl.seconds) == (
        2, True, 4 * 3600)
    page = client.get(reverse("review:approval_policies")).content.decode()
    assert "payments.*" in page and "admin" in page
    response = client.post(reverse("review:approval_policy_set"), {
        "pattern": "bad pattern", "tenant": "default", "approvals_needed": 1,
        "ttl_hours": 4, "requires_approval": "on"})
    assert response.status_code == 422 and "Nothing written" in response.content.decode()


@pytest.mark.django_db
def test_an_approval_that_expired_before_sending_puts_the_request_back_on_the_list(
        client, reviewer, admin_user):
    from datetime import timedelta

    from django.utils import timezone

    approvals.set_policy("payments.*", user=admin_user, ttl=timedelta(hours=1))
    op = OperationFactory(operation="payments.send")
    approvals.request(op, note="pay")
    two_hours_ago = timezone.now() - timedelta(hours=2)
    approvals.approve(op, user=reviewer, now=two_hours_ago)
    # As if it had been approved two hours ago and the agent had not sent it since
    # (PostgreSQL admits `approved` only with the approvals live at `decided_at`).
    ApprovalRequest.objects.filter(operation=op).update(status="approved",
                                                        decided_at=two_hours_ago)
    client.force_login(reviewer)
    page = client.get(reverse("review:awaiting")).content.decode()
    assert f'data-operation="{op.operation_id}"' in page
    approvals.approve(op, user=UserFactory(username="later", role="reviewer"))
    page = client.get(reverse("review:awaiting")).content.decode()
    assert f'data-operation="{op.operation_id}"' not in page
