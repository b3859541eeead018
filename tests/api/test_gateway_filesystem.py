"""The gateway in front of a real third-party MCP server: the official filesystem server
(`@modelcontextprotocol/server-filesystem`, npm, installed once into .local/npm/gateway),
`write_file` consequential, `read_file` its reconciler, behind the fault proxy. Skipped only
when node is not installed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from mcp.shared.exceptions import MCPError

from ledger.models import Operation
from tests.api.test_gateway import (
    PROXY,
    gateway_env,
    gateway_over_http,
    over_http,
    reconcile_once,
    through_gateway,
)
from tests.support.processes import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

PACKAGE = "@modelcontextprotocol/server-filesystem@2026.8.31"
CACHE = ROOT / ".local" / "npm" / "gateway"
SERVER = CACHE / "node_modules" / "@modelcontextprotocol" / "server-filesystem" / "dist" / \
    "index.js"


@pytest.fixture(scope="module")
def filesystem_server() -> list[str]:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed")
    if not SERVER.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix",
                               str(CACHE), PACKAGE], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
    return [node, str(SERVER)]


def write_config(tmp_path: Path, command: list[str], plan: dict, gateway: str = "") -> Path:
    path = tmp_path / "files.toml"
    path.write_text(f"""
[gateway]
name = "files"
{gateway}

[upstream]
command = {json.dumps([*PROXY, *command])}
env = {{ FAULT_PLAN = {json.dumps(json.dumps(plan))} }}

[tools.write_file]
mode = "consequential"
operation = "files.write"
keep = ["path", "content"]
external_id_template = "{{path}}"
timeout = 5
in_flight = 1

[tools.write_file.reconcile]
tool = "read_file"
arguments = {{ path = "{{path}}" }}
found = {{ path = "content", equals = "{{content}}" }}
absent = {{ is_error = true, text_matches = "ENOENT|no such file" }}
external_id_template = "{{path}}"
""")
    return path


def test_write_file_once_per_call_and_read_file_settles_the_unknown(
        make_key, tmp_path, filesystem_server):
    secret = make_key("files-bot")
    files = (tmp_path / "files").resolve()
    files.mkdir()
    config = write_config(tmp_path, [*filesystem_server, str(files)],
                          {"tool": "write_file", "drop_reply": [2], "drop_request": [3]})
    a, b, c = (str(files / name) for name in ("a.txt", "b.txt", "c.txt"))

    async def session():
        async with through_gateway(config, secret) as client:
            # The filesystem server has no prompts: neither has the gateway in front of it.
            assert client.server_capabilities.prompts is None
            assert client.server_capabilities.tools is not None
            tools = {t.name for t in (await client.list_tools()).tools}
            assert {"write_file", "read_file", "edit_file"} <= tools

            wrote = await client.call_tool("write_file", {"path": a, "content": "hello"})
            assert not wrote.is_error, wrote.content
            Path(a).write_text("changed by someone else")
            again = await client.call_tool("write_file", {"path": a, "content": "hello"})
            assert again.content[0].text.startswith("Not sent again: this repeats call ")
            assert again.content[1].text == wrote.content[0].text
            assert again.meta["agent-ledger/replayed"] is True
            assert Path(a).read_text() == "changed by someone else"  # not written twice

            lost_reply = await client.call_tool("write_file", {"path": b, "content": "two"})
            assert lost_reply.is_error and "not known yet" in lost_reply.content[0].text
            lost_request = await client.call_tool("write_file",
                                                  {"path": c, "content": "three"})
            assert lost_request.is_error and "not known yet" in lost_request.content[0].text
            retried = await client.call_tool("write_file", {"path": c, "content": "three"})
            assert retried.is_error and "Do not retry" in retried.content[0].text

            read = await client.call_tool("read_file", {"path": b})  # passes through
            assert read.structured_content == {"content": "two"}

    anyio.run(session)
    assert Path(b).read_text() == "two" and not Path(c).exists()
    time.sleep(1.2)  # past the in-flight window of the lost request
    out = reconcile_once(config)
    assert "found -> succeeded" in out and "proven_absent -> safe_to_retry" in out, out
    ops = {op.intent["arguments"]["path"]: op for op in Operation.objects.all()}
    assert {Path(p).name: (op.state, op.external_id) for p, op in ops.items()} == {
        "a.txt": ("succeeded", a), "b.txt": ("succeeded", b), "c.txt": ("safe_to_retry", "")}
    assert ops[b].events.get(to_state="succeeded").actor_kind == "reconciler"


def test_a_key_of_another_tenant_can_neither_read_nor_write(make_key, tmp_path,
                                                          filesystem_server):
    """A gateway of tenant acme: a key granted only globex is refused on every request
    kind (tool list, pass-through read_file and edit_file, consequential write_file)
    before anything reaches the upstream; acme's key goes through. (Resources, prompts
    and completions: test_gateway.py, whose upstream has them.)"""
    acme = make_key("acme-files", tenants=["acme"])
    globex = make_key("globex-files", tenants=["globex"])
    files = (tmp_path / "files").resolve()
    files.mkdir()
    secret_file = files / "acme.txt"
    secret_file.write_text("acme's own text")
    config = write_config(tmp_path, [*filesystem_server, str(files)], {},
                          gateway='tenant = "acme"')
    path = str(secret_file)

    async def as_globex(url: str) -> list[str]:
        refusals = []
        async with over_http(url, globex) as client:
            for request in (
                    client.list_tools(),
                    client.call_tool("read_file", {"path": path}),
                    client.call_tool("edit_file", {"path": path, "edits": [
                        {"oldText": "acme's", "newText": "globex's"}]}),
                    client.call_tool("write_file", {"path": path, "content": "globex"})):
                with pytest.raises(MCPError) as refused:
                    await request
                refusals.append(refused.value.error.message)
        return refusals

    async def as_acme(url: str) -> str:
        async with over_http(url, acme) as client:
            assert "write_file" in {t.name for t in (await client.list_tools()).tools}
            read = await client.call_tool("read_file", {"path": path})
            return read.structured_content["content"]

    with gateway_over_http(config, tmp_path) as url:
        refusals = anyio.run(as_globex, url)
        assert anyio.run(as_acme, url) == "acme's own text"
    assert len(refusals) == 4
    for message in refusals:
        assert message == ("Refused by the ledger (PermissionDenied): expected key "
                           "globex-files to be granted tenant 'acme', found it scoped to "
                           "['globex']"), message
    assert secret_file.read_text() == "acme's own text"
    assert not Operation.objects.exists()


def test_write_a_then_b_then_a_sends_three_times(make_key, tmp_path, filesystem_server):
    """The default key takes a same-argument call for a retry only right after the same
    call (no other call of the tool between, within the retry window): write A, B, A is
    three writes and the file ends as A; an immediate repeat of the last is a replay."""
    secret = make_key("files-bot")
    files = (tmp_path / "files").resolve()
    files.mkdir()
    config = write_config(tmp_path, [*filesystem_server, str(files)], {})
    mode = str(files / "mode.txt")

    async def session():
        async with through_gateway(config, secret) as client:
            answers = [await client.call_tool("write_file", {"path": mode, "content": text})
                       for text in ("mode=A", "mode=B", "mode=A")]
            assert Path(mode).read_text() == "mode=A"
            repeat = await client.call_tool("write_file", {"path": mode, "content": "mode=A"})
            return answers, repeat

    answers, repeat = anyio.run(session)
    for answer in answers:
        assert not answer.is_error and "agent-ledger/replayed" not in (answer.meta or {})
    ops = list(Operation.objects.order_by("id"))
    assert [(op.intent["arguments"]["content"], op.state) for op in ops] == [
        ("mode=A", "succeeded"), ("mode=B", "succeeded"), ("mode=A", "succeeded")]
    assert len({op.idempotency_key for op in ops}) == 3
    assert repeat.meta["agent-ledger/replayed"] is True
    assert repeat.meta["agent-ledger/operation-id"] == ops[2].operation_id
    assert repeat.content[0].text.startswith(
        f"Not sent again: this repeats call files.write ({ops[2].operation_id}) sent at ")
    assert Path(mode).read_text() == "mode=A"


def test_annotations_resources_and_repeat_ask_with_the_filesystem_server(
        make_key, tmp_path, filesystem_server):
    """The server's own annotations decide what the configuration leaves open (--check
    prints the table); a call on the same path by another tool comes between two
    same-arguments calls, so the second is a new intent: write_file (idempotentHint true)
    sends it, edit_file (idempotentHint false: repeat = "ask") asks for a key instead."""
    secret = make_key("files-bot")
    files = (tmp_path / "files").resolve()
    files.mkdir()
    config = tmp_path / "files.toml"
    config.write_text(f"""
