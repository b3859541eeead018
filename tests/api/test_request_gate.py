"""What the outside attack run sent that it should not have got through with: bodies over
the limit, integers past PostgreSQL's, booleans for numbers, bodies that are not objects or
not JSON, and a fact from the future. A real server process (uvicorn on config.asgi), and
MCP over both transports; every refusal is problem+json (HTTP) or a tool error naming the
field (MCP), never a 500 or an unexpected exception."""

from __future__ import annotations

import http.client
import json

import anyio
import pytest

from ledger.models import Fact, Operation
from tests.api.test_http import PROBLEM, assert_problem, record
from tests.api.test_mcp import over_http, stdio

pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = 1024 * 1024  # LEDGER_MAX_REQUEST_BYTES' default


@pytest.fixture
def agent(make_key, client_for):
    return client_for(make_key("gate-bot"))


def submitted_url(agent) -> str:
    created = record(agent)
    assert created.status_code == 201, created.text
    return f"/api/v1/operations/{created.json()['operation_id']}/submitted"


@pytest.mark.parametrize("size", [LIMIT + 1, 3 * 1024 * 1024])
def test_a_body_over_the_limit_is_413_problem_json(agent, size):
    padding = "x" * size
    body = json.dumps({"operation": "mail.send", "target": "t", "intent": {"p": padding}})
    response = agent.post("/api/v1/operations", content=body,
                          headers={"Content-Type": "application/json"})
    problem = assert_problem(response, 413, detail_has=f"at most {LIMIT} bytes "
                                                       "(LEDGER_MAX_REQUEST_BYTES)")
    assert problem["limit"] == LIMIT
    assert not Operation.objects.exists()


def test_a_body_sent_in_chunks_without_a_length_is_cut_off_at_the_limit(agent):
    def chunks():
        for _ in range(40):
            yield b"x" * 65536

    response = agent.post("/api/v1/operations", content=chunks(),
                          headers={"Content-Type": "application/json"})
    assert_problem(response, 413, detail_has="found more than that")


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_sent(api_server,
                                                                             make_key):
    secret = make_key("declared-bot")
    host, port = api_server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/api/v1/operations")
    conn.putheader("Authorization", f"Bearer {secret}")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(50 * 1024 * 1024))
    conn.endheaders(b"{")  # one byte of the 50 MB announced; the answer comes at once
    response = conn.getresponse()
    body = response.read()
    conn.close()
    assert response.status == 413, body[:300]
    assert response.headers["Content-Type"] == PROBLEM
    assert json.loads(body)["status"] == 413


@pytest.mark.parametrize(("body", "field"), [
    ({"expected_version": 2**31}, "expected_version"),
    ({"expected_version": 2**63}, "expected_version"),
    ({"expected_version": -1}, "expected_version"),
    ({"fencing_token": 2**63}, "fencing_token"),
])
def test_integers_past_postgresqls_range_are_422_naming_the_field(agent, body, field):
    problem = assert_problem(agent.post(submitted_url(agent), json=body), 422)
    assert field in problem["detail"]


def test_the_largest_postgresql_integer_as_a_version_is_a_stale_version(agent):
    # In range, but no operation can be at it and move on: a 409, as any version not the
    # operation's current one.
    response = agent.post(submitted_url(agent), json={"expected_version": 2**31 - 1})
    problem = assert_problem(response, 409, detail_has="at version 2147483647")
    assert problem["current_version"] == 1


@pytest.mark.parametrize("body", [{"expected_version": True}, {"expected_version": "1"},
                                  {"expected_version": 1.5}, {"fencing_token": False},
                                  {"in_flight_seconds": True}, {"in_flight_seconds": "5"}])
def test_booleans_strings_and_fractions_are_not_integers(agent, body):
    problem = assert_problem(agent.post(submitted_url(agent), json=body), 422)
    assert next(iter(body)) in problem["detail"]


@pytest.mark.parametrize("raw", [b"false", b"[]", b"1", b'"text"', b"null", b"", b"  "])
def test_a_body_must_be_a_json_object(agent, raw):
    response = agent.post(submitted_url(agent), content=raw,
                          headers={"Content-Type": "application/json"})
    assert_problem(response, 422, detail_has="expected a JSON object as the request body")
    assert Operation.objects.get().state == "planned"


