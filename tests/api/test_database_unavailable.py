"""The ledger's database not answering is a 503 problem, never a 500 (a real server whose
database is unreachable: nothing listens on its port)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.processes import ROOT
from tests.support.servers import free_port

SECRET = "alk_" + "k" * 43  # well formed, so the server has to ask the database about it



@pytest.mark.parametrize("pool", ["0", "1"])
def test_an_unreachable_database_answers_503_problem_json_with_retry_after(pool, tmp_path):
    port, dead = free_port(), free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", LEDGER_DB_POOL=pool,
               LEDGER_DB_POOL_TIMEOUT="0.5",
               DATABASE_URL=f"postgres://postgres@127.0.0.1:{dead}/nowhere")
    env.pop("LEDGER_DATABASE_NAME", None)
    env.pop("LEDGER_DATABASE_USER", None)
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "config.asgi:application", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/api/v1/openapi.json", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    "expected the server to start, found it down")
                time.sleep(0.2)
        answer = httpx.post(f"{url}/api/v1/operations", timeout=30,
                            headers={"Authorization": f"Bearer {SECRET}"},
                            json={"operation": "articles.create", "target": "https://x",
                                  "intent": {"title": "t"}})
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.seek(0)
        server_log = log.read()
        log.close()
    assert answer.status_code == 503, (answer.status_code, answer.text, server_log)
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.headers["retry-after"] == "1"
    body = answer.json()
    assert body["type"].endswith(":database-unavailable")
    assert "expected the ledger's database to answer" in body["detail"]
    assert SECRET not in server_log
