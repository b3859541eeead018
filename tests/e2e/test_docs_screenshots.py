"""The screenshots of the documentation site (docs/desk.md), taken of the real desk in a
real Chromium at every run of the browser tests. A test run writes them to its own temporary
folder, so it never changes a tracked file; `make screenshots` (LEDGER_UPDATE_SCREENSHOTS=1)
puts them in docs/assets/screenshots, and `make docs` fails if one is missing."""

import os
import shutil
from pathlib import Path

import pytest

from ledger.states import State
from tests.e2e.conftest import log_in
from tests.factories import OperationFactory, UserFactory, add_evidence, ensure_roles

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

DOCS_SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "assets" / "screenshots"


def shoot(page, folder: Path, name: str) -> Path:
    path = folder / f"{name}.png"
    page.screenshot(path=str(path))  # the viewport: what a reviewer sees first
    return path


def test_the_desk_pages_the_documentation_shows_are_photographed(browser_page, tmp_path):
    ensure_roles()
    page = browser_page
    UserFactory(username="reviewer", role="reviewer")
    stuck = OperationFactory(state=State.RECONCILING, operation="payments.refund",
                             target="https://billing.example/api/refunds",
                             intent={"order": "A-1042", "amount": 120, "currency": "EUR"})
    add_evidence(stuck, verdict="not_yet", observed={"status": "pending"},
                 reconciler="payments.refund")
    add_evidence(stuck, verdict="ambiguous", to_state=State.MANUAL_REVIEW,
                 reconciler="payments.refund",
                 observed={"matches": [{"id": "re_81"}, {"id": "re_82"}]},
                 detail="two refunds match order A-1042 and the amount")
    for title in ("Harbour reopens after storm", "Weekend weather", "Markets close higher"):
        OperationFactory(state=State.OUTCOME_UNKNOWN, intent={"title": title, "body": "..."})
    OperationFactory(state=State.SAFE_TO_RETRY, operation="mail.send",
                     target="smtp://mail.example", intent={"to": "ada@example.com"})

    log_in(page, "reviewer")
    page.locator(f"text={stuck.operation_id}").wait_for()
    written = [shoot(page, tmp_path, "desk-queue")]

    page.click(f"text={stuck.operation_id}")
    page.wait_for_url(f"**/operations/{stuck.operation_id}/")
    page.locator("#evidence >> text=two refunds match").wait_for()
    written.append(shoot(page, tmp_path, "desk-operation"))

    page.goto("/audit/")
    page.locator("main").wait_for()
    written.append(shoot(page, tmp_path, "desk-audit"))

    for path in written:
        assert path.stat().st_size > 10_000, f"expected a screenshot at {path}, found a stub"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (DOCS_SCREENSHOTS / path.name).exists(), (
            f"expected docs/assets/screenshots/{path.name} (the docs show it), found none: "
            "run `make screenshots`")
    if os.environ.get("LEDGER_UPDATE_SCREENSHOTS") == "1":
        for path in written:
            shutil.copyfile(path, DOCS_SCREENSHOTS / path.name)
