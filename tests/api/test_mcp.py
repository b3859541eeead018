"""An MCP client from the `mcp` SDK against both transports: stdio (a `manage.py mcp`
subprocess) and Streamable HTTP (/mcp on the uvicorn server), on the test database."""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timedelta

import anyio
import httpx
import pytest
from django.db import connection
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from ledger.models import Fact, FactConflict, Operation, OperationEvent
from tests.support.processes import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

TOOLS = {"ledger_record_intent", "ledger_mark_submitted", "ledger_mark_succeeded",
         "ledger_mark_rejected", "ledger_mark_outcome_unknown", "ledger_get_operation",
         "state_read_facts", "state_assert_fact", "state_open_obligation", "state_commit",
         "run_resume"}


def stdio(secret: str) -> Client:
    """`manage.py mcp` with the key in the environment (kept out of `ps`)."""
    return Client(StdioServerParameters(
        command=sys.executable, args=["manage.py", "mcp"], cwd=str(ROOT),
        env={**os.environ, "LEDGER_AGENT_KEY": secret,
             "LEDGER_DATABASE_NAME": connection.settings_dict["NAME"]},
    ))


def over_http(url: str, secret: str):
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {secret}"})
    return http, Client(streamable_http_client(f"{url}/mcp", http_client=http))


async def lifecycle_and_fact_conflict(client: Client) -> None:
    listed = await client.list_tools()
    tools = {tool.name: tool for tool in listed.tools}
    assert set(tools) >= TOOLS
    for name in TOOLS:
        assert tools[name].description and len(tools[name].description) > 60
        assert tools[name].input_schema["type"] == "object"
    assert "operation_id" in tools["ledger_mark_succeeded"].input_schema["required"]

    recorded = await client.call_tool("ledger_record_intent", {
        "operation": "mail.send", "target": "smtp://mail.example",
        "intent": {"to": "ada@example.com", "password": "hunter2"},
        "idempotency_key": "welcome-ada"})
    assert not recorded.is_error, recorded.content
    op = recorded.structured_content["operation"]
    assert recorded.structured_content["created"] is True
    assert op["state"] == "planned" and op["intent"]["password"] == "[redacted]"

    # A refusal arrives as a tool error carrying the ledger's message, not as a crash.
    refused = await client.call_tool("ledger_mark_succeeded", {"operation_id": op["operation_id"]})
    assert refused.is_error
    assert "IllegalTransition" in refused.content[0].text
    assert "expected planned -> one of abandoned, submitted" in refused.content[0].text
    assert "State." not in refused.content[0].text

    submitted = await client.call_tool("ledger_mark_submitted",
                                       {"operation_id": op["operation_id"],
                                        "expected_version": 1, "in_flight_seconds": 45})
    assert not submitted.is_error and submitted.structured_content["state"] == "submitted"
    sent = submitted.structured_content
    assert (datetime.fromisoformat(sent["in_flight_until"])
            - datetime.fromisoformat(sent["submitted_at"])) == timedelta(seconds=45)
    done = await client.call_tool("ledger_mark_succeeded",
                                  {"operation_id": op["operation_id"], "external_id": "msg-7"})
    assert done.structured_content["state"] == "succeeded"
    replay = await client.call_tool("ledger_record_intent", {
        "operation": "mail.send", "target": "smtp://mail.example",
        "intent": {"to": "ada@example.com", "password": "other"},
        "idempotency_key": "welcome-ada"})
    assert replay.structured_content["created"] is False
    assert replay.structured_content["operation"]["state"] == "succeeded"
    receipt = await client.call_tool("ledger_get_operation", {"operation_id": op["operation_id"]})
    assert [e["to_state"] for e in receipt.structured_content["events"]] == [
        "planned", "submitted", "succeeded"]

    first = await client.call_tool("state_assert_fact", {
        "subject": "customer:42", "predicate": "email", "value": "ada@example.com"})
    assert first.structured_content["version"] == 1
    conflicting = await client.call_tool("state_assert_fact", {
        "subject": "customer:42", "predicate": "email", "value": "grace@example.com"})
    assert conflicting.structured_content["is_candidate"] is True
    current = await client.call_tool("state_read_facts", {"subject": "customer:42"})
    assert [f["value"] for f in current.structured_content["facts"]] == ["ada@example.com"]

    missing = await client.call_tool("ledger_get_operation",
                                     {"operation_id": "20260101T000000Z-0000000000"})
    assert missing.is_error and "NotFound" in missing.content[0].text


def assert_recorded_as(agent: str) -> None:
    assert Operation.objects.get().external_id == "msg-7"
    assert set(OperationEvent.objects.values_list("actor_id", flat=True)) == {agent}
    assert FactConflict.objects.get().candidate.source == agent
    assert Fact.objects.get(status="current").source == agent


def test_stdio_lists_the_tools_and_runs_a_lifecycle_and_a_fact_conflict(make_key):
    secret = make_key("stdio-bot")

    async def main():
        async with stdio(secret) as client:
            await lifecycle_and_fact_conflict(client)

    anyio.run(main)
    assert_recorded_as("stdio-bot")


def test_streamable_http_lists_the_tools_and_runs_a_lifecycle_and_a_fact_conflict(
    make_key, api_server
):
    secret = make_key("http-bot")

    async def main():
        http, client = over_http(api_server, secret)
        async with http, client:
            await lifecycle_and_fact_conflict(client)

    anyio.run(main)
    assert_recorded_as("http-bot")