@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded",
                                          "application/jsonx"])
def test_a_body_that_is_not_declared_json_is_415(agent, content_type):
    body = json.dumps({"operation": "mail.send", "target": "t", "intent": {}}).encode()
    headers = {"Content-Type": content_type} if content_type else {}
    request = agent.build_request("POST", "/api/v1/operations", content=body, headers=headers)
    if content_type is None:
        request.headers.pop("Content-Type", None)
    response = agent.send(request)
    assert_problem(response, 415, detail_has="expected Content-Type: application/json")
    assert not Operation.objects.exists()


def test_json_with_a_charset_is_json(agent):
    body = json.dumps({"operation": "mail.send", "target": "t", "intent": {}}).encode()
    response = agent.post("/api/v1/operations", content=body,
                          headers={"Content-Type": "application/json; charset=utf-8"})
    assert response.status_code == 201, response.text


def test_without_a_key_the_answer_is_401_whatever_the_body(client_for):
    response = client_for(None).post("/api/v1/operations", content=b"false",
                                     headers={"Content-Type": "text/plain"})
    assert_problem(response, 401)


def test_a_fact_observed_in_year_9999_is_422(agent):
    response = agent.post("/api/v1/facts", json={
        "subject": "order:1", "predicate": "status", "value": "paid",
        "observed_at": "9999-01-01T00:00:00Z"})
    assert_problem(response, 422, detail_has="expected observed_at at most 300 s after")
    assert not Fact.objects.exists()


# --- MCP ----------------------------------------------------------------------------------


async def _range_and_type_errors(client) -> list[str]:
    recorded = await client.call_tool("ledger_record_intent", {
        "operation": "mail.send", "target": "smtp://x", "intent": {"n": 1},
        "idempotency_key": "gate-mcp"})
    assert not recorded.is_error, recorded.content
    op_id = recorded.structured_content["operation"]["operation_id"]
    texts = []
    for arguments in ({"expected_version": 2**31}, {"expected_version": True},
                      {"fencing_token": 2**63}, {"expected_version": 2**31 - 1}):
        result = await client.call_tool("ledger_mark_submitted",
                                        {"operation_id": op_id, **arguments})
        assert result.is_error, (arguments, result.content)
        texts.append(result.content[0].text)
    fact = await client.call_tool("state_assert_fact", {
        "subject": "order:1", "predicate": "status", "value": "paid",
        "expected_version": 2**31})
    assert fact.is_error
    texts.append(fact.content[0].text)
    return texts


def _assert_clean(texts: list[str]) -> None:
    for text, field in zip(texts, ["expected_version", "expected_version", "fencing_token",
                                   "expected", "expected_version"], strict=True):
        assert field in text, text
        assert "out of range" not in text and "Traceback" not in text, text
    assert "Stale version" in texts[3], texts[3]


def test_mcp_over_stdio_refuses_out_of_range_and_boolean_numbers_naming_the_field(make_key):
    secret = make_key("gate-mcp-stdio")

    async def main():
        async with stdio(secret) as client:
            return await _range_and_type_errors(client)

    _assert_clean(anyio.run(main))
    assert Operation.objects.get().state == "planned"


def test_mcp_over_http_refuses_the_same_and_a_body_over_the_limit(make_key, api_server):
    import httpx

    secret = make_key("gate-mcp-http")

    async def main():
        http, client = over_http(api_server, secret)
        async with http, client:
            return await _range_and_type_errors(client)

    _assert_clean(anyio.run(main))
    response = httpx.post(f"{api_server}/mcp", content=b"{" + b" " * (LIMIT + 1) + b"}",
                          headers={"Authorization": f"Bearer {secret}",
                                   "Content-Type": "application/json",
                                   "Accept": "application/json, text/event-stream"},
                          timeout=30)
    assert_problem(response, 413, detail_has="LEDGER_MAX_REQUEST_BYTES")
