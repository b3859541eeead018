"""A reviewer's whole day at the desk: search by fragment, "next item" keeping the filter,
saved views, approval counts that agree, plain words where Python used to leak."""

import re
from datetime import timedelta

import pytest
from django.urls import reverse

from ledger import approvals, claims, notifications, receipts, saved_views
from ledger.errors import PermissionDenied
from ledger.models import SavedView
from ledger.states import State
from review.templatetags.desk import operation_url
from tests.factories import OperationFactory, UserFactory

QUEUE = reverse("review:queue")
PYTHON_REPRS = ("State.", "0:00:00", "{'", "True", "False", "None")


def visible_text(html: str) -> str:
    """The page's text as a person reads it: no tags, no attributes, no scripts."""
    html = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S)
    return re.sub(r"<[^>]+>", " ", html)


def assert_no_python(html: str) -> None:
    text = visible_text(html)
    found = [token for token in PYTHON_REPRS if re.search(rf"(?<![\w-]){re.escape(token)}", text)]
    assert not found, (found, [text[max(0, text.find(t) - 60): text.find(t) + 60] for t in found])


# --- search by fragment ---------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("fragment", ["suffix", "key", "external"])
def test_search_finds_an_operation_by_any_fragment(client, reviewer, fragment):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN, idempotency_key="order-7781-capture")
    settled = OperationFactory(state=State.SUBMITTED)
    receipts.mark_succeeded(settled, external_id="ch_3PqZ9extA1")
    other = OperationFactory(state=State.OUTCOME_UNKNOWN)
    term, wanted = {
        "suffix": (op.operation_id[-10:], op),
        "key": ("7781-capt", op),
        "external": ("PqZ9ext", settled),
    }[fragment]
    client.force_login(reviewer)
    items = client.get(QUEUE, {"q": term}).context["page"].items
    assert [row.operation_id for row in items] == [wanted.operation_id]
    assert other.operation_id not in {row.operation_id for row in items}


@pytest.mark.django_db
def test_a_two_character_search_must_be_a_whole_value(client, reviewer):
    OperationFactory(state=State.OUTCOME_UNKNOWN, idempotency_key="ab-1")
    whole = OperationFactory(state=State.OUTCOME_UNKNOWN, idempotency_key="ab")
    client.force_login(reviewer)
    items = client.get(QUEUE, {"q": "ab"}).context["page"].items
    assert [row.operation_id for row in items] == [whole.operation_id]


@pytest.mark.django_db
def test_search_stays_within_the_tenants_one_may_see(client, reviewer):
    hidden = OperationFactory(state=State.OUTCOME_UNKNOWN, tenant="other",
                              idempotency_key="shared-fragment-1")
    client.force_login(reviewer)
    page = client.get(QUEUE, {"q": "shared-fragment"})
    assert hidden.operation_id not in page.content.decode()


@pytest.mark.django_db
def test_a_fragment_search_runs_the_queues_queries(client, reviewer, django_assert_num_queries):
    for n in range(5):
        OperationFactory(state=State.OUTCOME_UNKNOWN, idempotency_key=f"batch-9-item-{n}")
    client.force_login(reviewer)
    # as the queue without a search (tests/review/test_queue.py): ten
    with django_assert_num_queries(10):
        response = client.get(QUEUE, {"q": "batch-9-item"})
    assert len(response.context["page"].items) == 5


@pytest.mark.django_db
def test_the_fragment_search_uses_the_trigram_index():
    from django.db import connection

    from ledger.models import Operation, OperationSearch
    from ledger.selectors.operations import _search

    # The search is the side table's LIKE, a subquery of the page's own query...
    condition = _search("c8ac46")
    [(_, subquery)] = condition.children
    assert subquery.model is OperationSearch
    assert "ledger_operationsearch" in str(Operation.objects.filter(condition).query)
    # ...which the trigram index serves: without a sequential scan or a b-tree walk to fall
    # back on, the planner takes it (on a table this small it may not choose it otherwise).
    sql, params = subquery.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_indexscan = off")
        cursor.execute("SET LOCAL enable_indexonlyscan = off")
        cursor.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "operation_search_text_idx" in plan, plan


@pytest.mark.django_db
def test_a_fragment_never_matches_across_id_and_key(client, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN, idempotency_key="zz-start")
    client.force_login(reviewer)
    across = op.operation_id[-3:] + "zz-"
    assert client.get(QUEUE, {"q": across}).context["page"].items == []
    literal = OperationFactory(state=State.OUTCOME_UNKNOWN, idempotency_key="a%b_c")
    items = client.get(QUEUE, {"q": "a%b_c"}).context["page"].items
    assert [row.operation_id for row in items] == [literal.operation_id]
    assert client.get(QUEUE, {"q": "a%b"}).context["page"].items[0] == literal
    assert client.get(QUEUE, {"q": "zzzb_"}).context["page"].items == []


# --- next item -----------------------------------------------------------------------