def test_obligations_and_resume_over_mcp(make_key, api_server):
    secret = make_key("http-bot")

    async def main():
        http, client = over_http(api_server, secret)
        async with http, client:
            run = await client.call_tool("run_start", {"objective": "refunds",
                                                       "run_id": "run-m"})
            assert not run.is_error, run.content
            resumed = await client.call_tool("run_resume", {"run_id": "run-m"})
            token = resumed.structured_content["token"]
            opened = await client.call_tool("state_open_obligation", {
                "run": "run-m", "kind": "refund", "key": "refund-1", "fencing_token": token})
            assert opened.structured_content["state"] == "open"
            won = await client.call_tool("state_commit", {"key": "refund-1",
                                                          "result": {"id": "r-1"},
                                                          "fencing_token": token})
            assert won.structured_content["result"] == {"id": "r-1"}
            lost = await client.call_tool("state_commit", {"key": "refund-1",
                                                           "result": {"id": "r-2"},
                                                           "fencing_token": token})
            assert lost.is_error
            text = lost.content[0].text
            assert "AlreadyCommitted" in text
            assert json.loads(text.splitlines()[-1])["result"] == {"id": "r-1"}

    anyio.run(main)


def test_mcp_over_http_needs_a_live_key(make_key, api_server, admin):
    assert httpx.post(f"{api_server}/mcp", json={}).status_code == 401
    refused = httpx.post(f"{api_server}/mcp", json={},
                         headers={"Authorization": "Bearer alk_" + "x" * 43})
    assert refused.status_code == 401
    assert refused.headers["content-type"] == "application/problem+json"
    from ledger import agent_keys

    secret = make_key("soon-revoked")
    agent_keys.revoke("soon-revoked", user=admin)
    revoked = httpx.post(f"{api_server}/mcp", json={},
                         headers={"Authorization": f"Bearer {secret}"})
    assert revoked.status_code == 401


def test_stdio_refuses_to_start_without_a_live_key():
    import subprocess

    env = {**os.environ, "LEDGER_DATABASE_NAME": connection.settings_dict["NAME"]}
    env.pop("LEDGER_AGENT_KEY", None)
    none = subprocess.run([sys.executable, "manage.py", "mcp"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert none.returncode != 0 and "expected an agent key" in none.stderr
    bad = subprocess.run([sys.executable, "manage.py", "mcp", "--key", "alk_nope"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "expected a live agent key" in bad.stderr


def test_record_intent_with_keep_stores_only_the_listed_fields(make_key):
    secret = make_key("keep-mcp-bot")

    async def main():
        async with stdio(secret) as client:
            recorded = await client.call_tool("ledger_record_intent", {
                "operation": "mail.send", "target": "smtp://mail.example",
                "intent": {"to": "ada@example.com", "body": "UnkeptMcpBodyQ9"},
                "idempotency_key": "keep-mcp", "keep": ["to"]})
            assert not recorded.is_error, recorded.content
            return recorded.structured_content["operation"]

    op = anyio.run(main)
    assert op["intent"] == {"to": "ada@example.com"}
    assert Operation.objects.get().intent == {"to": "ada@example.com"}
    assert "UnkeptMcpBodyQ9" not in json.dumps(list(OperationEvent.objects.values()),
                                                default=str)


def test_record_intent_relying_on_a_fact_is_not_submitted_once_it_is_superseded(make_key):
    secret = make_key("relies-mcp-bot")

    async def main():
        async with stdio(secret) as client:
            await client.call_tool("state_assert_fact", {
                "subject": "order:77", "predicate": "status", "value": "paid"})
            recorded = await client.call_tool("ledger_record_intent", {
                "operation": "parcels.ship", "target": "https://carrier.example",
                "intent": {"order": 77}, "idempotency_key": "ship-77",
                "relies_on": [{"subject": "order:77", "predicate": "status", "version": 1}]})
            assert not recorded.is_error, recorded.content
            await client.call_tool("state_assert_fact", {
                "subject": "order:77", "predicate": "status", "value": "refunded",
                "expected_version": 1})
            return await client.call_tool("ledger_mark_submitted", {
                "operation_id": recorded.structured_content["operation"]["operation_id"]})

    refused = anyio.run(main)
    assert refused.is_error and "StaleFact" in refused.content[0].text
    assert Operation.objects.get().state == "planned"


def test_record_intent_takes_the_provider_account_beside_the_target(make_key):
    secret = make_key("account-mcp-bot")

    async def main():
        async with stdio(secret) as client:
            recorded = await client.call_tool("ledger_record_intent", {
                "operation": "mail.send", "target": "smtp://mail.example",
                "account": "ops@example.com", "intent": {"to": "ada@example.com"},
                "idempotency_key": "account-mcp"})
            assert not recorded.is_error, recorded.content
            other = await client.call_tool("ledger_record_intent", {
                "operation": "mail.send", "target": "smtp://mail.example",
                "account": "sales@example.com", "intent": {"to": "ada@example.com"},
                "idempotency_key": "account-mcp"})
            return recorded.structured_content["operation"], other

    op, other = anyio.run(main)
    assert op["account"] == "ops@example.com"
    assert Operation.objects.get().account == "ops@example.com"
    assert other.is_error
    assert "to come with account 'ops@example.com'" in other.content[0].text
