"""The live queue: what an open queue polls (counts in place, a notice when rows changed)."""

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from ledger import selectors
from ledger.states import State
from tests.factories import OperationFactory

QUEUE = reverse("review:queue")
LIVE = reverse("review:queue_live")


def poll_params(response):
    """The since/seen the queue page handed its poller."""
    live = response.context["live"]
    return {"since": live["since"], "seen": live["seen"]}


@pytest.mark.django_db
def test_the_queue_page_carries_a_poller_for_its_own_filters(client, reviewer):
    OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    body = client.get(QUEUE, {"state": "manual_review", "age": "1h"}).content.decode()
    assert 'id="queue-poll"' in body and 'hx-trigger="every 10s' in body
    poller = body[body.index('id="queue-poll"'):].split(">", 1)[0]
    assert "state=manual_review" in poller and "age=1h" in poller and "since=" in poller


@pytest.mark.django_db
def test_nothing_changed_gives_the_counts_and_no_notice(client, reviewer):
    OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    params = poll_params(client.get(QUEUE))
    body = client.get(LIVE, params, headers={"HX-Request": "true"}).content.decode()
    assert body.lstrip().startswith('<nav class="counts" id="queue-counts"')
    assert '<b data-count="total">1</b>' in body
    assert 'id="queue-fresh"' in body and 'data-changed' not in body
    assert "<html" not in body


@pytest.mark.django_db
def test_a_new_item_updates_the_counts_and_offers_to_show_it(client, reviewer):
    OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    params = poll_params(client.get(QUEUE, {"operation": "articles.create"}))
    OperationFactory(state=State.MANUAL_REVIEW)
    OperationFactory(state=State.MANUAL_REVIEW, operation="mail.send")  # filtered out
    body = client.get(LIVE, {**params, "operation": "articles.create"}).content.decode()
    assert '<b data-count="total">2</b>' in body
    assert 'data-changed="true"' in body and "1 new item since you loaded it" in body
    # "show" loads the same filtered view, without the poller's own parameters
    assert 'href="/?operation=articles.create"' in body
    assert "since=" not in body.split('id="queue-fresh"')[1]


@pytest.mark.django_db
def test_an_item_resolved_elsewhere_changes_the_counts_and_is_noticed(client, reviewer):
    op = OperationFactory(state=State.MANUAL_REVIEW)
    OperationFactory(state=State.MANUAL_REVIEW)
    client.force_login(reviewer)
    params = poll_params(client.get(QUEUE))
    from ledger import receipts

    receipts.resolve(op, State.ABANDONED, user=reviewer, reason="checked: never sent")
    body = client.get(LIVE, params).content.decode()
    assert '<b data-count="total">1</b>' in body
    assert "The queue changed since you loaded it" in body


@pytest.mark.django_db
def test_new_counts_only_the_view_and_items_newer_than_since(reviewer):
    OperationFactory(state=State.OUTCOME_UNKNOWN)
    OperationFactory(state=State.MANUAL_REVIEW)
    past = timezone.now() - timedelta(minutes=1)
    pulse = selectors.queue_pulse(reviewer, selectors.QueueFilters(state="manual_review"),
                                  since=past)
    assert (pulse.new, pulse.total) == (1, 2)
    later = selectors.queue_pulse(reviewer, since=timezone.now())
    assert later.new == 0 and later.signature == pulse.signature


@pytest.mark.django_db
def test_live_counts_only_granted_tenants(client, reviewer):
    OperationFactory(state=State.OUTCOME_UNKNOWN, tenant="acme")
    client.force_login(reviewer)
    body = client.get(LIVE, {"since": (timezone.now() - timedelta(hours=1)).isoformat()})
    text = body.content.decode()
    assert '<b data-count="total">0</b>' in text and "new item" not in text


@pytest.mark.django_db
def test_a_malformed_since_still_answers_with_the_counts(client, reviewer):
    OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    response = client.get(LIVE, {"since": "<script>", "seen": "x"})
    assert response.status_code == 200
    assert "<script>" not in response.content.decode()


@pytest.mark.django_db
def test_live_is_read_only(client, reviewer):
    client.force_login(reviewer)
    assert client.post(LIVE).status_code == 405


@pytest.mark.django_db
@pytest.mark.parametrize("items", [1, 40])
def test_live_runs_a_fixed_number_of_queries(client, reviewer, items,
                                             django_assert_num_queries):
    for n in range(items):
        OperationFactory(state=State.OUTCOME_UNKNOWN if n % 2 else State.MANUAL_REVIEW)
    client.force_login(reviewer)
    params = poll_params(client.get(QUEUE))
    # session, user, user perms, group perms, tenant grants, grouped counts, conflicts,
    # new since, fact conflicts, overdue obligations
    with django_assert_num_queries(10):
        response = client.get(LIVE, params, headers={"HX-Request": "true"})
    assert response.status_code == 200


@pytest.mark.django_db
def test_show_loads_the_same_page_of_the_same_view(client, reviewer):
    for _ in range(3):
        OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    first = client.get(QUEUE, {"per_page": 2, "order": "oldest"})
    cursor = first.context["page"].next_cursor
    second = client.get(QUEUE, {"per_page": 2, "order": "oldest", "cursor": cursor})
    poller = second.content.decode().split('id="queue-poll"', 1)[1].split(">", 1)[0]
    assert "cursor=" in poller and "order=oldest" in poller
    OperationFactory(state=State.MANUAL_REVIEW)
    live = client.get(LIVE, {**poll_params(second), "per_page": 2, "order": "oldest",
                             "cursor": cursor}).content.decode()
    notice = live.split('id="queue-fresh"', 1)[1]
    assert "1 new item" in notice and "cursor=" in notice and "order=oldest" in notice
