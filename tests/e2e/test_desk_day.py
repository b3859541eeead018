"""A reviewer's whole day in a real browser: the keyboard alone from the queue's first
row to a settled item and on to the next, saved views, the bulk decision that leaves the
list, approval counts that agree, and no Python anywhere on a desk page."""

import re
from datetime import timedelta

import pytest

from ledger import approvals, receipts, reconcile, saved_views
from ledger.states import State
from tests.e2e.conftest import log_in, screenshot
from tests.e2e.test_desk_operator import PHONE, PHONE_PAGES, notified  # noqa: F401
from tests.factories import OperationFactory, UserFactory, ensure_roles
from tests.review.execution_setup import busy_run, make_conflict

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PYTHON_REPRS = ("State.", "0:00:00", "{'", "True")


@pytest.fixture(autouse=True)
def roles(transactional_db):
    ensure_roles()


# The contrast ratio (WCAG) of an element's text colour against its background colour.
CONTRAST_JS = """selector => {
    const style = getComputedStyle(document.querySelector(selector));
    const lum = css => {
        const [r, g, b] = css.match(/[\\d.]+/g).slice(0, 3).map(Number).map(v => {
            v /= 255;
            return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
        });
        return 0.2126 * r + 0.7152 * g + 0.0722 * b;
    };
    const [a, b] = [lum(style.color), lum(style.backgroundColor)].sort((x, y) => y - x);
    return (a + 0.05) / (b + 0.05);
}"""


def active(page, expression: str):
    return page.evaluate(f"() => {{ const el = document.activeElement; return {expression}; }}")


def test_keyboard_only_from_the_first_row_to_a_settled_item_and_the_next(browser_page):
    page = browser_page
    reviewer = UserFactory(username="reviewer", role="reviewer")
    first = OperationFactory(state=State.MANUAL_REVIEW, operation="crm.update")
    second = OperationFactory(state=State.MANUAL_REVIEW, operation="crm.update")
    OperationFactory(state=State.OUTCOME_UNKNOWN, operation="email.send")
    log_in(page, "reviewer")
    page.goto("/?operation=crm.update&order=oldest")

    # Tab reaches the skip link, Enter jumps to the queue, the next Tab is in its first row.
    tabs = 0
    page.keyboard.press("Tab")
    tabs += 1
    assert active(page, "el.className") == "skip-link"
    page.keyboard.press("Enter")
    assert active(page, "el.id") == "queue-start"
    first_row = "#results table.queue tbody tr:first-child"
    while not page.evaluate(f"() => document.querySelector('{first_row}')"
                            ".contains(document.activeElement)"):
        page.keyboard.press("Tab")
        tabs += 1
        assert tabs <= 3, active(page, "el.outerHTML")
    # the row's link (after its tick box), and Enter opens the item
    while active(page, "el.tagName") != "A":
        page.keyboard.press("Tab")
        tabs += 1
    assert tabs <= 3
    assert active(page, "el.textContent") == first.operation_id
    page.keyboard.press("Enter")
    page.wait_for_url(f"**/operations/{first.operation_id}/?operation=crm.update&order=oldest")

    # a: Abandon chosen, the reason has the focus; Ctrl+Enter records it.
    page.keyboard.press("a")
    assert active(page, "el.id") == "id_reason"
    assert page.get_attribute("button[value=abandoned]", "aria-pressed") == "true"
    page.keyboard.type("Checked the CRM: never updated; the agent gave up")
    page.keyboard.press("Control+Enter")
    page.locator("#decision >> text=Recorded: Abandon").wait_for()
    first.refresh_from_db()
    assert first.state == State.ABANDONED
    # "Next item" has the focus: Enter goes on, the filter kept.
    page.wait_for_function("() => document.activeElement.hasAttribute('data-next')",
                           timeout=5000)
    assert "Keep claim" not in page.locator("#decision").inner_text()
    # Its n keycap reads on the focused (primary) button: dark on light, not white on white.
    assert page.evaluate(CONTRAST_JS, "a[data-next] kbd") >= 4.5
    page.keyboard.press("Enter")
    page.wait_for_url(f"**/operations/{second.operation_id}/?operation=crm.update&order=oldest")
    # n from there: nothing else waits in this view; back to the filtered queue.
    receipts.resolve(second, State.ABANDONED, user=reviewer, reason="done elsewhere")
    page.keyboard.press("n")
    page.wait_for_url("**/?operation=crm.update&order=oldest")
    assert "Nothing else waits in this view" in page.locator("main").inner_text()
    assert page.console_errors == []


