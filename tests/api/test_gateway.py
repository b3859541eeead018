"""The MCP gateway with real processes and real transports: an MCP client of the official
SDK -> `manage.py mcp_gateway` (stdio, or Streamable HTTP under uvicorn) -> a fault proxy
-> the upstream MCP server of tests/api/gateway_upstream.py, which counts its own effects.
`manage.py reconcile` settles the unknown ones through the upstream's read tool."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import anyio
import mcp_types as types
import pytest
from django.db import connection
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

from ledger import approvals, reconcile
from ledger.models import Operation
from tests.factories import UserFactory
from tests.support.processes import ROOT
from tests.support.servers import free_port

pytestmark = pytest.mark.django_db(transaction=True)

HERE = Path(__file__).resolve().parent
UPSTREAM = [sys.executable, str(HERE / "gateway_upstream.py")]
PROXY = [sys.executable, str(HERE / "gateway_fault_proxy.py"), "--"]


def toml_value(value) -> str:
    return json.dumps(value)  # JSON strings, numbers and lists are TOML too


def write_config(tmp_path: Path, *, behaviour="normal", plan=None, extra="",
                 timeout=3, name="gateway.toml", command=None) -> Path:
    state = tmp_path / "upstream-state.json"
    env = {"UPSTREAM_STATE": str(state), "UPSTREAM_BEHAVIOUR": behaviour,
           "FAULT_PLAN": json.dumps(plan or {})}
    command = command or [*PROXY, *UPSTREAM]
    path = tmp_path / name
    path.write_text(f"""
[gateway]
name = "billing"

[upstream]
command = {toml_value(command)}
env = {{ {", ".join(f"{k} = {toml_value(v)}" for k, v in env.items())} }}
connect_timeout = 30

[tools.create_invoice]
mode = "consequential"
operation = "invoices.create"
target = "mcp://billing/create_invoice"
keep = ["customer", "amount", "reference"]
external_id = "id"
timeout = {timeout}
in_flight = 1
{extra}

[tools.create_invoice.reconcile]
tool = "find_invoice"
arguments = {{ reference = "{{reference}}" }}
found = {{ path = "status", equals = "found" }}
absent = {{ path = "status", equals = "absent" }}
external_id = "invoice.id"

