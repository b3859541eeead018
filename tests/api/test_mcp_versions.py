"""MCP 2026-07-28 (no initialize handshake, no session: each request carries its protocol
version and the client's capabilities in `_meta`) beside the handshake era (2025-11-25,
2025-06-18), against the ledger's own /mcp and through the gateway, on both its sides, with
real server processes: uvicorn, `manage.py mcp_gateway`, the SDK-built upstream of
tests/api/gateway_upstream.py.

The SDK's client is pinned to a version by `mode`: "2026-07-28" adopts it without a probe;
"legacy" makes the initialize handshake, offering the newest handshake version
(`mcp.client.session.LATEST_HANDSHAKE_VERSION`, set lower here to offer 2025-06-18).
"""

from __future__ import annotations

import json
import sys
from contextlib import asynccontextmanager

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from ledger.models import Operation
from tests.api.test_gateway import (
    UPSTREAM,
    gateway_env,
    gateway_over_http,
    invoice,
    invoices,
    write_config,
)
from tests.support.loops import run_coroutine
from tests.support.processes import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

MODERN, HANDSHAKE, OLDER = "2026-07-28", "2025-11-25", "2025-06-18"


@pytest.fixture
def offer(monkeypatch):
    """Pins what the SDK's client offers in the handshake (its newest, else)."""
    def pin(version: str) -> None:
        if version in (HANDSHAKE, OLDER):
            monkeypatch.setattr("mcp.client.session.LATEST_HANDSHAKE_VERSION", version)
    return pin


@asynccontextmanager
async def speaking(url: str, secret: str, version: str, seen: list[dict] | None = None):
    """A client of `version` over Streamable HTTP; `seen` collects each response's headers."""
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {secret}"})

    async def keep(response):
        if seen is not None:
            seen.append({k.lower(): v for k, v in response.headers.items()})

    http.event_hooks["response"].append(keep)
    mode = version if version == MODERN else "legacy"
    async with http, Client(streamable_http_client(url, http_client=http), mode=mode,
                            cache=None) as client:
        assert client.protocol_version == version
        yield client


# --- the ledger's own /mcp ---------------------------------------------------------------


@pytest.mark.parametrize("version", [MODERN, HANDSHAKE, OLDER])
def test_ledger_mcp_answers_each_protocol_version(make_key, api_server, offer, version):
    """The same key from two connections (a reconnect) names one receipt in every version:
    the operation is the agent key's, not a session's."""
    offer(version)
    secret = make_key("versions-bot")
    seen: list[dict] = []

    async def main():
        ids = []
        for _ in range(2):
            async with speaking(f"{api_server}/mcp", secret, version, seen) as client:
                tools = {t.name for t in (await client.list_tools()).tools}
                assert "ledger_record_intent" in tools
                recorded = await client.call_tool("ledger_record_intent", {
                    "operation": "mail.send", "target": "smtp://mail.example",
                    "intent": {"to": "ada@example.com"}, "idempotency_key": "v-welcome"})
                assert not recorded.is_error, recorded.content
                ids.append((recorded.structured_content["created"],
                            recorded.structured_content["operation"]["operation_id"]))
                refused = await client.call_tool("ledger_mark_succeeded",
                                                 {"operation_id": ids[-1][1]})
                assert refused.is_error and "IllegalTransition" in refused.content[0].text
        return ids

    (first, op_id), (again, same) = run_coroutine(main())
    assert (first, again) == (True, False) and same == op_id
    assert Operation.objects.get().operation_id == op_id
    # The stateless /mcp hands out no session in any version.
    assert seen and not any("mcp-session-id" in headers for headers in seen)
    if version == MODERN:  # no handshake: every request says its version itself
        assert all(h.get("content-type", "").startswith("application/json") for h in seen)


def test_ledger_mcp_refuses_a_2026_request_without_a_key(api_server):
    import httpx

    answer = httpx.post(f"{api_server}/mcp", headers={"MCP-Protocol-Version": MODERN},
                        json={"jsonrpc": "2.0", "id": 1, "method": "tools/list",
                              "params": {"_meta": {
                                  "io.modelcontextprotocol/protocolVersion": MODERN}}})
    assert answer.status_code == 401
    assert answer.headers["content-type"] == "application/problem+json"
    assert "expected an Authorization: Bearer header" in answer.json()["detail"]