def test_ctrl_enter_without_a_chosen_decision_asks_for_one(browser_page):
    page = browser_page
    UserFactory(username="reviewer", role="reviewer")
    op = OperationFactory(state=State.MANUAL_REVIEW)
    log_in(page, "reviewer")
    page.goto(f"/operations/{op.operation_id}/")
    page.fill("#id_reason", "looked")
    page.focus("#id_reason")
    page.keyboard.press("Control+Enter")
    page.locator("text=Choose a decision first").wait_for()
    op.refresh_from_db()
    assert op.state == State.MANUAL_REVIEW


def test_a_fragment_finds_the_operation_and_a_saved_view_brings_the_filter_back(browser_page):
    from playwright.sync_api import expect

    page = browser_page
    UserFactory(username="reviewer", role="reviewer")
    UserFactory(username="colleague", role="reviewer")
    wanted = OperationFactory(state=State.OUTCOME_UNKNOWN, idempotency_key="refund-77812-x")
    OperationFactory(state=State.OUTCOME_UNKNOWN)
    log_in(page, "reviewer")
    page.keyboard.press("/")
    page.keyboard.type(wanted.operation_id[-10:])
    page.keyboard.press("Enter")
    page.wait_for_url("**q=**")
    # the URL moves with the swap: wait for the rows themselves
    expect(page.locator("#results table.queue tbody tr")).to_have_count(1)
    expect(page.locator("#results")).to_contain_text(wanted.operation_id)

    page.goto("/?state=outcome_unknown&age=15m")
    page.locator("#saved-views summary").click()  # the menu loads after the page
    page.fill("#saved-views input[name=name]", "Unknown for a while")
    page.click("#saved-views button[type=submit]")
    page.locator("text=Saved the view").wait_for()
    expect(page.locator("#saved-views a[data-saved-view='Unknown for a while']")).to_have_count(1)

    page.context.clear_cookies()
    log_in(page, "colleague")
    page.locator("#saved-views a[data-saved-view='Unknown for a while']").click()
    page.wait_for_url("**/?state=outcome_unknown&age=15m")
    assert page.input_value("#id_state") == "outcome_unknown"
    assert page.input_value("#id_age") == "15m"
    assert page.console_errors == []


def test_a_bulk_decision_takes_the_decided_rows_out_and_refreshes_the_counts(browser_page):
    from playwright.sync_api import expect

    page = browser_page
    UserFactory(username="reviewer", role="reviewer")
    ops = [OperationFactory(state=State.OUTCOME_UNKNOWN) for _ in range(4)]
    log_in(page, "reviewer")
    expect(page.locator("[data-count=outcome_unknown]")).to_have_text("4")
    for op in ops[:2]:
        page.check(f"input[name=items][value^='{op.operation_id}@']")
    page.select_option("select[name=to_state]", State.ABANDONED)
    page.fill("input[name=reason]", "duplicates of a resent batch")
    page.click("#bulk-form button[type=submit]")
    page.locator("#bulk-result >> text=2 decided, 0 skipped").wait_for()
    expect(page.locator("table.queue tbody tr")).to_have_count(2)
    assert page.locator("input[name=items]:checked").count() == 0
    expect(page.locator("[data-count=outcome_unknown]")).to_have_text("2")
    # One's own decision is no news: no "The queue changed since you loaded it".
    page.wait_for_function("() => document.querySelector('#queue-fresh')"
                           ".hasAttribute('data-own')", timeout=5000)
    assert page.locator("#queue-fresh").inner_text() == ""
    screenshot(page, "bulk-after")
    assert page.console_errors == []


