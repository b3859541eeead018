"""The desk as an operator on call uses it: keyboard only, a phone, two reviewers."""

import pytest

from ledger import claims
from ledger.states import State
from tests.e2e.conftest import log_in, screenshot
from tests.factories import OperationFactory, UserFactory, ensure_roles

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PHONE = {"width": 390, "height": 844}


@pytest.fixture(autouse=True)
def roles(transactional_db):
    ensure_roles()


def test_keyboard_only_moves_through_the_queue_and_opens_an_item(browser_page):
    page = browser_page
    UserFactory(username="reviewer", role="reviewer")
    ops = [OperationFactory(state=State.OUTCOME_UNKNOWN) for _ in range(3)]
    log_in(page, "reviewer")
    rows = page.locator("#results tbody tr")
    assert rows.count() == 3
    second = rows.nth(1).locator("td.mono a").inner_text()

    # The skip link is the first thing Tab reaches, and it lands in the page.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.className") == "skip-link"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"

    page.keyboard.press("?")
    assert page.locator("#keys-help").is_visible()
    page.keyboard.press("Escape")
    assert not page.locator("#keys-help").is_visible()

    page.keyboard.press("/")
    assert page.evaluate("document.activeElement.id") == "id_q"
    page.keyboard.press("Escape")
    page.evaluate("document.activeElement.blur()")

    page.keyboard.press("j")
    page.keyboard.press("j")
    page.keyboard.press("k")
    page.keyboard.press("j")
    assert "kb-selected" in rows.nth(1).get_attribute("class")
    page.keyboard.press("o")
    page.wait_for_url(f"**/operations/{second}/")
    assert second in {op.operation_id for op in ops}

    # Claiming by keyboard: the swap keeps focus inside the page, not on <body>.
    page.focus("#claim-button")
    page.keyboard.press("Enter")
    page.locator("#decision [data-claimed-by='reviewer']").wait_for()
    assert page.evaluate("document.activeElement !== document.body")
    assert page.console_errors == []


def test_a_claim_made_in_one_browser_is_seen_in_another(chromium, live_server):
    UserFactory(username="ada", role="reviewer")
    UserFactory(username="bob", role="reviewer")
    op = OperationFactory(state=State.MANUAL_REVIEW)
    contexts = []
    try:
        pages = {}
        for name in ("ada", "bob"):
            context = chromium.new_context(base_url=live_server.url)
            contexts.append(context)
            pages[name] = context.new_page()
            log_in(pages[name], name)
        ada, bob = pages["ada"], pages["bob"]
        ada.goto(f"/operations/{op.operation_id}/")
        ada.click("#claim-button")
        ada.locator("#decision [data-claimed-by='ada']").wait_for()

        bob.goto("/")
        assert "ada is looking at this" in bob.locator("#results").inner_text()
        bob.goto(f"/operations/{op.operation_id}/")
        assert "ada is looking at this" in bob.locator("#claim").inner_text()
        assert bob.locator("#claim-button").count() == 0
        screenshot(bob, "claim-seen-by-another")
    finally:
        for context in contexts:
            context.close()


def test_at_phone_width_no_page_scrolls_sideways(chromium, live_server):
    UserFactory(username="admin", role="admin")
    op = OperationFactory(
        state=State.MANUAL_REVIEW,
        target="https://articles.example/api/articles/" + "very-long-segment-" * 8,
        intent={"title": "A title long enough to wrap " * 6, "body": "x" * 400})
    for _ in range(3):
        OperationFactory(state=State.OUTCOME_UNKNOWN)
    claims.add_note(op, user=UserFactory(username="ada", role="reviewer"),
                    text="a long note without spaces " + "y" * 300)
    context = chromium.new_context(base_url=live_server.url, viewport=PHONE)
    try:
        page = context.new_page()
        log_in(page, "admin")
        pages = ["/", "/?state=submitted&age=1h", f"/operations/{op.operation_id}/",
                 "/audit/", "/approvals/", "/approvals/policies/", "/conflicts/",
                 "/obligations/overdue/", "/retention/", "/overview/"]
        widths = {}
        for path in pages:
            page.goto(path)
            widths[path] = page.evaluate("document.documentElement.scrollWidth")
        screenshot(page, "phone-retention")
        page.goto("/overview/")
        assert page.locator("svg.chart-svg").count() == 2
        screenshot(page, "phone-overview")
        page.goto("/")
        screenshot(page, "phone-queue")
        assert {path: w for path, w in widths.items() if w > PHONE["width"]} == {}
    finally:
        context.close()


def test_an_item_is_resolved_with_the_keyboard_alone(browser_page):
    page = browser_page
    UserFactory(username="reviewer", role="reviewer")
    op = OperationFactory(state=State.MANUAL_REVIEW)
    log_in(page, "reviewer")
    page.keyboard.press("j")
    page.keyboard.press("o")
    page.wait_for_url(f"**/operations/{op.operation_id}/")
    page.keyboard.press("a")
    assert page.evaluate("document.activeElement.value") == "abandoned"
    # back past the other decisions and the external id to the reason, and forward again
    for _ in range(6):
        page.keyboard.press("Shift+Tab")
        if page.evaluate("document.activeElement.id") == "id_reason":
            break
    assert page.evaluate("document.activeElement.id") == "id_reason"
    page.keyboard.type("Checked the CMS: never created; the agent gave up")
    for _ in range(6):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.value") == "abandoned":
            break
    assert page.evaluate("document.activeElement.value") == "abandoned"
    page.keyboard.press("Enter")
    page.locator("#decision >> text=Recorded: Abandon").wait_for()
    op.refresh_from_db()
    assert op.state == State.ABANDONED
    assert page.evaluate("document.activeElement !== document.body")