# --- the gateway: its server side ----------------------------------------------------------


def test_the_gateway_serves_2026_and_handshake_clients_with_one_receipt_per_call(
        make_key, tmp_path, offer):
    """One gateway over Streamable HTTP; a 2026-07-28 client (no session) and a 2025-11-25
    client (an Mcp-Session-Id). Each one's consequential call makes one receipt and one
    effect; a reconnect's repeat is answered from the receipt and marked a replay, in the
    same version and in the other one: the default key is the agent key's and the call's,
    not the session's."""
    offer(HANDSHAKE)
    secret = make_key("billing-bot")
    config = write_config(tmp_path, extra="retry_window = 600")

    async def call(url, version, reference, seen):
        async with speaking(url, secret, version, seen) as client:
            return await client.call_tool("create_invoice", invoice(reference))

    with gateway_over_http(config, tmp_path) as url:
        headers = {MODERN: [], HANDSHAKE: []}
        answers = {}
        for version in (MODERN, HANDSHAKE):
            reference = f"g-{version}"
            first = run_coroutine(call(url, version, reference, headers[version]))
            replay = run_coroutine(call(url, version, reference, headers[version]))
            other = MODERN if version == HANDSHAKE else HANDSHAKE
            across = run_coroutine(call(url, other, reference, headers[other]))
            answers[version] = (first, replay, across)

    assert [i["reference"] for i in invoices(tmp_path)] == [f"g-{MODERN}", f"g-{HANDSHAKE}"]
    ops = {op.intent["arguments"]["reference"]: op for op in Operation.objects.all()}
    assert len(ops) == 2
    for version, (first, replay, across) in answers.items():
        op = ops[f"g-{version}"]
        assert op.state == "succeeded" and op.intent["mcp"]["protocol"] == version
        assert op.intent["mcp"]["caller"] == "billing-bot"
        assert not first.is_error and "agent-ledger/replayed" not in (first.meta or {})
        for repeat in (replay, across):
            assert repeat.meta["agent-ledger/replayed"] is True
            assert repeat.meta["agent-ledger/operation-id"] == op.operation_id
            assert repeat.content[0].text.startswith("Not sent again:")
            assert repeat.structured_content == first.structured_content
        # The upstream's own protocol stamp is not relayed as the gateway's.
        for answer in (first, replay, across):
            assert (answer.meta or {}).get("io.modelcontextprotocol/serverInfo", {}).get(
                "name") != "invoices-upstream"
        stored = json.dumps(op.result)
        assert "invoices-upstream" not in stored
    # Only a handshake-era client is given a session; the 2026-07-28 one has none, and its
    # receipt names no connection.
    assert not any("mcp-session-id" in h for h in headers[MODERN])
    assert any("mcp-session-id" in h for h in headers[HANDSHAKE])
    assert ops[f"g-{MODERN}"].intent["mcp"]["connection"] == ""
    assert ops[f"g-{HANDSHAKE}"].intent["mcp"]["connection"].startswith("http-")


@pytest.mark.parametrize("version", [MODERN, HANDSHAKE])
def test_the_gateway_over_stdio_relays_progress_in_each_version(make_key, tmp_path, offer,
                                                                  version):
    offer(version)
    secret = make_key("billing-bot")
    config = write_config(tmp_path)
    progress = []

    async def on_progress(done, total, message):
        progress.append((done, total, message))

    async def main():
        mode = version if version == MODERN else "legacy"
        async with Client(StdioServerParameters(
                command=sys.executable,
                args=["manage.py", "mcp_gateway", "--config", str(config)], cwd=str(ROOT),
                env=gateway_env(secret)), mode=mode, cache=None) as client:
            assert client.protocol_version == version
            done = await client.call_tool("noop", {"n": 3}, progress_callback=on_progress)
            assert not done.is_error and done.content[0].text == "ok"
            first = await client.call_tool("create_invoice", invoice("s-1"))
            again = await client.call_tool("create_invoice", invoice("s-1"))
            return first, again

    first, again = run_coroutine(main())
    assert progress == [(1, 3, "step 1"), (2, 3, "step 2"), (3, 3, "step 3")]
    assert not first.is_error and again.meta["agent-ledger/replayed"] is True
    op = Operation.objects.get()
    assert op.intent["mcp"]["protocol"] == version
    assert op.intent["mcp"]["connection"].startswith("stdio-")
    assert len(invoices(tmp_path)) == 1


