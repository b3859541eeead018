"""`make serve`: every process of the Procfile under honcho, as real processes with the
production settings; each comes up and does its work, and one dying is reported and stops
the rest (never hidden behind the others)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from django.db import connection

from ledger import receipts
from ledger.models import Operation, OperationEvent
from tests.support.honcho import (
    ROOT,
    Honcho,
    connected_logins,
    database_now,
    database_url,
    process_names,
    procfile_for_tests,
    wait_for_port,
)
from tests.support.servers import free_port

TOKEN = "serve-test-metrics-token-0123456789"


def serve_logins() -> dict[str, str]:
    """What `make serve` sets on the embedded server: each process's login, by process."""
    makefile = (ROOT / "Makefile").read_text()
    logins = makefile.split("\nSERVE_LOGINS :=", 1)[1].split("\nserve:", 1)[0]
    return dict(re.findall(r"(LEDGER_[A-Z]+_LOGIN)=(\w+)", logins))


def production_env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in {"LEDGER_DATABASE_NAME", "DJANGO_ALLOW_ASYNC_UNSAFE", "PORT"}}
    env.update(
        DJANGO_ENV="production",
        DJANGO_SECRET_KEY="serve-test-" + "s3cr3t-" * 8,
        DJANGO_ALLOWED_HOSTS="127.0.0.1",
        DJANGO_SECURE_SSL_REDIRECT="0",
        DATABASE_URL=database_url(),
        LEDGER_STATIC_ROOT=str(tmp_path / "static"),
        LEDGER_METRICS_TOKEN=TOKEN,
        GUNICORN_WORKERS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def get(port: int, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path, headers={"X-Forwarded-Proto": "https", **(headers or {})})
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, body


def eventually(check, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.25)
    raise AssertionError(f"expected {what} within {timeout:.0f} s, found it not")


def test_the_procfile_lists_the_processes_the_runbook_names():
    assert process_names("Procfile") == ["web", "reconcile", "notify", "seal"]
    # `make serve` runs this very file, its output unbuffered so each line shows at once
    serve = (ROOT / "Makefile").read_text().split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "PYTHONUNBUFFERED=1 \\\n\t\t$(VENV)/bin/honcho start -f Procfile -p $(PORT)" in serve
    # on the embedded server, the owner makes one login per process, as `make demo` does
    assert "manage.py db_roles $(LOGINS)" in serve
    runbook = (ROOT / "docs" / "operations.md").read_text()
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line and not line.startswith("#"):
            assert line in runbook, f"expected the runbook to show {line!r}, found it not"


@pytest.mark.django_db(transaction=True)
def test_make_serve_starts_every_process_healthy_and_reports_one_that_dies(tmp_path):
    env = production_env(tmp_path)
    # as `make serve` on the embedded server: each process logs in as its own kind (the
    # logins tests/conftest.py made, those of the Makefile's LOGINS)
    logins = serve_logins()
    assert logins == {"LEDGER_WEB_LOGIN": "ledger_web",
                      "LEDGER_RECONCILE_LOGIN": "ledger_reconcile",
                      "LEDGER_NOTIFY_LOGIN": "ledger_notify", "LEDGER_SEAL_LOGIN": "ledger_seal"}
    env.update(logins)
    collected = subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--no-input", "-v", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert collected.returncode == 0, collected.stderr
    port = free_port()
    started = database_now()
    honcho = Honcho(procfile_for_tests("Procfile", tmp_path), port=port, env=env)
    try:
        # Each process is up: the web server listens on the base port and is healthy, and
        # each worker says it started.
        wait_for_port(port, honcho)
        honcho.read_until(r"reconcile\.1\s+\| reconcile: started")
        honcho.read_until(r"notify\.1\s+\| notify: started")
        honcho.read_until(r"seal\.1\s+\| seal: started")
        status, body = get(port, "/healthz")
        health = json.loads(body)
        assert (status, health["status"]) == (200, "ok"), health
        status, body = get(port, "/metrics", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and b"ledger_sealer_max_lag_seconds" in body

        # Each logs in as its own login, none as the owner: the web process's pool and
        # each worker hold a connection of their own login.
        owner = connection.settings_dict["USER"]
        eventually(lambda: connected_logins(since=started) >= set(logins.values()),
                   f"sessions of {sorted(logins.values())}")
        assert owner not in connected_logins(since=started)

        # ... and does its work: the sealer links a new event into the chain, the
        # reconciler settles an outcome_unknown (no reconciler for it: to a person).
        op = receipts.record_intent("docs.serve-check", "https://nowhere.example", {"n": 1},
                                    idempotency_key="serve-check")
        receipts.mark_submitted(op)
        receipts.mark_outcome_unknown(op, error_code="TimeoutError")
        eventually(lambda: not OperationEvent.objects.filter(
            operation=op, chain_seq__isnull=True).exists(), "the seal process to seal")
        eventually(lambda: Operation.objects.get(pk=op.pk).state == "manual_review",
                   "the reconcile process to settle the operation")

        # One process dies: honcho says which and how, stops the others, exits non-zero.
        os.kill(honcho.child_of("seal"), signal.SIGKILL)
        honcho.read_until(r"system\s+\| seal\.1 stopped \(rc=")
        assert honcho.proc.wait(timeout=60) != 0
        output = honcho.stop()
        for name in ("web", "reconcile", "notify"):
            assert f"{name}.1 stopped" in output, output[-3000:]
    finally:
        honcho.stop()
