"""The desk as an operator on call uses it: keyboard only, a phone, two reviewers."""

from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from demo import notifications as demo_notifications
from ledger import approvals, claims, notifications, reconcile
from ledger.states import State
from tests.e2e.conftest import log_in, screenshot
from tests.factories import OperationFactory, UserFactory, ensure_roles
from tests.ledger.test_notifications import Receiver
from tests.review.execution_setup import busy_run, make_conflict, make_overdue

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PHONE = {"width": 390, "height": 844}
# The laptop and desktop widths every desk page fits too, beside the phone's.
DESKTOP_WIDTHS = (1024, 1280, 1440)
# A link or label of the top bar that wraps ("Audit / log", "Log / out"): its text takes
# more than one line box.
WRAPPED_NAV_JS = """() => [...document.querySelectorAll(
        '.topbar .brand, .mainnav a, .whoami button, .whoami > span')]
    .filter(el => {
        const range = document.createRange();
        range.selectNodeContents(el);
        const rects = [...range.getClientRects()].filter(r => r.width > 0);
        // a rect wholly below another starts a second line (a smaller badge beside the
        // text is on the same line: the two overlap vertically)
        return rects.some(a => rects.some(b => a.top >= b.bottom - 1));
    }).map(el => el.textContent.trim())"""


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

    # The skip link is the first thing Tab reaches, and on the queue it lands on the list.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.className") == "skip-link"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "queue-start"

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
    # put back when htmx settles the swap, a moment after the new content shows
    page.wait_for_function("() => document.activeElement !== document.body", timeout=5000)
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


LONG_ANSWER = ("upstream-gateway-refused-the-delivery-because-the-route-is-not-configured-"
               * 3).encode()

# Every desk page an admin reaches; a page added to the desk belongs here.
PHONE_PAGES = ["/", "/?state=submitted&age=1h", "/audit/", "/approvals/",
               "/approvals/policies/", "/conflicts/", "/obligations/overdue/", "/retention/",
               "/overview/", "/notifications/", "/notifications/deliveries/",
               "/demo/webhook-catcher/"]


# The overview's numbers (a chart's table, rows by columns) scroll inside themselves at
# phone width; every other page's tables are cards (class stack-rows): no table scrolls
# inside itself, and the cells of a row sit one under another.
SCROLLED_TABLE_PAGES = {"/overview/"}
TABLES_JS = """() => [...document.querySelectorAll('main table.grid')].map(table => {
    const cells = [...table.querySelectorAll('tbody tr:first-child td')]
        .filter(td => td.offsetHeight > 0);
    const lefts = new Set(cells.map(td => Math.round(td.getBoundingClientRect().left)));
    const where = table.closest('[id]').id + ' ' + table.className;
    return table.scrollWidth > table.clientWidth || lefts.size > 1 ? where : '';
})"""


@pytest.fixture
def notified(settings, tmp_path):
    """A webhook channel with a long URL whose receiver refused twice with a long answer and
    then took the batch, an e-mail channel, and a delivery the demo catcher listed."""
    settings.LEDGER_WEBHOOK_SECRETS = {"OPS": "whsec-phone-test", "DEMO": "demo-phone-test"}
    settings.LEDGER_WEBHOOK_ALLOW_PRIVATE = True
    settings.DEMO_CATCHER_FILE = tmp_path / "received.jsonl"
    receiver = Receiver(codes=[500, 502], answer=LONG_ANSWER)
    try:
        admin = UserFactory(username="admin", role="admin")
        notifications.create_channel(
            "payments-on-call-escalation-webhook", user=admin, kind="webhook",
            url=receiver.url + "/" + "tenant-default-channel-payments-" * 4 + "?route=primary",
            secret_name="OPS", pattern="payments.charge.*", stuck_after=timedelta(hours=4))
        notifications.create_channel(
            "finance-mail", user=admin, kind="email", pattern="*",
            recipients=["payments-oncall-rotation-primary@finance.example.com",
                        "payments-oncall-rotation-secondary@finance.example.com"])
        OperationFactory(operation="payments.charge.card", state=State.MANUAL_REVIEW)
        now = timezone.now()
        notifications.collect(now=now)
        for minutes in (0, 5, 60):
            notifications.deliver_due(worker="phone", now=now + timedelta(minutes=minutes))
        assert [r[0]["X-Ledger-Attempt"] for r in receiver.requests] == ["1", "2", "3"]
    finally:
        receiver.close()
    demo_notifications.store({
        "received_at": "2026-12-03T18:00:00+00:00", "delivery": "17", "attempt": "1",
        "signature_verified": True,
        "payload": {"total": 1, "tenant": "default", "channel": "demo-catcher",
                    "counts": {"queue": 1}, "more": 0,
                    "items": [{"url": "http://127.0.0.1:8000/operations/"
                                      "20261203T180000Z-1fd54b31a2/",
                               "kind": "operation", "reason": "queue",
                               "operation": "articles.create.with-a-long-operation-name",
                               "id": "20261203T180000Z-1fd54b31a2",
                               "reason_label": "entered the review queue",
                               "waiting_since": "2026-12-03T17:59:58+00:00"}]},
    })
    return admin


def test_at_phone_width_no_page_scrolls_sideways(chromium, live_server, notified):
    op = OperationFactory(
        state=State.MANUAL_REVIEW,
        target="https://articles.example/api/articles/" + "very-long-segment-" * 8,
        intent={"title": "A title long enough to wrap " * 6, "body": "x" * 400})
    for _ in range(3):
        OperationFactory(state=State.OUTCOME_UNKNOWN)
    claims.add_note(op, user=UserFactory(username="ada", role="reviewer"),
                    text="a long note without spaces " + "y" * 300)
    approvals.set_policy("payments.refund.*", user=notified, approvals_needed=2,
                         ttl=timedelta(hours=24), consequential=True)
    run, _ = busy_run("run-reconcile-the-march-invoices-of-every-subsidiary", extra_rows=3)
    make_overdue(run, "email:payment-reminder:" + "subsidiary-" * 6)
    conflict = make_conflict("invoice:2026-03-" + "0042-" * 8, run=run,
                             candidate={"paid": True, "memo": "wire ref " + "Z" * 120})
    context = chromium.new_context(base_url=live_server.url, viewport=PHONE)
    try:
        page = context.new_page()
        page.goto("/accounts/login/")
        login_width = page.evaluate("document.documentElement.scrollWidth")
        log_in(page, "admin")
        pages = [*PHONE_PAGES, f"/operations/{op.operation_id}/",
                 f"/conflicts/{conflict.pk}/", f"/runs/{run.run_id}/"]
        widths, tables = {}, {}
        for path in pages:
            response = page.goto(path)
            assert response.status == 200, path
            widths[path] = page.evaluate("document.documentElement.scrollWidth")
            if path not in SCROLLED_TABLE_PAGES:
                tables[path] = page.evaluate(TABLES_JS)
        page.goto(f"/operations/{op.operation_id}/")
        screenshot(page, "phone-operation")
        page.goto("/retention/")
        screenshot(page, "phone-retention")
        page.goto("/approvals/policies/")
        screenshot(page, "phone-approval-policies")
        page.goto("/overview/")
        assert page.locator("svg.chart-svg").count() == 2
        screenshot(page, "phone-overview")
        page.goto("/audit/")
        assert page.locator("#unsealed + ul.unsealed li").count() >= 1
        screenshot(page, "phone-audit")
        page.goto("/")
        screenshot(page, "phone-queue")
        page.goto("/notifications/")
        assert page.locator("#channels table.policies tbody tr").count() == 2
        screenshot(page, "phone-notifications")
        page.goto("/demo/webhook-catcher/")
        assert "20261203T180000Z-1fd54b31a2" in page.locator("#received").inner_text()
        screenshot(page, "phone-webhook-catcher")
        page.goto("/notifications/deliveries/")
        assert page.locator("#deliveries tbody tr").count() == 4  # 3 webhook, 1 e-mail
        screenshot(page, "phone-deliveries")
        page.goto(f"/runs/{run.run_id}/")
        screenshot(page, "phone-run")
        page.goto(f"/conflicts/{conflict.pk}/")
        screenshot(page, "phone-conflict")
        assert login_width <= PHONE["width"]
        assert {path for path, found in tables.items() if not found} == {
            "/?state=submitted&age=1h", "/approvals/",  # nothing submitted or awaiting
            f"/conflicts/{conflict.pk}/", "/demo/webhook-catcher/"}  # no table there
        assert {path: [t for t in found if t] for path, found in tables.items()
                if any(found)} == {}
        assert {path: w for path, w in widths.items() if w > PHONE["width"]} == {}
        # The same pages at laptop and desktop widths: no sideways scrolling, and the top
        # navigation never breaks a link over two lines.
        wide, wrapped = {}, {}
        for width in DESKTOP_WIDTHS:
            page.set_viewport_size({"width": width, "height": 860})
            for path in pages:
                page.goto(path)
                found = page.evaluate("document.documentElement.scrollWidth")
                if found > width:
                    wide[(width, path)] = found
                broken = page.evaluate(WRAPPED_NAV_JS)
                if broken:
                    wrapped[(width, path)] = broken
            page.goto("/")
            screenshot(page, f"queue-{width}")
        assert wide == {}, f"expected every page to fit its width, found {wide}"
        assert wrapped == {}, f"expected no top-bar link over two lines, found {wrapped}"
    finally:
        context.close()


def test_the_skip_link_comes_first_on_every_desk_page(browser_page, notified):
    page = browser_page
    log_in(page, "admin")
    for path in PHONE_PAGES:
        page.goto(path)
        page.keyboard.press("Tab")
        assert page.evaluate("document.activeElement.className") == "skip-link", path
        page.keyboard.press("Enter")
        # the queue's skip link goes straight to its list; elsewhere to the page
        landing = "queue-start" if path.startswith("/?") or path == "/" else "main"
        assert page.evaluate("document.activeElement.id") == landing, path
        assert page.locator("main h1").count() == 1, path
    assert page.console_errors == []


@reconcile.register("e2e.not_yet")
class NotYetReconciler(reconcile.Reconciler):
    """Sees nothing yet: a pass moves an operation outcome_unknown -> reconciling ->
    outcome_unknown, two versions on, and every decision stays open."""

    def lookup(self, op):
        return reconcile.NotYet({"seen": "nothing yet"})


def test_an_item_is_resolved_with_the_keyboard_alone(browser_page):
    page = browser_page
    UserFactory(username="reviewer", role="reviewer")
    op = OperationFactory(state=State.OUTCOME_UNKNOWN, operation="e2e.not_yet")
    log_in(page, "reviewer")
    page.keyboard.press("j")
    page.keyboard.press("o")
    page.wait_for_url(f"**/operations/{op.operation_id}/")
    # a chooses Abandon and moves to the reason; Tab to the chosen button and Enter decides
    page.keyboard.press("a")
    assert page.evaluate("document.activeElement.id") == "id_reason"
    reason = "Checked the CMS: never created; the agent gave up"
    page.keyboard.type(reason)
    # Meanwhile the reconciler looks and sees nothing yet: the version moves on, the
    # state (and so the decision) stays as the reviewer saw it.
    reconcile.run_once(worker="reconcile-e2e")
    op.refresh_from_db()
    assert (op.state, op.version) == (State.OUTCOME_UNKNOWN, 5), (op.state, op.version)
    for _ in range(6):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.value") == "abandoned":
            break
    assert page.evaluate("document.activeElement.value") == "abandoned"
    page.keyboard.press("Enter")
    # Not applied, not lost: shown again with the reconciler's move, the reason kept, and
    # one key to record it on the version now shown.
    confirm = page.locator("#reconfirm")
    confirm.wait_for()
    assert "reconcile-e2e (reconciler) already moved this operation" in confirm.inner_text()
    assert page.input_value("#id_reason") == reason
    page.wait_for_function("() => document.activeElement.hasAttribute('data-confirm')",
                           timeout=5000)
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN
    page.keyboard.press("y")
    page.locator("#decision >> text=Recorded: Abandon").wait_for()
    op.refresh_from_db()
    assert op.state == State.ABANDONED
    assert op.events.order_by("-version").first().reason == reason
    # focus is put back when htmx settles the swap, a moment after the new text shows
    page.wait_for_function("() => document.activeElement !== document.body", timeout=5000)


def test_times_show_the_absolute_time_in_the_reviewers_time_zone_on_hover(chromium, live_server):
    UserFactory(username="reviewer", role="reviewer")
    waiting = OperationFactory(state=State.OUTCOME_UNKNOWN)
    review = OperationFactory(state=State.MANUAL_REVIEW)
    context = chromium.new_context(base_url=live_server.url, locale="en-US",
                                   timezone_id="Asia/Tokyo")  # UTC+9, no summer time
    try:
        page = context.new_page()
        log_in(page, "reviewer")

        def hover_texts():
            # rewritten on load and when htmx settles a swap, a moment after the rows show.
            # A function, not an expression: Playwright polls an expression with eval,
            # which the desk's Content-Security-Policy refuses once a second look is needed.
            page.wait_for_function(
                "() => [...document.querySelectorAll('#results time[datetime]')]"
                ".every(el => !el.title.endsWith(' UTC'))", timeout=5000)
            return page.eval_on_selector_all(
                "#results time[datetime]",
                "els => els.map(el => [el.getAttribute('datetime'), el.title])")

        def assert_tokyo(found):
            assert found
            for utc_text, title in found:
                tokyo = (datetime.fromisoformat(utc_text) + timedelta(hours=9))
                assert title.endswith("GMT+9") and tokyo.strftime("%I:%M:%S") in title, (
                    f"expected {utc_text} shown in Tokyo time, found {title!r}")

        assert_tokyo(hover_texts())
        # a fragment htmx swaps in gets the same
        page.select_option("#id_state", "manual_review")
        page.locator(f"#results >> text={waiting.operation_id}").wait_for(state="detached")
        page.locator(f"#results >> text={review.operation_id}").wait_for()
        assert_tokyo(hover_texts())
    finally:
        context.close()