# --- the gateway: its client side ----------------------------------------------------------


@pytest.mark.parametrize(("upstream", "setting", "spoken"), [
    ("any", None, MODERN),           # a 2026-07-28 upstream: server/discover, no handshake
    ("legacy", None, HANDSHAKE),     # an older upstream: the probe falls back to initialize
    ("any", "legacy", HANDSHAKE),    # pinned by [upstream] protocol
    ("any", MODERN, MODERN),
])
def test_the_gateway_speaks_to_new_and_older_upstreams(make_key, tmp_path, upstream,
                                                        setting, spoken):
    secret = make_key("billing-bot")
    config = write_config(tmp_path, command=UPSTREAM)
    text = config.read_text().replace(
        'UPSTREAM_BEHAVIOUR = "normal"', f'UPSTREAM_BEHAVIOUR = "normal", '
                                         f'UPSTREAM_PROTOCOL = "{upstream}"')
    if setting is not None:
        text = text.replace("connect_timeout = 30", f'connect_timeout = 30\nprotocol = "{setting}"')
    config.write_text(text)

    async def main():
        async with Client(StdioServerParameters(
                command=sys.executable,
                args=["manage.py", "mcp_gateway", "--config", str(config)], cwd=str(ROOT),
                env=gateway_env(secret)), mode=MODERN, cache=None) as client:
            first = await client.call_tool("create_invoice", invoice("u-1"))
            again = await client.call_tool("create_invoice", invoice("u-1"))
            return first, again

    first, again = run_coroutine(main())
    assert not first.is_error, first.content
    assert again.meta["agent-ledger/replayed"] is True
    state = json.loads((tmp_path / "upstream-state.json").read_text())
    assert state["protocols"] == [spoken]
    assert len(state["invoices"]) == 1 and Operation.objects.get().state == "succeeded"


def test_an_upstream_asking_for_input_is_answered_clearly_and_nothing_is_done(make_key,
                                                                           tmp_path):
    """A 2026-07-28 tool's request for input (elicitation) is not relayed: the gateway does
    not advertise it, and a tool that asks anyway gets a tool error saying so; the receipt
    is rejected (the tool did not complete), the upstream made nothing."""
    secret = make_key("billing-bot")
    config = write_config(tmp_path)

    async def main():
        async with Client(StdioServerParameters(
                command=sys.executable,
                args=["manage.py", "mcp_gateway", "--config", str(config)], cwd=str(ROOT),
                env=gateway_env(secret)), mode=MODERN, cache=None) as client:
            return await client.call_tool("create_invoice", {
                "customer": "ask", "amount": 5, "reference": "ask-1"})

    answer = run_coroutine(main())
    assert answer.is_error
    assert answer.content[0].text.startswith(
        "Needs input: the upstream asked for input before create_invoice could complete")
    op = Operation.objects.get()
    assert (op.state, op.error_code) == ("rejected", "input_required")
    assert invoices(tmp_path) == []


@pytest.mark.parametrize("version", [MODERN, HANDSHAKE])
def test_ledger_mcp_over_stdio_in_each_version(make_key, offer, version):
    from django.db import connection

    offer(version)
    secret = make_key("versions-bot")

    async def main():
        mode = version if version == MODERN else "legacy"
        async with Client(StdioServerParameters(
                command=sys.executable, args=["manage.py", "mcp"], cwd=str(ROOT),
                env={**gateway_env(secret),
                     "LEDGER_DATABASE_NAME": connection.settings_dict["NAME"]}),
                mode=mode, cache=None) as client:
            assert client.protocol_version == version
            recorded = await client.call_tool("ledger_record_intent", {
                "operation": "mail.send", "target": "smtp://mail.example",
                "intent": {"to": "ada@example.com"}, "idempotency_key": "stdio-welcome"})
            assert not recorded.is_error, recorded.content
            return recorded.structured_content["operation"]["operation_id"]

    assert run_coroutine(main()) == Operation.objects.get().operation_id
