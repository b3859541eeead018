"""Browsing every state on the queue page: the state filters, "All waiting"'s total, and
previous/next keyset pages."""

from datetime import timedelta

import pytest
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from ledger import selectors
from ledger.states import State
from tests.factories import OperationFactory

QUEUE = reverse("review:queue")


def ids(page):
    return [op.operation_id for op in page.items]


@pytest.fixture
def one_of_each(db):
    return {state: OperationFactory(state=state) for state in State.values}


def age(op, state_changed_at) -> None:
    """Move `op`'s last change into the past, as a superuser would: behind the triggers (no
    column of an operation changes without its event)."""
    with connection.cursor() as cursor:
        cursor.execute("SET session_replication_role = replica")
        cursor.execute("UPDATE ledger_operation SET state_changed_at = %s WHERE id = %s",
                       [state_changed_at, op.pk])
        cursor.execute("RESET session_replication_role")


@pytest.mark.django_db
@pytest.mark.parametrize("state", State.values)
def test_every_state_can_be_filtered_on_the_page(client, reviewer, one_of_each, state):
    client.force_login(reviewer)
    response = client.get(QUEUE, {"state": state})
    assert response.status_code == 200 and not response.context["form"].errors
    shown = ids(response.context["page"])
    assert shown == [one_of_each[state].operation_id]
    body = response.content.decode()
    for other, op in one_of_each.items():
        if other != state:
            assert op.operation_id not in body


@pytest.mark.django_db
def test_safe_to_retry_waiting_for_its_agent_and_stuck_submitted_are_browsable(
        client, reviewer):
    retry = OperationFactory(state=State.SAFE_TO_RETRY)
    stuck = OperationFactory(state=State.SUBMITTED)
    fresh = OperationFactory(state=State.SUBMITTED)
    age(stuck, timezone.now() - timedelta(hours=2))
    client.force_login(reviewer)
    body = client.get(QUEUE).content.decode()
    assert "safe to retry, waiting for its agent" in body
    assert retry.operation_id not in body  # not waiting on a person
    page = client.get(QUEUE, {"state": "safe_to_retry"}).context["page"]
    assert ids(page) == [retry.operation_id]
    page = client.get(QUEUE, {"state": "submitted", "age": "1h"}).context["page"]
    assert ids(page) == [stuck.operation_id]
    page = client.get(QUEUE, {"state": "submitted"}).context["page"]
    assert set(ids(page)) == {stuck.operation_id, fresh.operation_id}


@pytest.mark.django_db
def test_all_waiting_shows_the_total_including_settled_conflicting(client, reviewer):
    for state in (State.OUTCOME_UNKNOWN, State.OUTCOME_UNKNOWN, State.MANUAL_REVIEW):
        OperationFactory(state=state)
    intent = {"title": "twice"}
    OperationFactory(state=State.SUCCEEDED, intent=intent, idempotency_key="a")
    OperationFactory(state=State.SUCCEEDED, intent=intent, idempotency_key="b")
    OperationFactory(state=State.SUCCEEDED)  # settled, no conflict: not waiting
    client.force_login(reviewer)
    response = client.get(QUEUE)
    page = response.context["page"]
    assert page.total == 5 and not page.total_capped
    assert len(page.items) == 5
    assert '<b data-count="total">5</b>' in response.content.decode()
    # the other filters narrow the total too
    assert client.get(QUEUE, {"operation": "other.op"}).context["page"].total == 0


@pytest.mark.django_db
def test_previous_and_next_walk_the_same_pages_both_ways(reviewer):
    start = timezone.now() - timedelta(days=1)
    ops = [OperationFactory(state=State.OUTCOME_UNKNOWN) for _ in range(7)]
    for n, op in enumerate(ops):
        age(op, start + timedelta(minutes=n))
    newest_first = [op.operation_id for op in reversed(ops)]
    forward, page = [], selectors.review_queue(reviewer, per_page=3)
    assert page.previous_cursor == ""
    cursors = []
    while True:
        forward.append(ids(page))
        cursors.append(page)
        if not page.next_cursor:
            break
        page = selectors.review_queue(reviewer, cursor=page.next_cursor, per_page=3)
    assert forward == [newest_first[0:3], newest_first[3:6], newest_first[6:7]]
    back = selectors.review_queue(reviewer, before=page.previous_cursor, per_page=3)
    assert ids(back) == newest_first[3:6] and back.next_cursor and back.previous_cursor
    first = selectors.review_queue(reviewer, before=back.previous_cursor, per_page=3)
    assert ids(first) == newest_first[0:3] and first.previous_cursor == ""
    assert first.next_cursor == cursors[0].next_cursor


@pytest.mark.django_db
def test_previous_and_next_links_on_the_page(client, reviewer):
    for _ in range(3):
        OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    first = client.get(QUEUE, {"per_page": 2})
    body = first.content.decode()
    assert 'rel="next"' in body and 'rel="prev"' not in body
    second = client.get(QUEUE, {"per_page": 2, "cursor": first.context["page"].next_cursor})
    body = second.content.decode()
    assert 'rel="prev"' in body and 'rel="next"' not in body
    back = client.get(QUEUE, {"per_page": 2,
                              "before": second.context["page"].previous_cursor})
    assert ids(back.context["page"]) == ids(first.context["page"])


@pytest.mark.django_db
def test_a_malformed_before_cursor_is_a_form_error_not_a_crash(client, reviewer):
    client.force_login(reviewer)
    response = client.get(QUEUE, {"before": "yesterday"})
    assert response.status_code == 200
    assert "expected a page cursor" in response.content.decode()


@pytest.mark.django_db
def test_a_viewer_of_another_tenant_browses_none_of_default(client, other_tenant_reviewer,
                                                            one_of_each):
    client.force_login(other_tenant_reviewer)
    for state in State.values:
        page = client.get(QUEUE, {"state": state}).context["page"]
        assert page.items == [] and page.total == 0
