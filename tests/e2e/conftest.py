"""A real Chromium (the system's, never a download) against pytest-django's live server.

Without /usr/bin/chromium the browser tests are skipped with a loud notice, unless
REQUIRE_E2E=1 (as in .ci/run): then they fail.
"""

import os
import sys
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
PASSWORD = "correct horse battery staple"


# One browser per test module, not per session: Playwright's sync API keeps its event loop
# running in this thread while the browser lives, and a test that starts a loop of its own
# (asyncio.run) after the browser tests on the same worker (`make test`'s parallel workers
# take whole test files in no fixed order) would find it running.
@pytest.fixture(scope="module")
def chromium():
    if not Path(CHROMIUM).exists():
        message = (f"NO CHROMIUM AT {CHROMIUM}: the browser tests did NOT run "
                   "(apt-get install chromium)")
        if os.environ.get("REQUIRE_E2E") == "1":
            pytest.fail(f"{message}, and REQUIRE_E2E=1 requires them")
        print(f"\n!!!!! {message} !!!!!", file=sys.stderr)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread; the ORM calls the tests make
    # to set up data are still plain synchronous calls. Only while the browser runs.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            yield browser
            browser.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def browser_page(chromium, live_server):
    """A fresh browser context at 1280 px; `.dialogs` and `.console_errors` collect both."""
    context = chromium.new_context(base_url=live_server.url,
                                   viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.dialogs = []
    page.console_errors = []

    def on_dialog(dialog):
        page.dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", on_dialog)
    page.on("console", lambda msg: msg.type == "error" and page.console_errors.append(msg.text))
    page.on("pageerror", lambda exc: page.console_errors.append(str(exc)))
    yield page
    context.close()


def log_in(page, username: str, password: str = PASSWORD):
    page.goto("/")
    page.wait_for_url("**/accounts/login/**")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_url(lambda url: "/accounts/login/" not in url)


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