[tools.find_invoice]
mode = "pass-through"
""")
    return path


def invoices(tmp_path: Path) -> list[dict]:
    state = tmp_path / "upstream-state.json"
    return json.loads(state.read_text())["invoices"] if state.exists() else []


def gateway_env(secret: str, **extra) -> dict[str, str]:
    return {**os.environ, "LEDGER_AGENT_KEY": secret,
            "LEDGER_DATABASE_NAME": connection.settings_dict["NAME"], **extra}


def through_gateway(config: Path, secret: str) -> Client:
    return Client(StdioServerParameters(
        command=sys.executable, args=["manage.py", "mcp_gateway", "--config", str(config)],
        cwd=str(ROOT), env=gateway_env(secret)), cache=None)


def reconcile_once(*configs: Path) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", "reconcile", "--once", "--no-seal"], cwd=ROOT,
        env=gateway_env("", LEDGER_GATEWAY_CONFIGS=",".join(map(str, configs))),
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def invoice(reference: str, amount: int = 100) -> dict:
    return {"customer": "ada", "amount": amount, "reference": reference}


def test_one_effect_per_key_through_dropped_replies_and_requests(make_key, tmp_path):
    """Call 2's reply and call 3's request are lost; the model retries each: the upstream
    counts one invoice per reference, the unknown ones settle by reading, nothing is lost."""
    secret = make_key("billing-bot")
    config = write_config(tmp_path, plan={"tool": "create_invoice", "drop_reply": [2],
                                          "drop_request": [3]},
                          extra="retry_window = 600")  # the reconcile pass takes a while

    async def session():
        async with through_gateway(config, secret) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert set(tools) == {"create_invoice", "find_invoice", "noop"}
            assert tools["create_invoice"].description == "Create an invoice (one per call)."
            assert tools["create_invoice"].output_schema["required"][0] == "id"

            done = await client.call_tool("create_invoice", invoice("r-1"))
            assert not done.is_error and done.structured_content["id"] == "inv-1"
            assert "agent-ledger/replayed" not in (done.meta or {})
            again = await client.call_tool("create_invoice", invoice("r-1"))
            assert again.structured_content == done.structured_content
            replays["r-1"] = (done, again)

            lost_reply = await client.call_tool("create_invoice", invoice("r-2"))
            assert lost_reply.is_error
            text = lost_reply.content[0].text
            assert "The outcome is not known yet" in text and "Do not retry" in text
            assert "invoices.create" in text
            retried = await client.call_tool("create_invoice", invoice("r-2"))
            assert retried.is_error and "being reconciled" in retried.content[0].text

            lost_request = await client.call_tool("create_invoice", invoice("r-3"))
            assert lost_request.is_error and "not known yet" in lost_request.content[0].text
            retried = await client.call_tool("create_invoice", invoice("r-3"))
            assert retried.is_error

            # Reads pass through and are never recorded.
            read = await client.call_tool("find_invoice", {"reference": "r-1"})
            assert read.structured_content["status"] == "found"
            count = await client.read_resource("invoices://count")
            assert count.contents[0].text == "2"
            prompts = await client.list_prompts()
            assert [p.name for p in prompts.prompts] == ["summary"]

            # The reconcile process reads the upstream while this session goes on.
            await anyio.sleep(1.2)  # past the in-flight window (1 s) of the lost request
            out = await anyio.to_thread.run_sync(reconcile_once, config)
            assert "found -> succeeded" in out and "proven_absent -> safe_to_retry" in out

            # The model calls again: r-3 was proven absent, so it is sent (attempt 2).
            # (r-2 again now would be a new intent: other calls of the tool came between;
            # the retry window and that rule are test_gateway_filesystem's A/B/A.)
            retried = await client.call_tool("create_invoice", invoice("r-3"))
            assert not retried.is_error, retried.content
            assert retried.structured_content["reference"] == "r-3"

    replays = {}
    anyio.run(session)
    assert [i["reference"] for i in invoices(tmp_path)] == ["r-1", "r-2", "r-3"]
    ops = {op.intent["arguments"]["reference"]: op for op in Operation.objects.all()}
    # A replay says it is one: in _meta, and in its first sentence.
    done, again = replays["r-1"]
    sent_at = ops["r-1"].submitted_at.isoformat()
    assert {k: v for k, v in again.meta.items() if k.startswith("agent-ledger/")} == {
        "agent-ledger/replayed": True, "agent-ledger/operation-id": ops["r-1"].operation_id,
        "agent-ledger/sent-at": sent_at}
    assert again.content[0].text == (
        f"Not sent again: this repeats call invoices.create ({ops['r-1'].operation_id}) "
        f"sent at {sent_at}; its recorded result follows.")
    assert [c.text for c in again.content[1:]] == [c.text for c in done.content]
    assert {ref: op.state for ref, op in ops.items()} == {
        "r-1": "succeeded", "r-2": "succeeded", "r-3": "succeeded"}
    assert [ops[r].external_id for r in ("r-1", "r-2", "r-3")] == ["inv-1", "inv-2", "inv-3"]
    assert ops["r-1"].result["structuredContent"]["id"] == "inv-1"
    assert ops["r-3"].attempt == 2
    assert ops["r-1"].intent["tool"] == "create_invoice"
    assert ops["r-1"].intent["mcp"]["connection"].startswith("stdio-")
    timeline = [(e.to_state, e.actor_kind) for e in ops["r-2"].events.order_by("version")]
    assert timeline[:3] == [("planned", "agent"), ("submitted", "agent"),
                            ("outcome_unknown", "agent")]
    assert timeline[-1][0] == "succeeded"
    assert {e.actor_id for e in ops["r-1"].events.all()} == {"billing-bot"}
    assert "timed out" in ops["r-2"].events.get(to_state="outcome_unknown").reason


def test_the_receipt_names_the_provider_account_the_configuration_gives(make_key, tmp_path):
    """`account` in the TOML (the tool's, else [gateway]'s) is on every receipt, for the
    reconciler to read as; it is part of the key's identity, not of the intent."""
    secret = make_key("billing-bot")
    config = write_config(tmp_path, extra='account = "acct_billing_eu"')

    async def main():
        async with through_gateway(config, secret) as client:
            done = await client.call_tool("create_invoice", invoice("r-acct"))
            assert not done.is_error, done.content

    anyio.run(main)
    op = Operation.objects.get()
    assert (op.account, op.state) == ("acct_billing_eu", "succeeded")
    assert "acct_billing_eu" not in json.dumps(op.intent)


