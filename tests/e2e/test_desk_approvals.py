"""Approval in a real browser: a reviewer approves on the desk while an agent thread
waits in approvals.wait, and the agent proceeds; a two-person approval and a two-person
resolution, each in two browser contexts; a bulk abandon of a filtered set."""

import threading

import pytest
from django.db import connections

from ledger import approvals, receipts
from ledger.models import Operation
from ledger.states import State
from tests.e2e.conftest import log_in, screenshot
from tests.factories import OperationFactory, UserFactory, drive, ensure_roles

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
    # The Approval panel is the decision: no "No decision is open: planned is settled."
    # beside it, and the receipt spans the page (no empty column next to it).
    assert page.locator("#decide").count() == 0
    assert "is settled" not in page.locator("#decision").inner_text()
    widths = page.evaluate("() => [document.querySelector('.panel-receipt').offsetWidth, "
                           "document.querySelector('#approval').offsetWidth]")
    assert widths[0] == widths[1], widths
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


def test_a_two_person_resolution_takes_two_browser_contexts(chromium, live_server):
    admin = UserFactory(username="policy-admin", role="admin")
    approvers = [UserFactory(username=f"approver{n}", role="reviewer") for n in (1, 2)]
    UserFactory(username="ada", role="reviewer")
    UserFactory(username="bob", role="reviewer")
    approvals.set_policy("payments.*", user=admin, consequential=True)
    op = OperationFactory(operation="payments.send")
    for approver in approvers:
        approvals.approve(op, user=approver, reason="looks right")
    drive(op, State.OUTCOME_UNKNOWN)
    pages = []
    for username in ("ada", "bob"):
        context = chromium.new_context(base_url=live_server.url)
        page = context.new_page()
        log_in(page, username)
        page.goto(f"/operations/{op.operation_id}/")
        pages.append((context, page))
    (_, ada), (_, bob) = pages

    ada.fill("#id_reason", "the bank shows the transfer")
    ada.click("button[name=to_state][value=succeeded]")
    ada.locator("#decision >> text=Proposed: Mark succeeded").wait_for()
    assert "You proposed it" in ada.locator("#decision").inner_text()
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN
    # Ada again, on the fresh page: not alone.
    ada.fill("#id_reason", "really")
    ada.click("button[name=to_state][value=succeeded]")
    ada.locator("#decision >> text=the decision takes two people").wait_for()

    bob.goto("/")
    assert "proposed: succeeded by ada, needs a second person" in bob.locator(
        "table.queue").inner_text()
    bob.goto(f"/operations/{op.operation_id}/")
    bob.fill("#id_reason", "confirmed with the bank")
    bob.click("button[name=to_state][value=succeeded]")
    bob.locator("#decision >> text=Recorded: Mark succeeded").wait_for()
    assert "completed by a second person" in bob.locator("#proposals").inner_text()
    screenshot(bob, "two-person-resolution")
    op.refresh_from_db()
    assert op.state == State.SUCCEEDED
    event = op.events.get(version=op.version)
    assert (event.decided_by.username, event.evidence["two_person"]["proposed_by"]) == (
        "bob", "ada")
    for context, _ in pages:
        context.close()


def test_bulk_abandon_of_a_filtered_set(browser_page):
    from playwright.sync_api import expect

    page = browser_page
    UserFactory(username="reviewer", role="reviewer")
    mail = [OperationFactory(operation="mail.send", state=State.OUTCOME_UNKNOWN)
            for _ in range(4)]
    others = [OperationFactory(operation="articles.create", state=State.OUTCOME_UNKNOWN)
              for _ in range(2)]
    log_in(page, "reviewer")
    # The filter: a name, then a state (choosing it reloads the list).
    page.fill("form.filters input[name=operation]", "mail.send")
    page.select_option("form.filters select[name=state]", State.OUTCOME_UNKNOWN)
    page.wait_for_url("**operation=mail.send**")
    expect(page.locator("table.queue tbody tr")).to_have_count(len(mail))
    page.check("input[name=all_matching]")
    # Choosing the decision does not reload the queue (the filter's selects do).
    page.select_option("select[name=to_state]", State.ABANDONED)
    page.fill("input[name=reason]", "the mail server lost them; resent by hand")
    page.click("#bulk-form button[type=submit]")
    page.locator("#bulk-result >> text=4 decided, 0 skipped").wait_for()
    screenshot(page, "bulk-abandon")
    states = dict(Operation.objects.values_list("operation_id", "state"))
    assert {states[op.operation_id] for op in mail} == {State.ABANDONED}
    assert {states[op.operation_id] for op in others} == {State.OUTCOME_UNKNOWN}
    assert page.console_errors == []
