"""Approval in a real browser: a reviewer approves on the desk while an agent thread
waits in approvals.wait, and the agent proceeds; a two-person decision in two contexts."""

import threading

import pytest
from django.db import connections

from ledger import approvals, receipts
from ledger.models import Operation
from ledger.states import State
from tests.e2e.conftest import log_in, screenshot
from tests.factories import OperationFactory, UserFactory, ensure_roles

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def roles(transactional_db):
    ensure_roles()


def test_approving_on_the_desk_lets_the_waiting_agent_send(browser_page):
    page = browser_page
    admin = UserFactory(username="policy-admin", role="admin")
    UserFactory(username="reviewer", role="reviewer")
    approvals.set_policy("payments.*", user=admin)
    op = OperationFactory(operation="payments.send", intent={"to": "acct-1", "amount": 100})
    approvals.request(op, note="invoice 7 from ACME")
    outcome = {}

    def agent():
        try:
            approved = approvals.wait(Operation.objects.get(pk=op.pk), timeout=120)
            outcome["state"] = receipts.mark_submitted(approved).state
        except Exception as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=agent)
    thread.start()
    log_in(page, "reviewer")
    page.click("nav.mainnav >> text=Awaiting approval")
    page.locator(f"text={op.operation_id}").click()
    page.wait_for_url(f"**/operations/{op.operation_id}/")
    assert "invoice 7 from ACME" in page.locator("#approval").inner_text()
    page.fill("#id_approval_reason", "invoice matches the order")
    page.click("button[name=action][value=approve]")
    page.locator("#decision >> text=Recorded: Approve").wait_for()
    screenshot(page, "approved")
    thread.join(timeout=120)
    assert outcome == {"state": State.SUBMITTED}


def test_a_two_person_decision_takes_two_browser_contexts(chromium, live_server):
    admin = UserFactory(username="policy-admin", role="admin")
    UserFactory(username="first", role="reviewer")
    UserFactory(username="second", role="reviewer")
    approvals.set_policy("payments.*", user=admin, consequential=True)
    op = OperationFactory(operation="payments.send")
    pages = []
    for username in ("first", "second"):
        context = chromium.new_context(base_url=live_server.url)
        page = context.new_page()
        log_in(page, username)
        page.goto(f"/operations/{op.operation_id}/")
        pages.append((context, page))
    (first_ctx, first), (second_ctx, second) = pages
    first.click("button[name=action][value=approve]")
    first.locator("#decision >> text=Recorded: Approve").wait_for()
    assert "a second, different person must approve" in first.locator("#approval").inner_text()
    assert first.locator("button[name=action][value=approve]").count() == 0
    second.reload()
    second.click("button[name=action][value=approve]")
    second.locator("#decision >> text=Recorded: Approve").wait_for()
    assert approvals.gate(op).is_open
    assert receipts.mark_submitted(op).state == State.SUBMITTED
    for context, _ in pages:
        context.close()