def test_a_refusal_is_rejected_and_not_sent_again(make_key, tmp_path):
    """A tool error is rejected by default; one the configuration's unknown_when matches
    (a transient 503) is outcome_unknown, for the reconciler to prove absent."""
    secret = make_key("billing-bot")
    config = write_config(tmp_path, extra='unknown_when = ["^503 "]')

    async def main():
        async with through_gateway(config, secret) as client:
            refused = await client.call_tool("create_invoice", invoice("r-9", amount=0))
            assert refused.is_error and "amount must be a positive" in refused.content[0].text
            again = await client.call_tool("create_invoice", invoice("r-9", amount=0))
            assert again.is_error and "Rejected earlier" in again.content[0].text
            assert again.meta["agent-ledger/replayed"] is True
            busy = await client.call_tool("create_invoice", {**invoice("r-10"),
                                                             "customer": "busy"})
            assert busy.is_error and "The outcome is not known yet (tool_error: 503 " \
                in busy.content[0].text

    anyio.run(main)
    ops = {op.intent["arguments"]["reference"]: op for op in Operation.objects.all()}
    assert ops["r-9"].state == "rejected"
    assert "amount must be a positive" in ops["r-9"].error_detail
    assert (ops["r-10"].state, ops["r-10"].error_code) == ("outcome_unknown", "tool_error")
    assert invoices(tmp_path) == []


def test_a_call_whose_key_is_being_sent_is_in_flight_then_a_replay(make_key, tmp_path):
    """The model sends the same call twice at once: one is sent; the other is told it is
    in flight (never "outcome unknown"); asked again after, it gets the replay."""
    secret = make_key("billing-bot")
    config = write_config(tmp_path, behaviour="slow", timeout=60)

    async def main():
        async with through_gateway(config, secret) as client:
            answers = []

            async def call():
                answers.append(await client.call_tool("create_invoice", invoice("f-1")))

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await anyio.sleep(2)  # the first is being sent (the upstream takes 5 s)
                tg.start_soon(call)
            return answers, await client.call_tool("create_invoice", invoice("f-1"))

    (in_flight, sent), replay = anyio.run(main)
    op = Operation.objects.get()
    assert op.state == "succeeded" and len(invoices(tmp_path)) == 1
    assert not sent.is_error and sent.structured_content["reference"] == "f-1"
    assert in_flight.is_error
    assert in_flight.content[0].text.startswith(
        f"In flight: operation invoices.create ({op.operation_id}) is being sent right now "
        "by another call with the same key; this call sent nothing."), in_flight.content
    assert in_flight.meta["agent-ledger/in-flight"] is True
    assert in_flight.meta["agent-ledger/retry-after"] == 1
    assert replay.meta["agent-ledger/replayed"] is True
    assert replay.structured_content == sent.structured_content


def test_a_reply_after_the_call_was_settled_answers_from_the_record(make_key, tmp_path):
    """The sweep moves the call on while the upstream still works (a tool timeout above
    LEDGER_STALE_SUBMISSION_SECONDS): its late reply reaches the model as a tool error
    naming the operation, never as a protocol error."""
    secret = make_key("billing-bot")
    config = write_config(tmp_path, behaviour="slow", timeout=60)

    def sweep_once_submitted():
        from django.db import connection as thread_connection
        try:
            deadline = time.monotonic() + 60
            while not Operation.objects.filter(state="submitted").exists():
                assert time.monotonic() < deadline, "expected the call to be submitted"
                time.sleep(0.1)
            assert reconcile.sweep_stale_submissions(older_than=timedelta(0)) == 1
        finally:
            thread_connection.close()

    async def main():
        async with through_gateway(config, secret) as client:
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, sweep_once_submitted)
                return await client.call_tool("create_invoice", invoice("s-1"))

    late = anyio.run(main)
    op = Operation.objects.get()
    assert op.state == "outcome_unknown" and len(invoices(tmp_path)) == 1
    assert late.is_error
    assert late.content[0].text.startswith(
        f"Late reply: operation invoices.create ({op.operation_id}) moved on to "
        "outcome_unknown before the upstream's reply arrived."), late.content[0].text
    assert {k: v for k, v in late.meta.items() if k.startswith("agent-ledger/")} == {
        "agent-ledger/late-reply": True, "agent-ledger/operation-id": op.operation_id,
        "agent-ledger/state": "outcome_unknown"}


