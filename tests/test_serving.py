"""`make serve`'s stack as a real server process: gunicorn with uvicorn workers on
config.asgi, production settings, whitenoise, the connection pool, /healthz and /metrics.

Talks HTTP to it over loopback, as a browser behind a TLS-terminating proxy would
(X-Forwarded-Proto: https), keeping its own cookies.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote, urlencode

import pytest
from django.db import connection

from ledger.states import State
from tests.factories import OperationFactory, UserFactory
from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "served over asgi 4 real"
TOKEN = "serving-test-metrics-token-0123456789"


def database_url() -> str:
    db = connection.settings_dict
    host = quote(db["HOST"] or "127.0.0.1", safe="")
    return f"postgres://{db['USER']}@{host}:{db['PORT'] or 5432}/{db['NAME']}"



class Browser:
    """Just enough of a browser: keeps cookies, sends what a proxy in front would."""

    def __init__(self, port: int):
        self.port = port
        self.origin = f"https://127.0.0.1:{port}"
        self.cookies: dict[str, str] = {}

    def request(self, method: str, path: str, body: dict | None = None,
                headers: dict | None = None) -> tuple[http.client.HTTPResponse, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        sent = {"Host": f"127.0.0.1:{self.port}", "X-Forwarded-Proto": "https",
                **(headers or {})}
        if self.cookies:
            sent["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        data = None
        if body is not None:
            data = urlencode(body)
            sent.update({"Content-Type": "application/x-www-form-urlencoded",
                         "Origin": self.origin, "Referer": f"{self.origin}{path}"})
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        content = response.read()
        for header in response.headers.get_all("Set-Cookie") or []:
            name, _, rest = header.partition("=")
            self.cookies[name.strip()] = rest.split(";", 1)[0]
        conn.close()
        return response, content


@pytest.fixture
def server(tmp_path):
    with serving(tmp_path) as served:
        yield served


@contextmanager
def serving(tmp_path, **overrides):
    """gunicorn as `make serve` runs it, on loopback, with environment `overrides`."""
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in {"LEDGER_DATABASE_NAME", "DJANGO_ALLOW_ASYNC_UNSAFE"}}
    env.update(
        DJANGO_ENV="production",
        DJANGO_SECRET_KEY="serving-test-" + "s3cr3t-" * 8,
        DJANGO_ALLOWED_HOSTS="127.0.0.1",
        DJANGO_SECURE_SSL_REDIRECT="0",
        DATABASE_URL=database_url(),
        LEDGER_STATIC_ROOT=str(tmp_path / "static"),
        LEDGER_METRICS_TOKEN=TOKEN,
        GUNICORN_BIND=f"127.0.0.1:{port}",
        GUNICORN_WORKERS="2",
        PYTHONUNBUFFERED="1",
        **overrides,
    )
    collected = subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--no-input", "-v", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert collected.returncode == 0, collected.stderr
    log = (tmp_path / "gunicorn.log").open("w")
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("gunicorn")), "-c", "config/gunicorn.conf.py",
         "config.asgi:application"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("expected gunicorn to listen, found it "
                                         f"{'exited' if proc.poll() is not None else 'silent'}:"
                                         f"\n{(tmp_path / 'gunicorn.log').read_text()}") from None
                time.sleep(0.2)
        yield Browser(port), tmp_path / "gunicorn.log"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


@pytest.mark.django_db(transaction=True)
def test_gunicorn_serves_the_desk_its_static_files_health_and_metrics_over_asgi(server):
    browser, log = server
    op = OperationFactory(state=State.OUTCOME_UNKNOWN, intent={"title": "<b>served</b>"})
    user = UserFactory(username="served-reviewer", role="reviewer")
    user.set_password(PASSWORD)
    user.save()

    response, body = browser.request("GET", "/healthz")
    assert response.status == 200, body
    assert json.loads(body)["status"] == "ok"
    assert "uvicorn" in response.headers.get("server", "")  # the ASGI worker answered

    response, _ = browser.request("GET", "/")
    assert response.status == 302 and "/accounts/login/" in response.headers["Location"]

    response, body = browser.request("GET", "/accounts/login/")
    assert response.status == 200
    token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', body).group(1).decode()
    stylesheet = re.search(rb'href="(/static/desk/desk\.[0-9a-f]{12}\.css)"', body)
    assert stylesheet, "expected the hashed stylesheet name of collectstatic's manifest"
    response, body = browser.request("POST", "/accounts/login/", {
        "username": "served-reviewer", "password": PASSWORD, "csrfmiddlewaretoken": token})
    assert response.status == 302, body[:2000]

    response, body = browser.request("GET", "/")
    assert response.status == 200 and op.operation_id.encode() in body
    assert "no-store" in response.headers["Cache-Control"]
    response, body = browser.request("GET", f"/operations/{op.operation_id}/")
    assert response.status == 200
    assert b"&lt;b&gt;served&lt;/b&gt;" in body and b"<b>served</b>" not in body

    response, css = browser.request("GET", stylesheet.group(1).decode(),
                                    headers={"Accept-Encoding": "gzip"})
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/css")
    assert response.headers["Content-Encoding"] == "gzip"
    assert "immutable" in response.headers["Cache-Control"]

    response, body = browser.request("GET", "/metrics",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status == 200
    assert b'ledger_operations{state="outcome_unknown",tenant="default"} 1.0' in body
    response, _ = browser.request("GET", "/metrics")
    assert response.status == 401
    assert "Traceback" not in log.read_text()


def _login(browser: Browser, username: str, password: str, forwarded_for: str):
    response, body = browser.request("GET", "/accounts/login/")
    token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', body).group(1).decode()
    return browser.request("POST", "/accounts/login/", {
        "username": username, "password": password, "csrfmiddlewaretoken": token,
    }, headers={"X-Forwarded-For": forwarded_for})


@pytest.mark.django_db(transaction=True)
def test_a_new_x_forwarded_for_on_every_attempt_does_not_escape_the_lockout(server):
    """The attack as it was run: from loopback, 20 wrong passwords, each claiming another
    address in X-Forwarded-For, then the right one from yet another. The served stack
    believes no forwarded header by default, and the lockout counts the username."""
    browser, log = server
    user = UserFactory(username="targeted-reviewer", role="reviewer")
    user.set_password(PASSWORD)
    user.save()
    for i in range(20):
        response, _ = _login(browser, "targeted-reviewer", "wrong", f"198.51.100.{i + 1}")
        assert response.status in (200, 429)
    response, body = _login(browser, "targeted-reviewer", PASSWORD, "203.0.113.77")
    assert response.status == 429, body[:500]
    assert "Login locked" in body.decode()


@pytest.mark.django_db(transaction=True)
def test_workers_recycled_under_load_drop_no_request(tmp_path):
    """8 agents, each on its own keep-alive connection, call without pause while 2 workers
    recycle every ~40 requests: no call fails (no reset, no connection closed under a
    request sent), and the workers did recycle."""
    import httpx

    with serving(tmp_path, GUNICORN_MAX_REQUESTS="40", GUNICORN_MAX_REQUESTS_JITTER="10",
                 GUNICORN_ACCESS_LOG="/dev/null") as (browser, log):
        url = f"http://127.0.0.1:{browser.port}/healthz"
        failures: list[str] = []
        answered = []

        def agent():
            with httpx.Client(timeout=30) as client:
                for _ in range(60):
                    try:
                        response = client.get(url, headers={"X-Forwarded-Proto": "https"})
                        if response.status_code != 200:
                            failures.append(f"{response.status_code}: {response.text[:200]}")
                        else:
                            answered.append(1)
                    except httpx.TransportError as exc:
                        failures.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=agent) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        text = log.read_text()
    recycled = text.count("Maximum request limit")
    assert recycled >= 4, text[-3000:]
    assert failures == [], f"{len(failures)} of 480 failed: {failures[:5]}"
    assert len(answered) == 480


def test_a_worker_runs_the_api_on_one_thread_fewer_than_its_pool_holds(monkeypatch):
    """config.workers.request_threads: the desk's thread and the API's threads together
    never want more connections than the worker's pool holds; LEDGER_WEB_THREADS wins."""
    from config.workers import request_threads

    monkeypatch.delenv("LEDGER_WEB_THREADS", raising=False)
    assert request_threads({"OPTIONS": {"pool": {"max_size": 4}}}) == 3
    assert request_threads({"OPTIONS": {"pool": {"max_size": 1}}}) == 1
    assert request_threads({"OPTIONS": {}}) is None  # no pool: asyncio's default executor
    monkeypatch.setenv("LEDGER_WEB_THREADS", "6")
    assert request_threads({"OPTIONS": {"pool": {"max_size": 4}}}) == 6
