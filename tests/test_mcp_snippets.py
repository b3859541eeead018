"""The MCP page's snippets run as written (docs/agents/mcp.md): the MCP client
configuration and the Python SDK agent start `manage.py mcp` from a folder of the client's
own choosing, with no more environment than they name, against the test database; the
HTTP example serves `/mcp` on a port `make demo` does not hold."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from django.db import connection

from ledger import agent_keys
from tests.factories import UserFactory
from tests.support.loops import run_coroutine
from tests.support.processes import ROOT
from tests.support.servers import free_port

PAGE = Path(ROOT) / "docs" / "agents" / "mcp.md"
CHECKOUT = "/srv/agent-ledger"
DOCUMENTED_URL = "postgres://ledger@db/ledger"


def blocks(kind: str) -> list[str]:
    return re.findall(rf"^```{kind}\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def database_url_of_tests() -> str:
    """The test database as a URL; the embedded server's socket folder percent-encoded in
    the host (as dj-database-url and libpq read it)."""
    s = connection.settings_dict
    host = s["HOST"] or "127.0.0.1"
    if host.startswith("/"):
        host = quote(host, safe="")
    return f"postgres://{s['USER']}@{host}:{s['PORT'] or 5432}/{s['NAME']}"


def as_here(text: str, secret: str) -> str:
    """The snippet on this machine: the checkout, a real key, the test database."""
    return (text.replace(CHECKOUT, str(ROOT)).replace("alk_...", secret)
            .replace(DOCUMENTED_URL, database_url_of_tests()))


@pytest.fixture
def secret(transactional_db):
    user = UserFactory(username="docs-admin", role="admin", tenants=[])
    user.is_superuser = True
    user.save(update_fields=["is_superuser"])
    return agent_keys.create("docs-bot", tenants=["default"], user=user)[1]


def bare_environment() -> dict[str, str]:
    """What an MCP client passes on: a PATH and a HOME, nothing of this project's."""
    return {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}


def test_the_python_sdk_agent_runs_from_another_folder(secret, tmp_path):
    [program] = [b for b in blocks("python") if "StdioServerParameters" in b]
    assert 'command="python"' not in program
    script = tmp_path / "agent.py"
    script.write_text(as_here(program, secret))
    done = subprocess.run([sys.executable, str(script), secret], cwd=tmp_path,
                          env=bare_environment(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'ledger_record_intent'" in done.stdout and "'run_resume'" in done.stdout
    assert "op_none" in done.stdout  # the tool's refusal, quoting what it was given


def test_the_client_configuration_with_database_url_starts_the_server(secret, tmp_path):
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    configurations = [json.loads(as_here(b, secret)) for b in blocks("json")
                      if '"mcpServers"' in b]
    assert len(configurations) == 2  # with DATABASE_URL, and without (the embedded one)
    with_url, without_url = (c["mcpServers"]["agent-ledger"] for c in configurations)
    assert "DATABASE_URL" in with_url["env"] and "DATABASE_URL" not in without_url["env"]
    assert without_url["command"] == with_url["command"] == f"{ROOT}/.venv/bin/python"
    assert Path(with_url["command"]).exists()

    async def tools() -> list[str]:
        # As a client starts it: its command and env alone, in a folder of its own.
        server = StdioServerParameters(command=with_url["command"], args=with_url["args"],
                                       env=with_url["env"], cwd=str(tmp_path))
        async with Client(server) as client:
            return sorted(tool.name for tool in (await client.list_tools()).tools)

    assert "ledger_record_intent" in run_coroutine(tools())


def test_the_http_example_serves_mcp_on_a_port_the_demo_does_not_hold(secret):
    [command] = re.findall(r"`(\.venv/bin/uvicorn config\.asgi:application --port (\d+))`",
                           PAGE.read_text())
    assert command[1] != "8000", "8000 is make demo's port"
    port = free_port()
    child = subprocess.Popen(
        command[0].replace(f"--port {command[1]}", f"--port {port}").split(),
        cwd=ROOT, env={**bare_environment(), "DATABASE_URL": database_url_of_tests()},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        headers = {"Authorization": f"Bearer {secret}", "Accept":
                   "application/json, text/event-stream", "MCP-Protocol-Version": "2025-06-18"}
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        for _ in range(300):
            try:
                answer = httpx.post(url, json=body, headers=headers, timeout=10)
                break
            except httpx.ConnectError:
                assert child.poll() is None, child.stderr.read()[-3000:]
                time.sleep(0.1)
        assert answer.status_code == 200, answer.text
        names = {tool["name"] for tool in answer.json()["result"]["tools"]}
        assert "ledger_record_intent" in names
    finally:
        child.terminate()
        child.wait(timeout=30)