def test_named_arguments_make_the_key_across_sessions(make_key, tmp_path):
    """key.from = 'arguments': the same reference is the same effect in any session, even
    with other amounts (IdempotencyKeyReused, not a second invoice)."""
    secret = make_key("billing-bot")
    config = write_config(tmp_path, extra='key = { from = "arguments", names = ["reference"] }')

    async def session(amount):
        async with through_gateway(config, secret) as client:
            return await client.call_tool("create_invoice", invoice("r-5", amount=amount))

    first = anyio.run(session, 100)
    second = anyio.run(session, 100)
    assert first.structured_content == second.structured_content
    other = anyio.run(session, 200)
    assert other.is_error and "IdempotencyKeyReused" in other.content[0].text
    assert len(invoices(tmp_path)) == 1


@pytest.mark.parametrize(("behaviour", "code", "detail"), [
    ("lie", "RuntimeError", "Invalid structured content"),
    ("no_id", "external_id_missing", "expected the external id at 'id'"),
])
def test_a_result_without_evidence_is_unknown_never_succeeded(make_key, tmp_path, behaviour,
                                                              code, detail):
    secret = make_key("billing-bot")
    config = write_config(tmp_path, behaviour=behaviour)

    async def main():
        async with through_gateway(config, secret) as client:
            answer = await client.call_tool("create_invoice", invoice("r-7"))
            assert answer.is_error and "not known yet" in answer.content[0].text
            assert detail in answer.content[0].text

    anyio.run(main)
    op = Operation.objects.get()
    assert op.state == "outcome_unknown" and op.error_code == code
    assert detail in op.error_detail
    assert len(invoices(tmp_path)) == 1  # the effect happened: the reconciler will find it
    reconcile_once(config)
    op.refresh_from_db()
    assert op.state == "succeeded" and op.external_id == "inv-1"


def test_a_huge_result_succeeds_on_its_id_without_being_stored(make_key, tmp_path):
    secret = make_key("billing-bot")
    config = write_config(tmp_path, behaviour="huge", timeout=60)

    async def main():
        async with through_gateway(config, secret) as client:
            answer = await client.call_tool("create_invoice", invoice("r-8"))
            assert not answer.is_error, answer.content[0].text
            assert len(answer.structured_content["pdf"]) == 2_000_000
            again = await client.call_tool("create_invoice", invoice("r-8"))
            assert again.is_error
            assert "its result was not stored" in again.content[0].text
            assert "bytes" in again.content[0].text

    anyio.run(main)
    op = Operation.objects.get()
    assert op.state == "succeeded" and op.external_id == "inv-1" and op.result is None
    assert "above the" in op.result_unstorable
    assert len(invoices(tmp_path)) == 1


def test_an_approval_policy_holds_the_call_until_a_person_approves(make_key, tmp_path):
    secret = make_key("billing-bot")
    reviewer = UserFactory(username="rita", role="reviewer", tenants=["default"])
    admin = UserFactory(username="adam", role="admin", tenants=["default"])
    approvals.set_policy("invoices.*", user=admin)
    config = write_config(tmp_path)

    # Across sessions, the client names its own key (default keys are per session).
    meta = {"agent-ledger/idempotency-key": "invoice-r-6"}

    async def ask():
        async with through_gateway(config, secret) as client:
            return await client.call_tool("create_invoice", invoice("r-6"), meta=meta)

    held = anyio.run(ask)
    assert held.is_error and "Awaiting approval" in held.content[0].text
    assert "invoices.create" in held.content[0].text
    assert invoices(tmp_path) == []
    op = Operation.objects.get()
    assert op.state == "planned"
    approvals.approve(op, user=reviewer, reason="known customer")
    done = anyio.run(ask)
    assert not done.is_error, done.content
    op.refresh_from_db()
    assert op.state == "succeeded" and len(invoices(tmp_path)) == 1


