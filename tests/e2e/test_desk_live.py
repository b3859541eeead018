"""The live queue in a real browser: new items arrive without a reload, and never at the
cost of what the reviewer is doing (ticked boxes, focus); a hidden tab does not poll."""

import pytest
from playwright.sync_api import expect

from ledger.states import State
from tests.e2e.conftest import log_in, screenshot
from tests.factories import OperationFactory, UserFactory, ensure_roles

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def fast_polling(transactional_db, settings):
    ensure_roles()
    settings.REVIEW_QUEUE_POLL_SECONDS = 1


def test_a_new_item_arrives_without_a_reload_and_ticked_focused_work_survives(browser_page):
    page = browser_page
    UserFactory(username="reviewer", role="reviewer")
    OperationFactory(state=State.OUTCOME_UNKNOWN)
    OperationFactory(state=State.OUTCOME_UNKNOWN)
    log_in(page, "reviewer")
    rows = page.locator("#results tbody tr")
    expect(rows).to_have_count(2)
    page.evaluate("window.sameDocument = true")

    # Nobody working in the list: the new row simply appears.
    first_new = OperationFactory(state=State.MANUAL_REVIEW)
    expect(rows).to_have_count(3, timeout=10_000)
    expect(page.locator("#results")).to_contain_text(first_new.operation_id)
    expect(page.locator('#queue-counts [data-count="total"]')).to_have_text("3")
    assert page.evaluate("window.sameDocument === true")

    # A ticked, focused box: the rows stay put, the counts move, a notice offers the rest.
    box = rows.nth(1).locator("input[type=checkbox]")
    box.check()
    ticked = box.get_attribute("value")
    assert page.evaluate("document.activeElement.value") == ticked
    second_new = OperationFactory(state=State.MANUAL_REVIEW)
    expect(page.locator("#queue-fresh")).to_contain_text("1 new item", timeout=10_000)
    expect(page.locator('#queue-counts [data-count="total"]')).to_have_text("4")
    page.wait_for_timeout(2_500)  # two more polls: still nothing swapped under the reviewer
    expect(rows).to_have_count(3)
    assert page.locator(f'input[value="{ticked}"]').is_checked()
    assert page.evaluate("document.activeElement.value") == ticked
    assert second_new.operation_id not in page.locator("#results tbody").inner_text()
    screenshot(page, "live-queue-notice")

    # "show" loads the rows; the ticked operation is still ticked.
    page.click("#queue-fresh a[data-show-fresh]")
    expect(rows).to_have_count(4)
    # ticked again when htmx settles the swap, a moment after the rows show
    expect(page.locator(f'input[value="{ticked}"]')).to_be_checked()
    assert page.evaluate("window.sameDocument === true")
    assert page.console_errors == []


def test_a_hidden_tab_does_not_poll_and_polls_again_when_shown(browser_page):
    page = browser_page
    UserFactory(username="reviewer", role="reviewer")
    OperationFactory(state=State.OUTCOME_UNKNOWN)
    polls = []
    page.on("request", lambda request: "/live/" in request.url and polls.append(request.url))
    log_in(page, "reviewer")
    page.wait_for_timeout(2_500)
    assert polls, "expected the open queue to poll"
    page.evaluate("""() => {
        window.hiddenNow = true;
        Object.defineProperty(document, "hidden", {configurable: true,
                                                   get: () => window.hiddenNow});
    }""")
    page.wait_for_timeout(500)
    before = len(polls)
    page.wait_for_timeout(3_000)
    assert len(polls) == before
    page.evaluate("""() => {
        window.hiddenNow = false;
        document.dispatchEvent(new Event("visibilitychange"));
    }""")
    page.wait_for_timeout(1_500)
    assert len(polls) > before
    assert page.console_errors == []
