"""The demo's tests seed the demo: its articles service on a free port and its articles in
a file of the test's own (the seed serves DEMO_ARTICLES_PORT while it writes and leaves its
articles in DEMO_ARTICLES_FILE), never a running demo's port or the project's .local/."""

import pytest

from tests.support.servers import free_port


@pytest.fixture(autouse=True)
def demo_articles(monkeypatch, tmp_path):
    monkeypatch.setenv("DEMO_ARTICLES_PORT", str(free_port()))
    monkeypatch.setenv("DEMO_ARTICLES_FILE", str(tmp_path / "demo-articles.json"))