def test_with_approval_wait_the_gateway_waits_for_the_decision(make_key, tmp_path):
    secret = make_key("billing-bot")
    reviewer = UserFactory(username="rita", role="reviewer", tenants=["default"])
    admin = UserFactory(username="adam", role="admin", tenants=["default"])
    approvals.set_policy("invoices.*", user=admin)
    config = write_config(tmp_path, extra="approval_wait = 120")

    def approve_when_asked():
        from django.db import connection as thread_connection

        from ledger.models import ApprovalRequest
        try:
            deadline = time.monotonic() + 90
            while not ApprovalRequest.objects.exists():
                assert time.monotonic() < deadline, "expected the gateway to ask approval"
                time.sleep(0.2)
            approvals.approve(Operation.objects.get(), user=reviewer, reason="fine")
        finally:
            thread_connection.close()

    async def main():
        async with through_gateway(config, secret) as client:
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, approve_when_asked)
                done = await client.call_tool("create_invoice", invoice("w-1"))
            assert not done.is_error, done.content
            assert done.structured_content["reference"] == "w-1"

    anyio.run(main)
    assert Operation.objects.get().state == "succeeded"
    assert [i["reference"] for i in invoices(tmp_path)] == ["w-1"]



def test_streamable_http_keeps_default_keys_across_mcp_sessions(make_key, tmp_path):
    secret = make_key("http-billing-bot")
    other_tenant = make_key("globex-bot", tenants=["globex"])
    config = write_config(tmp_path)
    config.write_text(config.read_text().replace('name = "billing"',
                                                 'name = "billing"\ntenant = "default"'))
    port = free_port()
    log = open(tmp_path / "gateway.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "mcp_gateway", "--config", str(config), "--http",
         f"127.0.0.1:{port}"], cwd=ROOT, env=gateway_env(""), stdout=log,
        stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise AssertionError(f"gateway did not start:\n{log.read()}") from None
                time.sleep(0.2)

        async def session():
            http = create_mcp_http_client(headers={"Authorization": f"Bearer {secret}"})
            async with http, Client(streamable_http_client(url, http_client=http),
                                    mode="legacy", cache=None) as client:
                completed = await client.complete(
                    types.PromptReference(type="ref/prompt", name="summary"),
                    {"name": "customer", "value": "a"})
                assert completed.completion.values == ["acme", "ada"]
                first = await client.call_tool("create_invoice", invoice("h-1"))
                again = await client.call_tool("create_invoice", invoice("h-1"))
                assert first.structured_content == again.structured_content
                return first

        async def refused():
            """Another tenant's key: every request kind is refused before the upstream."""
            messages = []
            async with over_http(url, other_tenant) as client:
                for request in (
                        client.list_tools(), client.list_resources(),
                        client.list_resource_templates(),
                        client.read_resource("invoices://count"), client.list_prompts(),
                        client.get_prompt("summary", {}),
                        client.complete(types.PromptReference(type="ref/prompt",
                                                              name="summary"),
                                        {"name": "x", "value": "y"}),
                        client.call_tool("find_invoice", {"reference": "h-1"}),
                        client.call_tool("create_invoice", invoice("h-9"))):
                    with pytest.raises(MCPError) as caught:
                        await request
                    messages.append(caught.value.error.message)
            return messages

        for message in anyio.run(refused):
            assert message == ("Refused by the ledger (PermissionDenied): expected key "
                               "globex-bot to be granted tenant 'default', found it scoped "
                               "to ['globex']"), message
        first = anyio.run(session)
        # A new MCP session (a client that reconnected) within the retry window: the same
        # call is the first one's retry, answered from its receipt and marked so.
        second = anyio.run(session)
        assert first.structured_content["id"] == "inv-1"
        assert second.structured_content == first.structured_content
        assert second.meta["agent-ledger/replayed"] is True
        assert len(invoices(tmp_path)) == 1
        op = Operation.objects.get()
        assert op.intent["mcp"]["connection"].startswith("http-")
        assert op.intent["mcp"]["caller"] == "http-billing-bot"
        assert {e.actor_id for op in Operation.objects.all() for e in op.events.all()} == {
            "http-billing-bot"}

        async def unauthenticated():
            async with Client(url, cache=None) as client:
                await client.list_tools()

        with pytest.raises(BaseException):  # noqa: B017,PT011 - a 401 ends the client
            anyio.run(unauthenticated)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


@contextmanager
def gateway_over_http(config: Path, tmp_path: Path):
    """`manage.py mcp_gateway --http` on a free port; yields its /mcp URL."""
    port = free_port()
    log = open(tmp_path / f"gateway-{port}.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "mcp_gateway", "--config", str(config), "--http",
         f"127.0.0.1:{port}"], cwd=ROOT, env=gateway_env(""), stdout=log,
        stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, proc, log)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def over_http(url: str, secret: str) -> Client:
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {secret}"})
    return Client(streamable_http_client(url, http_client=http), mode="legacy", cache=None)


