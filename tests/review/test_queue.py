"""The queue: what waits on a person, its filters, counts and keyset pages."""

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from ledger import selectors, states
from ledger.errors import InvalidInput
from ledger.states import State
from review.templatetags.desk import stuck_for
from tests.factories import OperationFactory, RunFactory, add_evidence

QUEUE = reverse("review:queue")


def ambiguous(**kwargs):
    op = OperationFactory(state=State.RECONCILING, **kwargs)
    add_evidence(op, verdict="ambiguous", to_state=State.MANUAL_REVIEW,
                 observed={"matches": [{"id": "article-1"}, {"id": "article-2"}]})
    return op


def duplicate_pair():
    intent = {"title": "Same article", "body": "twice"}
    first = OperationFactory(state=State.SUCCEEDED, intent=intent, idempotency_key="dup-1")
    second = OperationFactory(state=State.SUCCEEDED, intent=intent, idempotency_key="dup-2")
    return first, second


def ids(page):
    return [op.operation_id for op in page.items]


@pytest.mark.django_db
def test_queue_lists_unknown_and_manual_review_and_not_settled_operations(client, reviewer):
    unknown = OperationFactory(state=State.OUTCOME_UNKNOWN)
    manual = OperationFactory(state=State.MANUAL_REVIEW)
    settled = [OperationFactory(state=s) for s in (State.SUCCEEDED, State.REJECTED,
                                                   State.SUBMITTED, State.SAFE_TO_RETRY)]
    client.force_login(reviewer)
    body = client.get(QUEUE).content.decode()
    assert unknown.operation_id in body and manual.operation_id in body
    for op in settled:
        assert op.operation_id not in body


@pytest.mark.django_db
def test_succeeded_twice_with_the_same_fingerprint_is_conflicting(reviewer):
    first, second = duplicate_pair()
    lone = OperationFactory(state=State.SUCCEEDED, intent={"title": "Only once"})
    page = selectors.review_queue(reviewer)
    assert set(ids(page)) == {first.operation_id, second.operation_id}
    assert all(op.is_duplicate for op in page.items)
    assert lone.operation_id not in ids(page)
    assert page.counts[selectors.CONFLICTING] == 2


@pytest.mark.django_db
def test_latest_evidence_ambiguous_with_several_matches_is_conflicting(reviewer):
    several = ambiguous()
    one_match = OperationFactory(state=State.RECONCILING)
    add_evidence(one_match, verdict="ambiguous", to_state=State.MANUAL_REVIEW,
                 observed={"matches": [{"id": "article-1"}]})
    page = selectors.review_queue(reviewer, selectors.QueueFilters(state=selectors.CONFLICTING))
    assert ids(page) == [several.operation_id]
    assert page.items[0].is_ambiguous and page.items[0].latest_verdict == "ambiguous"


@pytest.mark.django_db
def test_ambiguous_evidence_no_longer_conflicts_once_a_person_decided(reviewer):
    from ledger import receipts

    op = ambiguous()
    receipts.resolve(op, State.SUCCEEDED, user=reviewer, reason="found article-2 in the CMS")
    assert ids(selectors.review_queue(reviewer)) == []


@pytest.mark.django_db
def test_state_operation_and_tenant_filters_narrow_the_queue(client, reviewer):
    from ledger import access

    access.grant(reviewer, "acme")
    unknown = OperationFactory(state=State.OUTCOME_UNKNOWN)
    manual = OperationFactory(state=State.MANUAL_REVIEW, operation="emails.send")
    acme = OperationFactory(state=State.OUTCOME_UNKNOWN, tenant="acme")
    client.force_login(reviewer)

    def listed(**params):
        body = client.get(QUEUE, params).content.decode()
        return {op.operation_id for op in (unknown, manual, acme) if op.operation_id in body}

    assert listed(state="manual_review") == {manual.operation_id}
    assert listed(operation="emails.send") == {manual.operation_id}
    assert listed(tenant="acme") == {acme.operation_id}
    assert listed() == {unknown.operation_id, manual.operation_id, acme.operation_id}


@pytest.mark.django_db
def test_the_account_is_shown_and_filters_the_queue(client, reviewer):
    sales = OperationFactory(state=State.OUTCOME_UNKNOWN, account="sales@example.com")
    ops = OperationFactory(state=State.OUTCOME_UNKNOWN, account="ops@example.com")
    client.force_login(reviewer)
    body = client.get(QUEUE, {"account": "sales@example.com"}).content.decode()
    assert sales.operation_id in body and ops.operation_id not in body
    assert "as sales@example.com" in body
    detail = client.get(reverse("review:operation", args=[sales.operation_id])).content.decode()
    assert "<dt>Account</dt><dd class=\"mono wrap\">sales@example.com</dd>" in detail


