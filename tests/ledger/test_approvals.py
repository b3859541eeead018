"""Approval before a call, bound to the exact intent: ledger.approvals and its gate in
PostgreSQL."""

import threading
from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, connections, transaction
from django.utils import timezone

from ledger import approvals, errors, receipts
from ledger.models import Approval, ApprovalPolicyChange, ApprovalRequest, Operation
from ledger.models import OperationEvent as Event
from ledger.states import ActorKind, State
from tests.factories import OperationFactory, UserFactory
from tests.support.loops import run_coroutine


@pytest.fixture
def policy(admin_user):
    return approvals.set_policy("payments.*", user=admin_user)


def payment(**kwargs):
    return OperationFactory(operation="payments.send", intent=kwargs.pop(
        "intent", {"to": "acct-1", "amount": 100}), **kwargs)


def raw_submit(op):
    """What a caller bypassing the ledger would run: the bare state change, with its event
    (the event is not the point here; the approval gate is)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "UPDATE ledger_operation SET state = 'submitted', version = version + 1 "
            "WHERE id = %s", [op.pk])


@pytest.mark.django_db
def test_an_operation_under_a_policy_is_not_submitted_without_approval(policy):
    op = payment()
    with pytest.raises(errors.ApprovalRequired) as refused:
        receipts.mark_submitted(op)
    assert "expected 1 live approval(s)" in str(refused.value)
    assert "payments.*" in str(refused.value) and "found 0" in str(refused.value)
    op.refresh_from_db()
    assert op.state == State.PLANNED


@pytest.mark.django_db
def test_an_operation_no_policy_matches_is_submitted_as_before(policy):
    op = OperationFactory(operation="articles.create")
    assert receipts.mark_submitted(op).state == State.SUBMITTED


@pytest.mark.django_db
def test_approval_of_the_intent_lets_it_be_submitted(policy, reviewer):
    op = payment()
    approvals.request(op, note="paying invoice 7")
    approvals.approve(op, user=reviewer, reason="invoice checked")
    assert receipts.mark_submitted(op).state == State.SUBMITTED
    [approval] = Approval.objects.filter(operation=op)
    assert (approval.decision, approval.intent_fingerprint, approval.version,
            approval.decided_by) == ("approve", op.intent_fingerprint, 1, reviewer)
    assert ApprovalRequest.objects.get(operation=op).status == "approved"


@pytest.mark.django_db
def test_approval_of_fingerprint_a_does_not_allow_sending_intent_b(policy, reviewer):
    approved = payment(intent={"to": "acct-1", "amount": 100})
    other = payment(intent={"to": "acct-1", "amount": 100_000})
    approvals.approve(approved, user=reviewer)
    with pytest.raises(errors.ApprovalRequired):
        receipts.mark_submitted(other)
    # An approval row of A's fingerprint on B cannot be faked through the API, and a raw
    # submit of B is refused by PostgreSQL.
    with pytest.raises(IntegrityError, match="expected 1 live approval"):
        raw_submit(other)


@pytest.mark.django_db
def test_an_agent_holding_the_intent_from_before_an_edit_cannot_send_it(policy, reviewer):
    op = payment(intent={"to": "acct-1", "amount": 100})
    stale = Operation.objects.get(pk=op.pk)
    approvals.approve(op, user=reviewer, reason="cap the amount",
                      intent={"to": "acct-1", "amount": 50})
    with pytest.raises(errors.ApprovalRequired, match="a reviewer edited it"):
        receipts.mark_submitted(stale)


@pytest.mark.django_db
def test_edit_approve_sends_the_edited_intent_only(policy, reviewer):
    op = payment(intent={"to": "acct-1", "amount": 100})
    key, original = op.idempotency_key, op.intent_fingerprint
    approvals.request(op)
    approved = approvals.wait(approvals.approve(
        op, user=reviewer, reason="cap the amount", intent={"to": "acct-1", "amount": 50},
    ), timeout=0)
    assert approved.intent == {"to": "acct-1", "amount": 50}
    assert approved.idempotency_key == key and approved.intent_fingerprint != original
    assert approved.version == 2
    sent = receipts.mark_submitted(approved)
    sent.refresh_from_db()
    assert (sent.state, sent.intent) == (State.SUBMITTED, {"to": "acct-1", "amount": 50})
    edit = Event.objects.get(operation=op, version=2)
    assert (edit.from_state, edit.to_state, edit.actor_kind, edit.actor_id) == (
        "planned", "planned", ActorKind.HUMAN, "reviewer")
    assert edit.evidence == {"edited_from": original, "edited_to": sent.intent_fingerprint}
    assert "cap the amount" in edit.reason
    [approval] = Approval.objects.filter(operation=op)
    assert (approval.edited_from, approval.intent_fingerprint, approval.version) == (
        original, sent.intent_fingerprint, 1)


@pytest.mark.django_db
def test_an_edited_intent_is_masked_and_checked_like_a_recorded_one(policy, reviewer):
    op = payment()
    approvals.approve(op, user=reviewer, intent={"to": "acct-1", "api_key": "sk-live-123"})
    op.refresh_from_db()
    assert "sk-live-123" not in str(op.intent)
    with pytest.raises(errors.InvalidInput, match="JSON object"):
        approvals.approve(op, user=UserFactory(username="r2", role="reviewer"), intent=[1])


@pytest.mark.django_db
def test_postgres_refuses_a_new_fingerprint_nobody_approved(policy):
    op = payment()
    with pytest.raises(IntegrityError, match="expected a new intent only with a person"):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("UPDATE ledger_operation SET intent_fingerprint = 'forged', "
                           "version = version + 1 WHERE id = %s", [op.pk])


@pytest.mark.django_db
def test_denial_blocks_sending_and_the_agent_sees_the_reason(policy, reviewer):
    op = payment()
    approvals.request(op)
    agent_copy = Operation.objects.get(pk=op.pk)
    approvals.deny(op, user=reviewer, reason="not our supplier")
    assert (op.state, op.error_code, op.error_detail) == (
        State.ABANDONED, "ApprovalDenied", "not our supplier")
    with pytest.raises(errors.ApprovalDenied) as denied:
        receipts.mark_submitted(agent_copy)
    assert denied.value.reason == "not our supplier"
    with pytest.raises(errors.ApprovalDenied):
        approvals.wait(agent_copy, timeout=0)
    assert ApprovalRequest.objects.get(operation=op).status == "denied"
    event = Event.objects.filter(operation=op).latest("version")
    assert (event.to_state, event.actor_kind, event.actor_id) == ("abandoned", "human",
                                                                 "reviewer")


@pytest.mark.django_db
def test_a_denial_needs_a_reason(policy, reviewer):
    op = payment()
    with pytest.raises(errors.InvalidInput, match="non-empty reason"):
        approvals.deny(op, user=reviewer, reason="  ")
    assert not Approval.objects.exists()


@pytest.mark.django_db
def test_an_expired_approval_does_not_count(admin_user, reviewer):
    approvals.set_policy("payments.*", user=admin_user, ttl=timedelta(hours=1))
    op = payment()
    approvals.approve(op, user=reviewer, now=timezone.now() - timedelta(hours=2))
    with pytest.raises(errors.ApprovalRequired, match="found 0"):
        receipts.mark_submitted(op)
    with pytest.raises(IntegrityError, match="expected 1 live approval"):
        raw_submit(op)


@pytest.mark.django_db
def test_raw_update_to_submitted_without_approval_is_refused_by_postgres(policy):
    op = payment()
    with pytest.raises(IntegrityError, match="expected 1 live approval.*found 0"):
        raw_submit(op)


@pytest.mark.django_db
def test_an_agents_request_gates_its_operation_even_without_a_policy(reviewer):
    op = OperationFactory(operation="articles.create")
    approvals.request(op, note="first article of a new author")
    with pytest.raises(errors.ApprovalRequired, match="the agent's request"):
        receipts.mark_submitted(op)
    approvals.approve(op, user=reviewer)
    assert receipts.mark_submitted(op).state == State.SUBMITTED


@pytest.mark.django_db
def test_approving_needs_the_permission_and_the_tenant(policy, viewer):
    other_tenant_reviewer = UserFactory(username="acme", role="reviewer", tenants=["acme"])
    op = payment()
    with pytest.raises(errors.PermissionDenied, match="ledger.resolve_operation"):
        approvals.approve(op, user=viewer)
    with pytest.raises(errors.PermissionDenied, match="tenant 'default'"):
        approvals.deny(op, user=other_tenant_reviewer, reason="no")
    assert not Approval.objects.exists()


@pytest.mark.django_db
def test_a_decision_on_a_version_that_changed_since_is_refused(policy, reviewer):
    op = payment()
    seen = Operation.objects.get(pk=op.pk)
    approvals.approve(op, user=reviewer, intent={"to": "acct-2", "amount": 1})
    other = UserFactory(username="second", role="reviewer")
    with pytest.raises(errors.StaleVersion, match="expected operation .* at version 1"):
        approvals.approve(seen, user=other)
    with pytest.raises(errors.StaleVersion):
        approvals.deny(seen, user=other, reason="no")
    assert Approval.objects.count() == 1


@pytest.mark.django_db
def test_setting_a_policy_needs_the_admin_permission_and_is_audited(admin_user, reviewer):
    with pytest.raises(errors.PermissionDenied, match="ledger.change_approvalpolicy"):
        approvals.set_policy("payments.*", user=reviewer)
    approvals.set_policy("payments.*", user=admin_user)
    approvals.set_policy("payments.*", user=admin_user)  # unchanged: no second record
    approvals.set_policy("payments.*", user=admin_user, approvals_needed=2)
    changes = list(ApprovalPolicyChange.objects.order_by("changed_at", "id"))
    assert [c.before and c.before["approvals_needed"] for c in changes] == [None, 1]
    assert changes[-1].after["approvals_needed"] == 2
    with pytest.raises(errors.InvalidInput, match="approvals_needed of 1 or 2"):
        approvals.set_policy("payments.*", user=admin_user, approvals_needed=3)
    with pytest.raises(errors.InvalidInput, match="pattern"):
        approvals.set_policy("payments %", user=admin_user)


@pytest.mark.django_db
def test_patterns_match_like_globs(admin_user):
    approvals.set_policy("mail:send_?", user=admin_user)
    assert approvals.gate(OperationFactory(operation="mail:send_1")).needed == 1
    assert approvals.gate(OperationFactory(operation="mail:sendx1")).needed == 0
    assert approvals.gate(OperationFactory(operation="mail:send_12")).needed == 0


@pytest.mark.django_db
def test_approved_events_cannot_be_rewritten(policy, reviewer):
    op = payment()
    approvals.approve(op, user=reviewer)
    with pytest.raises(Exception, match="Cannot update or delete"):
        with transaction.atomic():
            Approval.objects.update(reason="rewritten")


# --- two people ----------------------------------------------------------------------------


@pytest.fixture
def two_people(admin_user):
    return approvals.set_policy("payments.*", user=admin_user, consequential=True)


@pytest.mark.django_db
def test_a_consequential_operation_takes_a_proposer_and_a_different_approver(two_people,
                                                                             reviewer):
    op = payment()
    approvals.approve(op, user=reviewer, reason="proposing")
    with pytest.raises(errors.ApprovalRequired, match="expected 2 live approval.*found 1"):
        receipts.mark_submitted(op)
    with pytest.raises(errors.SecondPersonRequired, match="other than reviewer"):
        approvals.approve(op, user=reviewer)
    approvals.approve(op, user=UserFactory(username="second", role="reviewer"))
    assert receipts.mark_submitted(op).state == State.SUBMITTED
    assert [a.decided_by_name for a in Approval.objects.filter(operation=op)] == [
        "reviewer", "second"]


@pytest.mark.django_db
def test_an_edit_by_the_proposer_needs_a_second_person_for_the_new_intent(two_people,
                                                                         reviewer):
    op = payment()
    second = UserFactory(username="second", role="reviewer")
    approvals.approve(op, user=second)
    approvals.approve(op, user=reviewer, intent={"to": "acct-1", "amount": 5})
    with pytest.raises(errors.ApprovalRequired, match="found 1"):
        receipts.mark_submitted(op)
    approvals.approve(op, user=second)
    assert receipts.mark_submitted(op).state == State.SUBMITTED


# --- waiting ---------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_wait_returns_when_another_thread_approves(admin_user, reviewer):
    approvals.set_policy("payments.*", user=admin_user)
    op = payment()
    approvals.request(op, note="waiting in a thread")
    waiting = threading.Event()

    def reviewer_thread():
        try:
            waiting.wait(timeout=30)
            approvals.approve(Operation.objects.get(pk=op.pk), user=reviewer)
        finally:
            connections.close_all()

    thread = threading.Thread(target=reviewer_thread)
    thread.start()
    with pytest.raises(errors.ApprovalRequired, match="within 0 s"):
        approvals.wait(op, timeout=0)
    waiting.set()
    approved = approvals.wait(op, timeout=60)
    thread.join()
    assert Approval.objects.filter(operation=op).count() == 1
    assert receipts.mark_submitted(approved).state == State.SUBMITTED


@pytest.mark.django_db(transaction=True)
def test_await_decision_raises_the_denial_of_another_thread(admin_user, reviewer):
    approvals.set_policy("payments.*", user=admin_user)
    op = payment()
    started = threading.Event()

    def reviewer_thread():
        try:
            started.wait(timeout=30)
            approvals.deny(Operation.objects.get(pk=op.pk), user=reviewer, reason="too much")
        finally:
            connections.close_all()

    async def agent():
        from asgiref.sync import sync_to_async

        started.set()
        try:
            return await approvals.await_decision(op, timeout=60)
        finally:
            # The ledger's worker thread keeps its connection; close it for the test database.
            await sync_to_async(connections.close_all)()

    thread = threading.Thread(target=reviewer_thread)
    thread.start()
    with pytest.raises(errors.ApprovalDenied) as denied:
        run_coroutine(agent())
    thread.join()
    assert denied.value.reason == "too much"


@pytest.mark.django_db
def test_check_can_submit_costs_one_query(policy, reviewer, django_assert_num_queries):
    op = payment()
    approvals.approve(op, user=reviewer)
    with django_assert_num_queries(1):
        approvals.check_can_submit(op)


@pytest.mark.django_db
def test_the_purge_removes_an_operations_approvals_with_it(policy, reviewer):
    from ledger import retention
    from tests.support.retention import complete_days_ago

    op = payment()
    approvals.request(op, note="purged later")
    approvals.approve(op, user=reviewer)
    receipts.mark_submitted(op)
    receipts.mark_succeeded(op)
    complete_days_ago(op, 400)
    result = retention.purge(actor="test")
    assert op.operation_id in result.purged_operation_ids
    assert not Approval.objects.filter(operation_id=op.pk).exists()
    assert not ApprovalRequest.objects.filter(operation_id=op.pk).exists()