def wait_for_port(port: int, proc: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise AssertionError(f"expected a server on {port}, found none:\n"
                                     f"{log.read()}") from None
            time.sleep(0.2)


def test_an_upstream_over_streamable_http(make_key, tmp_path):
    secret = make_key("billing-bot")
    port = free_port()
    log = open(tmp_path / "upstream.log", "w+")  # noqa: SIM115
    upstream = subprocess.Popen(
        [*UPSTREAM, "--http", str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "UPSTREAM_STATE": str(tmp_path / "upstream-state.json")})
    try:
        wait_for_port(port, upstream, log)
        config = write_config(tmp_path)
        config.write_text(config.read_text().replace(
            "command = ", f'url = "http://127.0.0.1:{port}/mcp"\n# command = ').replace(
            "env = ", "# env = "))

        async def main():
            async with through_gateway(config, secret) as client:
                done = await client.call_tool("create_invoice", invoice("u-1"))
                assert not done.is_error, done.content
                again = await client.call_tool("create_invoice", invoice("u-1"))
                assert again.structured_content == done.structured_content

        anyio.run(main)
    finally:
        upstream.terminate()
        upstream.wait(timeout=20)
        log.close()
    assert [i["reference"] for i in invoices(tmp_path)] == ["u-1"]
    assert Operation.objects.get().state == "succeeded"


# --- refusals at start -------------------------------------------------------------------


def run_gateway(config: Path, secret: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", "mcp_gateway", "--config",
                           str(config), *extra], cwd=ROOT, env=gateway_env(secret),
                          capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)


def test_an_unreachable_upstream_stops_the_gateway_with_a_clear_error(make_key, tmp_path):
    secret = make_key("billing-bot")
    dead = write_config(tmp_path, command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    done = run_gateway(dead, secret, "--check")
    assert done.returncode != 0
    assert "expected the upstream MCP server (command" in done.stderr
    nobody = tmp_path / "url.toml"
    nobody.write_text('[upstream]\nurl = "http://127.0.0.1:9/mcp"\nconnect_timeout = 10\n')
    done = run_gateway(nobody, secret, "--check")
    assert done.returncode != 0
    assert "expected the upstream MCP server (url 'http://127.0.0.1:9/mcp')" in done.stderr


def test_a_configuration_that_does_not_fit_the_upstream_is_refused(make_key, tmp_path):
    secret = make_key("billing-bot")
    wrong_tool = write_config(tmp_path, extra="", name="a.toml")
    wrong_tool.write_text(wrong_tool.read_text().replace("tool = \"find_invoice\"",
                                                         "tool = \"find_invoices\""))
    done = run_gateway(wrong_tool, secret, "--check")
    assert done.returncode != 0
    assert "[tools.create_invoice.reconcile] tool: expected 'find_invoices' among the " \
           "upstream's tools" in done.stderr
    wrong_arg = write_config(tmp_path, name="b.toml",
                             extra='key = { from = "arguments", names = ["invoice_ref"] }')
    done = run_gateway(wrong_arg, secret, "--check")
    assert done.returncode != 0
    assert "[tools.create_invoice] key.names: expected argument 'invoice_ref' in the input " \
           "schema" in done.stderr
    fine = write_config(tmp_path, name="c.toml")
    done = run_gateway(fine, secret, "--check")
    assert done.returncode == 0, done.stderr
    # The table of every upstream tool, and a warning for the tool without a key rule.
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[1:]}
    assert rows["create_invoice"] == ["create_invoice", "-", "receipted", "config",
                                      "invoices.create", "default", "(30", "s)", "send"]
    assert rows["find_invoice"][1:4] == ["-", "pass-through", "config"]
    assert rows["noop"][1:] == ["-", "pass-through", "not", "listed,", "no", "hints", "-",
                                "-", "-"]
    assert "warning: " in done.stderr and "[tools.create_invoice] is consequential " \
        "(config) without a key rule: the default key takes a call with the same " \
        "arguments for a retry only within retry_window = 30 s" in done.stderr
    strict = write_config(tmp_path, name="e.toml")
    strict.write_text(strict.read_text().replace('name = "billing"',
                                                 'name = "billing"\nrequire_key_rule = true'))
    done = run_gateway(strict, secret, "--check")
    assert done.returncode != 0
    assert "[gateway] require_key_rule: expected a key rule" in done.stderr
    assert "found none for ['create_invoice']" in done.stderr
    keyed = write_config(tmp_path, name="d.toml",
                         extra='key = { from = "arguments", names = ["reference"] }')
    keyed.write_text(keyed.read_text().replace('name = "billing"',
                                               'name = "billing"\nrequire_key_rule = true'))
    done = run_gateway(keyed, secret, "--check")
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr


def test_a_gateway_without_a_live_key_does_not_start(make_key, tmp_path):
    config = write_config(tmp_path)
    done = run_gateway(config, "")
    assert done.returncode != 0 and "expected an agent key in $LEDGER_AGENT_KEY" in done.stderr
    done = run_gateway(config, "alk_" + "x" * 43)
    assert done.returncode != 0 and "expected a live agent key" in done.stderr
    config.write_text(config.read_text().replace('name = "billing"',
                                                 'name = "billing"\ntenant = "acme"'))
    done = run_gateway(config, make_key("default-bot"))
    assert done.returncode != 0
    assert ("expected key default-bot to be granted tenant 'acme', found it scoped to "
            "['default']") in done.stderr


# --- the default key across restarts; limits; what --check says --------------------------


def test_a_restarted_gateway_does_not_send_the_same_call_again(make_key, tmp_path):
    """The default key lives in the ledger, not in the gateway process: a call whose reply
    was lost, retried after a restart of the gateway, is not sent again (unknown, with its
    policy in `_meta`); a call that succeeded, repeated after a restart within the retry
    window, is a replay. One effect each."""
    secret = make_key("billing-bot")
    lossy = write_config(tmp_path, plan={"tool": "create_invoice", "drop_reply": [1]},
                         extra="retry_window = 600", name="lossy.toml")
    config = write_config(tmp_path, extra="retry_window = 600")  # the same upstream

    async def one_call(reference: str, path: Path = config):
        async with through_gateway(path, secret) as client:  # a new gateway process
            return await client.call_tool("create_invoice", invoice(reference))

    lost = anyio.run(one_call, "x-1", lossy)
    op = Operation.objects.get()
    assert lost.is_error and "not known yet" in lost.content[0].text
    assert lost.meta["agent-ledger/outcome"] == "unknown"
    assert lost.meta["agent-ledger/error-policy"] == {
        "retryable": False, "effect": "unsafe_to_replay", "outcome": "unknown",
        "state": "outcome_unknown", "settled_by": "reconciliation",
        "operation_id": op.operation_id, "operation": "invoices.create",
        "desk_url": f"http://127.0.0.1:8000/operations/{op.operation_id}/",
        "retry": "call again later with the same arguments to get the settled result"}
    again = anyio.run(one_call, "x-1")
    assert again.is_error and "Do not retry" in again.content[0].text
    assert again.meta["agent-ledger/operation-id"] == op.operation_id
    assert [i["reference"] for i in invoices(tmp_path)] == ["x-1"]

    done = anyio.run(one_call, "x-2")
    assert not done.is_error, done.content
    replay = anyio.run(one_call, "x-2")
    assert replay.meta["agent-ledger/replayed"] is True
    assert replay.structured_content == done.structured_content
    assert [i["reference"] for i in invoices(tmp_path)] == ["x-1", "x-2"]
    assert Operation.objects.count() == 2
    connections = {o.intent["mcp"]["connection"] for o in Operation.objects.all()}
    assert len(connections) == 2  # recorded by two of the four gateway processes
    for recorded in Operation.objects.all():  # the keyed digest is stored as made
        assert recorded.intent["mcp"]["caller"] == "billing-bot"
        assert len(recorded.intent["mcp"]["call"]) == 40
        assert set(recorded.intent["mcp"]["call"]) <= set("0123456789abcdef")