@pytest.mark.django_db
def test_age_filter_keeps_only_operations_stuck_longer_than_asked(reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    three_hours = selectors.QueueFilters(older_than=timedelta(hours=3))
    assert ids(selectors.review_queue(reviewer, three_hours)) == []
    later = timezone.now() + timedelta(hours=4)
    assert ids(selectors.review_queue(reviewer, three_hours, now=later)) == [op.operation_id]


@pytest.mark.django_db
def test_search_finds_by_operation_id_external_id_or_key_whatever_the_state(client, reviewer):
    from ledger import receipts

    op = OperationFactory(state=State.SUBMITTED, idempotency_key="key-findme")
    receipts.mark_succeeded(op, external_id="article-777")
    other = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    for term in (op.operation_id, "article-777", "key-findme"):
        body = client.get(QUEUE, {"q": term}).content.decode()
        assert op.operation_id in body, term
        assert other.operation_id not in body, term


@pytest.mark.django_db
def test_newest_stuck_first_by_default_and_oldest_first_on_request(reviewer):
    ops = [OperationFactory(state=State.OUTCOME_UNKNOWN) for _ in range(3)]
    newest = ids(selectors.review_queue(reviewer))
    oldest = ids(selectors.review_queue(reviewer, selectors.QueueFilters(oldest_first=True)))
    assert newest == [op.operation_id for op in reversed(ops)]
    assert oldest == [op.operation_id for op in ops]


@pytest.mark.django_db
@pytest.mark.parametrize("oldest_first", [False, True])
def test_keyset_pages_cover_every_item_once(reviewer, oldest_first):
    ops = {OperationFactory(state=State.OUTCOME_UNKNOWN).operation_id for _ in range(7)}
    filters = selectors.QueueFilters(oldest_first=oldest_first)
    seen, cursor, pages = [], "", 0
    while True:
        page = selectors.review_queue(reviewer, filters, cursor=cursor, per_page=3)
        seen += ids(page)
        pages += 1
        if not page.next_cursor:
            break
        cursor = page.next_cursor
    assert pages == 3
    assert sorted(seen) == sorted(ops) and len(seen) == 7


@pytest.mark.django_db
def test_next_link_in_the_page_leads_to_the_rest(client, reviewer):
    ops = [OperationFactory(state=State.OUTCOME_UNKNOWN) for _ in range(3)]
    client.force_login(reviewer)
    first = client.get(QUEUE, {"per_page": 2})
    cursor = first.context["page"].next_cursor
    assert cursor and "cursor=" in first.content.decode()
    second = client.get(QUEUE, {"per_page": 2, "cursor": cursor}).content.decode()
    assert ops[0].operation_id in second and ops[2].operation_id not in second


@pytest.mark.django_db
def test_a_malformed_cursor_is_refused_with_a_message(client, reviewer):
    client.force_login(reviewer)
    response = client.get(QUEUE, {"cursor": "not-a-cursor"})
    assert response.status_code == 200
    assert "expected a page cursor" in response.content.decode()
    with pytest.raises(InvalidInput, match="expected a page cursor"):
        selectors.review_queue(reviewer, cursor="nope")


@pytest.mark.django_db
def test_counts_per_state_cover_the_whole_queue_not_only_the_page(client, reviewer):
    for _ in range(3):
        OperationFactory(state=State.OUTCOME_UNKNOWN)
    OperationFactory(state=State.MANUAL_REVIEW)
    client.force_login(reviewer)
    page = client.get(QUEUE, {"per_page": 1}).context["page"]
    assert page.counts == {State.OUTCOME_UNKNOWN: 3, State.MANUAL_REVIEW: 1,
                           selectors.CONFLICTING: 0}
    assert len(page.items) == 1


@pytest.mark.django_db
@pytest.mark.parametrize("per_page", [1, 50])
def test_queue_page_runs_a_fixed_number_of_queries(client, reviewer, per_page,
                                                   django_assert_num_queries):
    runs_ = [RunFactory(), RunFactory(), None]
    for n in range(55):
        OperationFactory(state=State.OUTCOME_UNKNOWN, run=runs_[n % 3])
    ambiguous()
    duplicate_pair()
    client.force_login(reviewer)
    # session, user, user perms, group perms, tenant grants, page (with each row's run),
    # grouped counts, conflicts, fact conflicts, overdue obligations
    with django_assert_num_queries(10):
        response = client.get(QUEUE, {"per_page": per_page})
    assert len(response.context["page"].items) == per_page


@pytest.mark.django_db
def test_htmx_request_gets_only_the_results_fragment(client, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    body = client.get(QUEUE, headers={"HX-Request": "true"}).content.decode()
    assert body.lstrip().startswith('<section id="results"')
    assert op.operation_id in body and "<html" not in body
    full = client.get(QUEUE).content.decode()
    assert "<html" in full and 'id="results"' in full


@pytest.mark.django_db
def test_queue_shows_how_long_each_operation_is_stuck(client, reviewer):
    OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    assert "Stuck for" in client.get(QUEUE).content.decode()
    now = timezone.now()
    assert stuck_for(now - timedelta(hours=3, minutes=10)) == "3 h"
    assert stuck_for(now - timedelta(minutes=12)) == "12 min"
    assert stuck_for(now - timedelta(days=2, hours=1)) == "2 d"


@pytest.mark.django_db
def test_the_queue_shows_only_granted_tenants(client, reviewer):
    mine = OperationFactory(state=State.OUTCOME_UNKNOWN)
    theirs = OperationFactory(state=State.OUTCOME_UNKNOWN, tenant="acme")
    client.force_login(reviewer)
    response = client.get(QUEUE, {"tenant": "acme"})
    assert theirs.operation_id not in response.content.decode()
    assert mine.operation_id in client.get(QUEUE).content.decode()
    assert response.context["page"].counts[State.OUTCOME_UNKNOWN] == 0


@pytest.mark.django_db
def test_the_queue_has_a_tab_with_its_count_for_each_state_of_the_table(client, reviewer):
    OperationFactory(state=State.MANUAL_REVIEW)
    client.force_login(reviewer)
    body = client.get(QUEUE).content.decode()
    counts = {State.OUTCOME_UNKNOWN: 0, State.MANUAL_REVIEW: 1}
    assert list(counts) == list(states.QUEUE_STATES)
    for state, count in counts.items():
        assert f'<b data-count="{state}">{count}</b>' in body
        assert f"?state={state}" in body
