"""Fact conflicts in a real browser: find one in the queue, use a value, see it leave."""

import pytest

from ledger import facts, runs
from ledger.models import FactConflict
from tests.e2e.conftest import log_in, screenshot
from tests.factories import UserFactory, ensure_roles
from tests.review.execution_setup import make_conflict

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

HOSTILE = "<img src=x onerror=alert(1)>"


@pytest.fixture(autouse=True)
def roles(transactional_db):
    ensure_roles()


def test_reviewer_uses_the_candidate_value_and_the_conflict_leaves_the_queue(browser_page):
    page = browser_page
    UserFactory(username="reviewer", role="reviewer")
    run = runs.start("Reconcile March invoices", run_id="run-march")
    conflict = make_conflict(run=run, candidate={"paid": True, "memo": HOSTILE})
    other = make_conflict("invoice:43")

    log_in(page, "reviewer")
    assert page.locator('[data-count="fact_conflicts"]').inner_text() == "2"
    page.click("text=Fact conflicts >> nth=-1")
    page.wait_for_url("**/conflicts/")
    page.click(f"a[href='/conflicts/{conflict.pk}/']")
    page.wait_for_url(f"**/conflicts/{conflict.pk}/")
    candidate = page.locator("#side-candidate")
    assert "bank-feed" in candidate.inner_text() and HOSTILE in candidate.inner_text()
    assert page.locator("img").count() == 0
    screenshot(page, "fact-conflict")

    page.fill("#id_reason", "The bank statement shows the payment on 3 March")
    candidate.locator("button", has_text="Use this value").click()
    page.locator("#decision >> text=Recorded: used the candidate value").wait_for()
    assert page.locator("button[name=winner]").count() == 0
    current = facts.read_fact("invoice:42", "status")
    assert (current.version, current.source) == (2, "reviewer:reviewer")
    assert current.value["paid"] is True
    assert not FactConflict.objects.get(pk=conflict.pk).is_open

    page.goto("/conflicts/")
    assert page.locator(f"a[href='/conflicts/{conflict.pk}/']").count() == 0
    assert page.locator(f"a[href='/conflicts/{other.pk}/']").count() == 1
    assert page.locator('[data-count="fact_conflicts"]').inner_text() == "1"

    page.goto("/runs/run-march/")
    assert page.locator("#objective").inner_text() == "Reconcile March invoices"
    assert "reviewer:reviewer" in page.locator("#facts").inner_text()
    screenshot(page, "run")
    assert page.dialogs == [] and page.console_errors == []