@pytest.mark.django_db
def test_next_item_keeps_the_filter_and_skips_the_one_just_decided(client, reviewer):
    first = OperationFactory(state=State.MANUAL_REVIEW, operation="crm.update")
    second = OperationFactory(state=State.MANUAL_REVIEW, operation="crm.update")
    OperationFactory(state=State.MANUAL_REVIEW, operation="email.send")  # outside the view
    client.force_login(reviewer)
    view = {"operation": "crm.update", "order": "oldest"}
    page = client.get(operation_url(first), view).content.decode()
    assert "/next/?operation=crm.update&amp;order=oldest&amp;after=" + first.operation_id in page
    response = client.post(
        reverse("review:resolve", args=[first.operation_id]) + "?operation=crm.update&order=oldest",
        {"to_state": State.ABANDONED, "reason": "checked", "version": first.version})
    assert response.url == operation_url(first) + "?operation=crm.update&order=oldest"
    response = client.get(reverse("review:queue_next"), {**view, "after": first.operation_id})
    assert response.url == operation_url(second) + "?operation=crm.update&order=oldest"
    receipts.resolve(second, State.ABANDONED, user=reviewer, reason="checked")
    response = client.get(reverse("review:queue_next"), {**view, "after": second.operation_id})
    assert response.url == QUEUE + "?operation=crm.update&order=oldest"


@pytest.mark.django_db
def test_next_item_runs_a_fixed_number_of_queries(client, reviewer, django_assert_num_queries):
    for _ in range(3):
        OperationFactory(state=State.MANUAL_REVIEW)
    client.force_login(reviewer)
    # session, user, user perms, group perms, tenant grants, the next item
    with django_assert_num_queries(6):
        client.get(reverse("review:queue_next"), {"state": State.MANUAL_REVIEW})


@pytest.mark.django_db
def test_a_decision_by_htmx_offers_the_next_item_with_the_focus(client, reviewer):
    op = OperationFactory(state=State.MANUAL_REVIEW)
    client.force_login(reviewer)
    html = client.post(reverse("review:resolve", args=[op.operation_id]) + "?state=manual_review",
                       {"to_state": State.ABANDONED, "reason": "gone", "version": op.version},
                       HTTP_HX_REQUEST="true").content.decode()
    assert "data-focus-next" in html and "after=" + op.operation_id in html
    assert "state=manual_review" in html


# --- saved views ---------------------------------------------------------------------


@pytest.mark.django_db
def test_a_saved_view_is_shared_within_its_tenant(client, reviewer):
    colleague = UserFactory(username="colleague", role="reviewer")
    outsider = UserFactory(username="outsider", role="reviewer", tenants=["other"])
    client.force_login(reviewer)
    response = client.post(reverse("review:save_view"), {
        "name": "CRM stuck > 1 h", "shared_in": "default", "operation": "crm.update",
        "age": "1h", "cursor": "ignored"})
    assert response.url == QUEUE + "?operation=crm.update&age=1h"
    view = SavedView.objects.get()
    assert (view.owner_name, view.filters) == ("reviewer", {"operation": "crm.update",
                                                           "age": "1h"})
    client.force_login(colleague)
    menu = client.get(reverse("review:saved_views"), HTTP_HX_REQUEST="true").content.decode()
    assert 'href="/?operation=crm.update&amp;age=1h"' in menu and "CRM stuck &gt; 1 h" in menu
    client.force_login(outsider)
    menu = client.get(reverse("review:saved_views"), HTTP_HX_REQUEST="true").content.decode()
    assert "data-saved-view=" not in menu and "none yet" in menu


@pytest.mark.django_db
def test_saving_a_name_again_replaces_ones_own_view(reviewer):
    saved_views.save(reviewer, "mine", tenant="default", filters={"state": "manual_review"})
    saved_views.save(reviewer, "mine", tenant="default", filters={"age": "24h"})
    assert list(SavedView.objects.values_list("name", "filters")) == [("mine", {"age": "24h"})]


@pytest.mark.django_db
def test_only_the_owner_deletes_a_view(client, reviewer):
    view = saved_views.save(reviewer, "mine", tenant="default", filters={})
    colleague = UserFactory(username="colleague", role="reviewer")
    with pytest.raises(PermissionDenied, match="owner of view 'mine' \\(reviewer\\)"):
        saved_views.delete(view, user=colleague)
    client.force_login(colleague)
    assert client.post(reverse("review:delete_view", args=[view.pk])).status_code == 403
    client.force_login(reviewer)
    client.post(reverse("review:delete_view", args=[view.pk]))
    assert not SavedView.objects.exists()


@pytest.mark.django_db
def test_a_view_cannot_be_saved_in_a_tenant_one_may_not_see(client, reviewer):
    with pytest.raises(PermissionDenied):
        saved_views.save(reviewer, "theirs", tenant="other", filters={})
    client.force_login(reviewer)
    assert client.post(reverse("review:save_view"),
                       {"name": "x", "shared_in": "other"}).status_code == 403


