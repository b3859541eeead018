"""The API's ASGI handler (config.asgi.APIHandler) driven in process: each request's
synchronous work on one worker thread, Django's request signals around it there, and
problem+json when something fails outside the API's own error handlers."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from django.core import signals

pytestmark = pytest.mark.django_db(transaction=True)

PROBLEM = "application/problem+json"


@pytest.fixture
def api_app(monkeypatch):
    # Without the pool the module would add to DATABASES: the test process keeps its own.
    monkeypatch.setenv("DJANGO_DB_POOL_MAX_SIZE", "0")
    from config import asgi

    return asgi.api_application


def call(app, method: str, path: str, *, body: bytes = b"", secret: str = ""):
    """One request through `app` on a fresh event loop -> (status, headers, body)."""
    headers = [(b"host", b"testserver"), (b"content-type", b"application/json")]
    if secret:
        headers.append((b"authorization", f"Bearer {secret}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}
    half = len(body) // 2  # the body in two messages, as a server passes a large one
    messages = [{"type": "http.request", "body": body[:half], "more_body": True},
                {"type": "http.request", "body": body[half:], "more_body": False}]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start, rest = sent[0], sent[1:]
    assert start["type"] == "http.response.start" and rest[-1].get("more_body") is not True
    return (start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]},
            b"".join(m.get("body", b"") for m in rest))


@pytest.fixture
def signal_threads():
    """[(signal name, thread id), ...] of every request_started and request_finished."""
    seen = []

    def started(**kwargs):
        seen.append(("started", threading.get_ident()))

    def finished(**kwargs):
        seen.append(("finished", threading.get_ident()))

    signals.request_started.connect(started)
    signals.request_finished.connect(finished)
    yield seen
    signals.request_started.disconnect(started)
    signals.request_finished.disconnect(finished)


def test_a_request_runs_between_its_signals_on_one_worker_thread(api_app, make_key,
                                                                  signal_threads):
    secret = make_key("billing-bot")
    intent = {"to": "ada@example.com", "pad": "x" * 80_000}
    body = json.dumps({"operation": "mail.send", "target": "smtp://mail.example",
                       "intent": intent, "idempotency_key": "in-process"}).encode()

    status, headers, content = call(api_app, "POST", "/api/v1/operations", body=body,
                                    secret=secret)

    assert status == 201, content
    assert json.loads(content)["state"] == "planned"
    assert headers["x-frame-options"] == "DENY"  # the API's middleware ran
    assert "set-cookie" not in headers  # no session middleware
    assert [name for name, _ in signal_threads] == ["started", "finished"]
    (_, started), (_, finished) = signal_threads
    assert started == finished != threading.get_ident()  # not the event loop's thread


def test_a_failure_outside_the_api_handlers_is_problem_json(api_app, signal_threads):
    def broken(**kwargs):
        raise RuntimeError("a request_started receiver failed")

    signals.request_started.connect(broken)
    try:
        status, headers, content = call(api_app, "GET", "/api/v1/operations")
    finally:
        signals.request_started.disconnect(broken)

    assert status == 500 and headers["content-type"] == PROBLEM
    problem = json.loads(content)
    assert problem["type"] == "urn:agent-ledger:problem:internal-error"
    assert "RuntimeError" not in content.decode()  # logged, never answered
    assert [name for name, _ in signal_threads] == ["started", "finished"]
