"""A ledger served by a real uvicorn process on config.asgi, against pytest-django's test
database, that a test may kill (SIGKILL) and start again on the same port; and the client
package from this tree (clients/python) ahead of any installed copy."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ledger import agent_keys
from tests.factories import UserFactory
from tests.support.processes import ROOT

CLIENT_SRC = Path(ROOT) / "clients" / "python"
sys.path.insert(0, str(CLIENT_SRC))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LedgerServer:
    """`uvicorn config.asgi:application` on one port: `kill()` it, `start()` it again."""

    def __init__(self, database: str, log_path: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database = database
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", LEDGER_DATABASE_NAME=self.database)
        log = open(self.log_path, "a")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "config.asgi:application", "--host",
             "127.0.0.1", "--port", str(self.port), "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/api/v1/openapi.json", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError("expected the ledger server to answer, found it down:\n"
                                     + self.log_path.read_text()[-3000:])
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture(scope="session")
def ledger_server(django_db_setup, tmp_path_factory):
    from django.db import connection

    server = LedgerServer(connection.settings_dict["NAME"],
                          tmp_path_factory.mktemp("ledger-server") / "server.log")
    server.start()
    yield server
    server.kill()


@pytest.fixture
def server(ledger_server, transactional_db):
    """The running server (started again if an earlier test left it down)."""
    if not ledger_server.running:
        ledger_server.start()
    yield ledger_server
    if not ledger_server.running:
        ledger_server.start()


@pytest.fixture
def admin(transactional_db):
    user = UserFactory(username="keys-admin", role="admin", tenants=[])
    user.is_superuser = True
    user.save(update_fields=["is_superuser"])
    return user


@pytest.fixture
def secret(admin):
    return agent_keys.create("client-bot", tenants=["default"], user=admin)[1]


@pytest.fixture
def ledger(server, secret):
    from ledger_client import Ledger

    client = Ledger(server.url, key=secret, record_for=60, approval_poll=0.1)
    yield client
    client.close()