@pytest.mark.django_db
def test_the_saved_views_menu_runs_a_fixed_number_of_queries(client, reviewer,
                                                             django_assert_num_queries):
    for n in range(4):
        saved_views.save(reviewer, f"view {n}", tenant="default", filters={"age": "1h"})
    client.force_login(reviewer)
    # session, user, user perms, group perms, tenant grants, the views
    with django_assert_num_queries(6):
        response = client.get(reverse("review:saved_views"), HTTP_HX_REQUEST="true")
    assert response.content.decode().count("data-saved-view=") == 4


# --- approvals: one count, plain words -----------------------------------------------


@pytest.fixture
def two_person_payment(admin_user):
    approvals.set_policy("payments.*", user=admin_user, consequential=True,
                         ttl=timedelta(days=1))
    op = OperationFactory(operation="payments.send", intent={"to": "acct-1"})
    approvals.request(op, note="please")  # the request itself asks for one person
    return op


@pytest.mark.django_db
def test_the_awaiting_list_and_the_operation_say_the_same_count(client, reviewer,
                                                                two_person_payment):
    op = two_person_payment
    approvals.approve(op, user=reviewer, reason="looked")
    client.force_login(reviewer)
    listing = client.get(reverse("review:awaiting")).content.decode()
    detail = client.get(operation_url(op)).content.decode()
    assert "1 of 2" in listing
    assert "1 of 2 live approvals" in detail
    assert "Asked by approval policy <span" in detail  # not "polic"


@pytest.mark.django_db
def test_after_enough_approvals_the_page_says_so(client, reviewer, admin_user,
                                                 two_person_payment):
    op = two_person_payment
    approvals.approve(op, user=reviewer, reason="looked")
    approvals.approve(op, user=admin_user, reason="second look")
    client.force_login(reviewer)
    detail = client.get(operation_url(op)).content.decode()
    assert "2 of 2 live approvals" in detail
    assert "the agent may send it" in detail
    assert "the next approval must be someone else" not in detail
    assert "No operation awaits approval" in client.get(reverse("review:awaiting")).content.decode()


@pytest.mark.django_db
def test_policy_and_channel_pages_write_no_python(client, admin_user, two_person_payment):
    notifications.create_channel("on-call", user=admin_user, tenant="default", kind="email",
                                 pattern="*", recipients=["oncall@example.com"],
                                 stuck_after=timedelta(hours=1))
    client.force_login(admin_user)
    policies = client.get(reverse("review:approval_policies")).content.decode()
    assert "1 d" in policies
    assert_no_python(policies)
    channels = client.get(reverse("review:notifications")).content.decode()
    assert "stuck &gt; 1 h" in channels and "oncall@example.com" in channels
    assert_no_python(channels)


# --- a never-retry item, claims, audit rows ------------------------------------------


@pytest.mark.django_db
def test_a_reviewer_is_told_why_safe_to_retry_is_not_offered(client, reviewer, admin_user):
    op = OperationFactory(state=State.MANUAL_REVIEW, retry_policy="never")
    client.force_login(reviewer)
    page = client.get(operation_url(op)).content.decode()
    assert 'value="safe_to_retry"' not in page
    assert "only an admin may mark it safe to retry" in page
    client.force_login(admin_user)
    page = client.get(operation_url(op)).content.decode()
    assert 'value="safe_to_retry"' in page and "only an admin may" not in page


@pytest.mark.django_db
def test_a_claim_ends_with_the_decision(client, reviewer):
    op = OperationFactory(state=State.MANUAL_REVIEW)
    claims.claim(op, user=reviewer)
    client.force_login(reviewer)
    assert "Keep claim 15 min more" in client.get(operation_url(op)).content.decode()
    receipts.resolve(op, State.ABANDONED, user=reviewer, reason="gone")
    page = client.get(operation_url(op)).content.decode()
    assert "Keep claim" not in page and "is looking at this" not in page
    assert "Add a note" in page  # notes stay possible on a settled item


@pytest.mark.django_db
def test_a_claim_message_is_relative(client, reviewer):
    op = OperationFactory(state=State.MANUAL_REVIEW)
    client.force_login(reviewer)
    response = client.post(reverse("review:claim", args=[op.operation_id]), follow=True)
    text = response.content.decode()
    assert re.search(r"Claimed for 1[45] min", text), visible_text(text)
    assert "UTC;" not in text


@pytest.mark.django_db
def test_audit_rows_name_an_unnamed_agent_and_drop_a_dangling_colon(client, reviewer):
    op = OperationFactory(state=State.SUBMITTED)
    receipts.mark_outcome_unknown(op, error_code="Timeout")
    client.force_login(reviewer)
    page = client.get(reverse("review:audit")).content.decode()
    assert "(in-process, unnamed)" in page
    assert "Timeout:" not in visible_text(page)
    assert_no_python(page)