[gateway]
name = "files"

[upstream]
command = {json.dumps([*filesystem_server, str(files)])}

[tools.write_file]
resource = ["path"]
external_id_template = "{{path}}"

[tools.edit_file]
resource = ["path"]
""")
    done = subprocess.run(
        [sys.executable, "manage.py", "mcp_gateway", "--config", str(config), "--check"],
        cwd=ROOT, env=gateway_env(secret), capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[1:]}
    assert rows["read_file"][1:4] == ["readOnly=yes", "pass-through", "readOnlyHint"]
    assert rows["write_file"][2:5] == ["receipted", "settings", "files.write_file"]
    assert rows["write_file"][-1] == "send"
    assert rows["edit_file"][2:5] == ["receipted", "settings", "files.edit_file"]
    assert rows["edit_file"][-1] == "ask"
    assert rows["move_file"][2:5] == ["receipted", "destructiveHint", "files.move_file"]
    assert rows["create_directory"][2:4] == ["receipted", "readOnlyHint=false"]
    assert len(rows) >= 12  # every upstream tool has its line
    assert "[tools.edit_file] is consequential (settings) without a key rule" in done.stderr

    path = str(files / "mode.txt")
    edit = {"path": path, "edits": [{"oldText": "x=1", "newText": "x=2"}]}

    async def session():
        async with through_gateway(config, secret) as client:
            answers = [
                await client.call_tool("write_file", {"path": path, "content": "x=1"}),
                await client.call_tool("edit_file", edit),
                # write_file again: edit_file on the same path came between: sent.
                await client.call_tool("write_file", {"path": path, "content": "x=1"}),
            ]
            assert Path(path).read_text() == "x=1"
            # edit_file again: write_file on its path came between; repeat = "ask".
            answers.append(await client.call_tool("edit_file", edit))
            assert Path(path).read_text() == "x=1"
            answers.append(await client.call_tool(
                "edit_file", edit, meta={"agent-ledger/idempotency-key": "edit-again"}))
            return answers

    answers = anyio.run(session)
    assert [a.is_error for a in answers] == [False, False, False, True, False], answers
    assert answers[3].content[0].text.startswith("Needs a key: this call has the same "
                                                 "arguments as call files.edit_file (")
    assert "call files.write_file (" in answers[3].content[0].text
    assert Path(path).read_text() == "x=2"
    ops = list(Operation.objects.order_by("id"))
    assert [op.operation for op in ops] == ["files.write_file", "files.edit_file",
                                            "files.write_file", "files.edit_file"]
    assert all(op.state == "succeeded" for op in ops)