def test_approval_counts_agree_between_the_list_and_the_operation(browser_page):
    page = browser_page
    admin = UserFactory(username="policy-admin", role="admin")
    UserFactory(username="ada", role="reviewer")
    bob = UserFactory(username="bob", role="reviewer")
    approvals.set_policy("payments.*", user=admin, consequential=True)
    op = OperationFactory(operation="payments.send", intent={"to": "acct-9", "amount": 5})
    approvals.request(op, note="refund")
    log_in(page, "ada")
    page.goto(f"/operations/{op.operation_id}/")
    page.fill("#id_approval_reason", "amount matches the ticket")
    page.click("#approval button[value=approve]")
    page.locator("#decision li.msg >> text=Recorded:").wait_for()
    assert "1 of 2 live approvals" in page.locator("#approval h2").inner_text()
    page.goto("/approvals/")
    assert page.locator(f"tr[data-operation='{op.operation_id}'] .approvals-count"
                        ).inner_text() == "1 of 2"
    approvals.approve(op, user=bob, reason="second look")
    page.goto(f"/operations/{op.operation_id}/")
    panel = page.locator("#approval").inner_text()
    assert "2 of 2 live approvals" in panel and "the agent may send it" in panel
    assert "the next approval must be someone else" not in panel
    assert "Asked by approval policy payments.*" in panel
    page.goto("/approvals/")
    assert "No operation awaits approval" in page.locator("#results").inner_text()


def test_at_phone_width_chart_labels_are_readable_and_the_decision_comes_first(
        chromium, live_server):
    UserFactory(username="reviewer", role="reviewer")
    op = OperationFactory(state=State.MANUAL_REVIEW)
    for _ in range(3):
        OperationFactory(state=State.OUTCOME_UNKNOWN)
    context = chromium.new_context(base_url=live_server.url, viewport=PHONE)
    try:
        page = context.new_page()
        log_in(page, "reviewer")
        page.goto("/overview/")
        heights = page.eval_on_selector_all(
            "svg.chart-svg text.chart-label",
            "els => els.map(el => el.getBoundingClientRect().height)")
        assert heights and min(heights) >= 10, heights
        page.goto(f"/operations/{op.operation_id}/")
        decide = page.locator("#decide").bounding_box()
        receipt = page.locator(".panel-receipt").bounding_box()
        assert decide["y"] < receipt["y"]
        assert decide["y"] < PHONE["height"]
        screenshot(page, "phone-operation-decision-first")
    finally:
        context.close()


def test_no_desk_page_shows_python(browser_page, notified):  # noqa: F811
    page = browser_page
    admin = notified
    approvals.set_policy("payments.send", user=admin, consequential=True,
                         ttl=timedelta(days=1))
    waiting = OperationFactory(operation="payments.send", intent={"amount": 5, "ok": True})
    approvals.request(waiting, note="please")
    timed_out = OperationFactory(state=State.SUBMITTED)
    receipts.mark_outcome_unknown(timed_out, error_code="Timeout")
    gone = OperationFactory(state=State.SUBMITTED)
    reconcile.sweep_stale_submissions(older_than=timedelta(0))
    never = OperationFactory(state=State.MANUAL_REVIEW, retry_policy="never")
    run, _ = busy_run("run-day", extra_rows=1)
    conflict = make_conflict("invoice:77", run=run, candidate={"paid": True})
    saved_views.save(admin, "payments", tenant="default", filters={"operation": "payments.send"})
    log_in(page, "admin")
    pages = [*PHONE_PAGES, "/views/", "/?age=1h", f"/operations/{waiting.operation_id}/",
             f"/operations/{timed_out.operation_id}/", f"/operations/{gone.operation_id}/",
             f"/operations/{never.operation_id}/", f"/conflicts/{conflict.pk}/",
             f"/runs/{run.run_id}/"]
    found = {}
    for path in pages:
        response = page.goto(path)
        assert response.status == 200, path
        page.wait_for_load_state("networkidle")
        # the text people read: values of <pre> JSON blocks are JSON (true, not True)
        text = page.evaluate("() => document.body.innerText")
        leaks = [(token, text[max(0, text.find(token) - 50): text.find(token) + 50])
                 for token in PYTHON_REPRS if re.search(rf"(?<![\w-]){re.escape(token)}", text)]
        if leaks:
            found[path] = leaks
        if path == "/approvals/policies/":
            assert "1 d" in text
        if path == f"/operations/{gone.operation_id}/":
            assert "more than 0 s ago" in text
    assert found == {}
