"""Production fails politely: under the served ASGI stack (gunicorn + uvicorn, production
settings, the web login that switches between the agent's and the desk's roles), an unknown
URL is a 404 for every kind of caller, and a 500 logs its traceback under a request id that
the response's header and the error page show. Logs: one line a record, with time, level
and logger; LEDGER_LOG_FORMAT=json makes each line a JSON object.

One served stack for the whole walk (CI time), on the web login of tests/conftest.py.
"""

from __future__ import annotations

import json
import logging
import re
import sys

import pytest

from ledger import agent_keys
from tests.conftest import TEST_LOGINS
from tests.factories import UserFactory
from tests.test_serving import PASSWORD, Browser, serving

UNKNOWN_DESK_PATHS = ["/no-such-page/", "/operations/no-such-operation/extra/",
                      "/accounts/no-such-thing/", "/static/no-such-file.css"]
UNKNOWN_AGENT_PATHS = ["/api/v1/no-such-route", "/api/no-such-version/operations",
                       "/mcp/no-such-endpoint"]


def login(browser: Browser, username: str) -> None:
    response, body = browser.request("GET", "/accounts/login/")
    assert response.status == 200, body[:500]
    token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', body).group(1).decode()
    response, body = browser.request("POST", "/accounts/login/", {
        "username": username, "password": PASSWORD, "csrfmiddlewaretoken": token})
    assert response.status == 302, f"expected {username} to log in, found {response.status}"


@pytest.mark.django_db(transaction=True)
def test_unknown_urls_are_404_for_everyone_and_a_500_logs_its_traceback_under_an_id(
        tmp_path, admin_user):
    browsers: dict[str, Browser] = {}
    for role in ("viewer", "reviewer", "admin"):
        user = UserFactory(username=f"walker-{role}", role=role)
        user.set_password(PASSWORD)
        user.save()
    _, secret = agent_keys.create("walker-bot", tenants=["default"], user=admin_user)

    with serving(tmp_path, LEDGER_DATABASE_USER=TEST_LOGINS["web"], LEDGER_LOG_FORMAT="json",
                 DJANGO_SETTINGS_MODULE="tests.support.error_settings") as (first, log):
        browsers["anonymous"] = first
        for role in ("viewer", "reviewer", "admin"):
            browsers[role] = Browser(first.port)
            login(browsers[role], f"walker-{role}")

        answers = [(who, path, *browser.request("GET", path))
                   for who, browser in browsers.items() for path in UNKNOWN_DESK_PATHS]
        wrong = [f"{path} as {who}: {response.status} {body[:200]!r}"
                 for who, path, response, body in answers if response.status != 404]
        assert wrong == [], f"expected 404 for every unknown desk path, found {wrong}"
        seen_ids = set()
        for who, path, response, body in answers:
            if path.startswith("/static/"):  # whitenoise answers static files itself
                continue
            request_id = response.headers.get("X-Request-ID", "")
            assert re.fullmatch(r"[0-9a-f]{32}", request_id), (
                f"expected a request id on {path} as {who}, found {request_id!r}")
            assert b"404" in body and request_id.encode() in body
            seen_ids.add(request_id)
        agent = Browser(first.port)
        for path in UNKNOWN_AGENT_PATHS:
            for method in ("GET", "POST"):
                response, body = agent.request(
                    method, path, headers={"Authorization": f"Bearer {secret}",
                                           "Content-Type": "application/json"})
                assert response.status == 404, (
                    f"expected 404 for {method} {path} with an agent key, found "
                    f"{response.status}: {body[:300]}")
        response, body = agent.request("GET", "/api/no-such-version/operations")
        assert response.headers["Content-Type"] == "application/problem+json", body[:300]
        assert json.loads(body)["status"] == 404
        assert len(seen_ids) == 4 * 3, "expected a new request id for every request"

        # A 500: the page and the header give the id; the log has the traceback under it.
        response, body = browsers["reviewer"].request("GET", "/boom-for-tests/")
        assert response.status == 500, body[:500]
        request_id = response.headers["X-Request-ID"]
        assert request_id.encode() in body and b"Something went wrong" in body
        assert b"boom for tests" not in body, "expected no error text on the page"
        response, body = agent.request("GET", "/boom-for-tests/")  # not logged in: no 500
        assert response.status == 302

    text = log.read_text()
    assert "permission denied" not in text, text[-3000:]
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise AssertionError(f"expected every log line to be a JSON object (line "
                                 f"{number}), found {line!r}") from None
        missing = {"time", "level", "logger", "message"} - set(record)
        assert not missing, f"expected time, level and logger on line {number}, found {record}"
        records.append(record)
    errors = [r for r in records if r["level"] == "ERROR" and r["request_id"] == request_id]
    assert len(errors) == 1, (
        f"expected one ERROR record under request id {request_id}, found {errors}")
    assert errors[0]["logger"] == "django.request"
    assert "Traceback" in errors[0]["exception"]
    assert "RuntimeError: boom for tests" in errors[0]["exception"]
    assert [r for r in records if r["logger"].startswith("gunicorn")], \
        "expected gunicorn's own lines in the same format"


def test_text_lines_carry_time_level_logger_and_request_id():
    from config.logs import RequestIdFilter, TextFormatter, current_request_id

    record = logging.LogRecord("ledger.reconcile", logging.ERROR, __file__, 1,
                               "reconciler %s failed", ("x",), None)
    try:
        raise ValueError("why it failed")
    except ValueError:
        record.exc_info = sys.exc_info()
    token = current_request_id.set("0123456789abcdef")
    try:
        RequestIdFilter().filter(record)
    finally:
        current_request_id.reset(token)
    line = TextFormatter().format(record)
    first = line.splitlines()[0]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ERROR ledger\.reconcile "
                        r"\[0123456789abcdef\] reconciler x failed", first), first
    assert "ValueError: why it failed" in line


def test_an_unknown_log_format_is_refused_naming_the_choices(monkeypatch):
    from django.core.exceptions import ImproperlyConfigured

    from config.logs import logging_config

    monkeypatch.setenv("LEDGER_LOG_FORMAT", "xml")
    with pytest.raises(ImproperlyConfigured, match="one of text, json, found 'xml'"):
        logging_config()


def test_a_request_id_from_the_client_is_not_taken_unless_a_proxy_is_trusted(client, settings):
    sent = "client-chosen-id-0001"
    response = client.get("/no-such-page/", HTTP_X_REQUEST_ID=sent)
    assert response.status_code == 404 and response["X-Request-ID"] != sent
    settings.LEDGER_TRUSTED_PROXY_COUNT = 1
    response = client.get("/no-such-page/", HTTP_X_REQUEST_ID=sent)
    assert response["X-Request-ID"] == sent
    response = client.get("/no-such-page/", HTTP_X_REQUEST_ID="bad id\nwith a newline")
    assert response["X-Request-ID"] != "bad id\nwith a newline"