def test_outside_the_retry_window_a_repeat_is_sent_or_asks_for_a_key(make_key, tmp_path):
    """retry_window = 1: the same call 1.5 s after the first settled is a new intent;
    with repeat = "ask" it is refused (nothing sent) until the client sends its own key."""
    secret = make_key("billing-bot")
    config = write_config(tmp_path, extra="retry_window = 1")
    asking = write_config(tmp_path, name="ask.toml",
                          extra='retry_window = 1\nrepeat = "ask"')

    async def calls(path: Path, reference: str):
        async with through_gateway(path, secret) as client:
            first = await client.call_tool("create_invoice", invoice(reference))
            await anyio.sleep(1.5)
            second = await client.call_tool("create_invoice", invoice(reference))
            if not second.is_error:
                return first, second, None
            meta = {"agent-ledger/idempotency-key": f"{reference}-on-purpose"}
            return first, second, await client.call_tool("create_invoice",
                                                         invoice(reference), meta=meta)

    first, second, _ = anyio.run(calls, config, "w-1")
    assert not first.is_error and not second.is_error
    assert "agent-ledger/replayed" not in (second.meta or {})
    assert [i["reference"] for i in invoices(tmp_path)] == ["w-1", "w-1"]

    first, refused, on_purpose = anyio.run(calls, asking, "w-2")
    ops = list(Operation.objects.filter(intent__arguments__reference="w-2").order_by("id"))
    assert refused.is_error and refused.content[0].text.startswith(
        f"Needs a key: this call has the same arguments as call invoices.create "
        f"({ops[0].operation_id}, succeeded), but it settled "), refused.content[0].text
    assert "past the retry window of 1 s" in refused.content[0].text
    assert refused.meta["agent-ledger/needs-key"] is True
    assert not on_purpose.is_error, on_purpose.content
    assert [i["reference"] for i in invoices(tmp_path)] == ["w-1", "w-1", "w-2", "w-2"]
    assert [op.idempotency_key for op in ops][1] == "w-2-on-purpose"


def test_a_result_above_the_forwarding_limit_is_refused_not_forwarded(make_key, tmp_path):
    secret = make_key("billing-bot")
    config = write_config(tmp_path, behaviour="huge", timeout=60)
    config.write_text(config.read_text().replace(
        'name = "billing"', 'name = "billing"\nmax_forward_bytes = 1000000'))

    async def main():
        async with through_gateway(config, secret) as client:
            return (await client.call_tool("create_invoice", invoice("big-1")),
                    await client.call_tool("create_invoice", invoice("big-1")))

    refused, again = anyio.run(main)
    op = Operation.objects.get()
    assert op.state == "succeeded" and op.external_id == "inv-1"
    assert refused.is_error
    text = refused.content[0].text
    assert text.startswith("Result too large: the upstream's result of create_invoice is "
                           "4,000,") and "above the 1,000,000 bytes this gateway forwards " \
        "([gateway] max_forward_bytes); it is not forwarded. The call itself was recorded: " \
        f"operation invoices.create ({op.operation_id}) succeeded, external id inv-1" in text
    assert refused.meta["agent-ledger/result-too-large"] > 1_000_000
    assert again.is_error and "its result was not stored" in again.content[0].text
    assert len(invoices(tmp_path)) == 1


def test_the_same_call_through_two_gateway_processes_at_once_is_sent_once(make_key,
                                                                         tmp_path):
    """Two gateway processes of one key (two MCP clients of one agent) make the same call
    at once under the default key: the ledger holds one intent; one call sends it, the
    other is told it is in flight; each, asked again after, gets the replay."""
    secret = make_key("billing-bot")
    config = write_config(tmp_path, behaviour="slow", timeout=60)

    async def main():
        answers = []

        async def one(client):
            answers.append(await client.call_tool("create_invoice", invoice("c-1")))

        async with through_gateway(config, secret) as a, through_gateway(config,
                                                                         secret) as b:
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, a)
                tg.start_soon(one, b)
            again = [await a.call_tool("create_invoice", invoice("c-1")),
                     await b.call_tool("create_invoice", invoice("c-1"))]
        return answers, again

    answers, again = anyio.run(main)
    op = Operation.objects.get()
    assert op.state == "succeeded" and len(invoices(tmp_path)) == 1
    sent = [a for a in answers if not a.is_error]
    in_flight = [a for a in answers if a.is_error]
    assert len(sent) == 1 and len(in_flight) == 1, answers
    assert in_flight[0].meta["agent-ledger/in-flight"] is True
    assert in_flight[0].meta["agent-ledger/operation-id"] == op.operation_id
    for replay in again:
        assert replay.meta["agent-ledger/replayed"] is True
        assert replay.structured_content == sent[0].structured_content
