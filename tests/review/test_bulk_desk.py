"""Bulk decisions on the queue: ticked items or all matching, skipped ones listed, CSRF."""

import pytest
from django.test import Client
from django.urls import reverse

from ledger import receipts
from ledger.models import Operation
from ledger.states import State
from tests.factories import OperationFactory, UserFactory


def item(op):
    return f"{op.operation_id}@{op.version}"


@pytest.mark.django_db
def test_the_queue_offers_checkboxes_to_reviewers_only(client, reviewer, viewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    assert f'value="{item(op)}" form="bulk-form"' in client.get(
        reverse("review:queue")).content.decode()
    client.force_login(viewer)
    page = client.get(reverse("review:queue")).content.decode()
    assert "bulk-form" not in page


@pytest.mark.django_db
def test_ticked_items_are_decided_and_a_changed_one_is_listed_as_skipped(client, reviewer):
    ops = [OperationFactory(state=State.OUTCOME_UNKNOWN) for _ in range(3)]
    items = [item(op) for op in ops]
    receipts.resolve(ops[1], State.SUCCEEDED, user=UserFactory(username="fast",
                                                               role="reviewer"),
                     reason="seen")
    client.force_login(reviewer)
    response = client.post(reverse("review:bulk_resolve"), {
        "items": items, "to_state": State.ABANDONED, "reason": "never sent"},
        headers={"HX-Request": "true"})
    page = response.content.decode()
    assert response.status_code == 200 and "2 decided, 1 skipped" in page
    assert f'data-skipped="{ops[1].operation_id}"' in page and "changed meanwhile" in page
    assert [Operation.objects.get(pk=op.pk).state for op in ops] == [
        State.ABANDONED, State.SUCCEEDED, State.ABANDONED]


@pytest.mark.django_db
def test_all_matching_the_filter_takes_only_the_filtered_ones(client, reviewer):
    mail = [OperationFactory(state=State.MANUAL_REVIEW, operation="mail.send")
            for _ in range(3)]
    other = OperationFactory(state=State.MANUAL_REVIEW, operation="articles.create")
    client.force_login(reviewer)
    response = client.post(reverse("review:bulk_resolve"), {
        "all_matching": "on", "operation": "mail.send", "to_state": State.ABANDONED,
        "reason": "bounced"})
    assert response.status_code == 200 and "3 decided, 0 skipped" in response.content.decode()
    assert {Operation.objects.get(pk=op.pk).state for op in mail} == {State.ABANDONED}
    assert Operation.objects.get(pk=other.pk).state == State.MANUAL_REVIEW


@pytest.mark.django_db
def test_a_bulk_decision_needs_a_reason_a_selection_and_the_permission(client, reviewer,
                                                                       viewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    response = client.post(reverse("review:bulk_resolve"), {
        "items": [item(op)], "to_state": State.ABANDONED, "reason": " "})
    assert response.status_code == 422 and "A reason is required" in response.content.decode()
    response = client.post(reverse("review:bulk_resolve"), {
        "to_state": State.ABANDONED, "reason": "x"})
    assert response.status_code == 422 and "Tick at least one" in response.content.decode()
    client.force_login(viewer)
    assert client.post(reverse("review:bulk_resolve"), {
        "items": [item(op)], "to_state": State.ABANDONED, "reason": "x"}).status_code == 403
    csrf = Client(enforce_csrf_checks=True)
    csrf.force_login(reviewer)
    assert csrf.post(reverse("review:bulk_resolve"), {
        "items": [item(op)], "to_state": State.ABANDONED, "reason": "x"}).status_code == 403
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN
