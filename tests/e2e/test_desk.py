"""The review desk in a real browser: log in, filter, read, decide, audit; XSS; viewers."""

import pytest

from ledger import receipts
from ledger.models import Operation
from ledger.states import State
from tests.e2e.conftest import log_in, screenshot
from tests.factories import OperationFactory, UserFactory, add_evidence, ensure_roles

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def roles(transactional_db):
    ensure_roles()

HOSTILE_TITLE = "<img src=x onerror=alert(1)>"
HOSTILE_BODY = "</script><script>alert(1)</script>"


def stuck_in_manual_review():
    op = OperationFactory(state=State.RECONCILING,
                          intent={"title": "Quarterly report", "body": "Numbers"})
    add_evidence(op, verdict="not_yet", observed={"status": "pending", "seen": 0})
    add_evidence(op, verdict="error", to_state=State.MANUAL_REVIEW,
                 observed={"http_status": 503, "body": "CMS search unavailable"},
                 detail="search endpoint answered 503 three times")
    return op


def test_reviewer_filters_opens_reads_evidence_resolves_and_finds_it_audited(browser_page):
    page = browser_page
    UserFactory(username="reviewer", role="reviewer")
    op = stuck_in_manual_review()
    other = OperationFactory(state=State.OUTCOME_UNKNOWN, operation="emails.send")
    for _ in range(3):
        OperationFactory(state=State.OUTCOME_UNKNOWN)

    log_in(page, "reviewer")
    assert page.locator(f"text={other.operation_id}").count() == 1
    page.select_option("#id_state", "manual_review")
    page.wait_for_url("**state=manual_review**")
    page.locator(f"#results >> text={other.operation_id}").wait_for(state="detached")
    assert page.locator("#results tbody tr").count() == 1
    screenshot(page, "queue")

    page.click(f"text={op.operation_id}")
    # the filter comes along (state=manual_review), for "Next item" and back
    page.wait_for_url(f"**/operations/{op.operation_id}/?state=manual_review")
    evidence = page.locator("#evidence")
    assert "CMS search unavailable" in evidence.inner_text()
    assert "search endpoint answered 503 three times" in evidence.inner_text()
    assert evidence.locator("article").count() == 2
    screenshot(page, "detail")

    page.fill("#id_reason", "Found it in the CMS by hand: article-88")
    page.fill("#id_external_id", "article-88")
    page.click("button[value=succeeded]")
    page.locator("#decision >> text=Recorded: Mark succeeded").wait_for()
    assert page.locator("button[name=to_state]").count() == 0
    assert Operation.objects.get(pk=op.pk).external_id == "article-88"
    # The receipt says in words how it was settled, and by whom.
    assert page.locator("#external-id").inner_text() == "article-88"
    assert "Succeeded by reviewer, a person, on the desk" in page.locator("#settled").inner_text()

    # One its agent settled: the stored result (redacted like the intent), its id, in words.
    by_agent = OperationFactory(state=State.SUBMITTED)
    receipts.mark_succeeded(by_agent, external_id="article-7",
                            result={"id": "article-7", "token": "sk-live-e2e-secret"})
    page.goto(f"/operations/{by_agent.operation_id}/")
    assert '"id": "article-7"' in page.locator("#result").inner_text()
    assert "sk-live-e2e-secret" not in page.content()
    assert "Succeeded by its agent" in page.locator("#settled").inner_text()
    assert "No reconciler has looked" not in page.locator("#evidence").inner_text()

    page.goto("/")
    assert page.locator(f"text={op.operation_id}").count() == 0
    page.click("text=Audit log")
    row = page.locator("tr", has_text="Found it in the CMS by hand: article-88")
    assert row.count() == 1 and "reviewer" in row.inner_text()
    assert page.dialogs == [] and page.console_errors == []


def test_a_hostile_intent_shows_as_text_and_opens_no_dialog(browser_page):
    page = browser_page
    UserFactory(username="reviewer", role="reviewer")
    op = OperationFactory(state=State.OUTCOME_UNKNOWN,
                          intent={"title": HOSTILE_TITLE, "body": HOSTILE_BODY})
    add_evidence(op.__class__.objects.get(pk=op.pk), verdict="not_yet",
                 observed={"title": HOSTILE_TITLE}, detail=HOSTILE_BODY)
    log_in(page, "reviewer")
    page.goto(f"/operations/{op.operation_id}/")
    intent = page.locator("#intent").inner_text()
    assert HOSTILE_TITLE in intent and HOSTILE_BODY in intent
    assert HOSTILE_BODY in page.locator("#evidence").inner_text()
    assert page.locator("img").count() == 0
    page.wait_for_timeout(300)  # give a (wrongly) injected handler the chance to fire
    assert page.dialogs == []


def test_a_viewer_sees_no_action_buttons_and_a_forged_post_gets_403(browser_page):
    page = browser_page
    UserFactory(username="viewer", role="viewer")
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    log_in(page, "viewer")
    page.goto(f"/operations/{op.operation_id}/")
    assert op.operation_id in page.locator("#decision").inner_text()
    assert page.locator("button[name=to_state]").count() == 0
    csrf = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
    response = page.request.post(
        f"/operations/{op.operation_id}/resolve/",
        form={"to_state": "succeeded", "reason": "forged", "version": str(op.version)},
        headers={"X-CSRFToken": csrf, "Referer": page.url},
    )
    assert response.status == 403
    assert Operation.objects.get(pk=op.pk).state == State.OUTCOME_UNKNOWN
