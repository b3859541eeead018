"""A real ASGI server process (uvicorn on config.asgi, as in production) on loopback,
against pytest-django's test database, and agent keys to call it with."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from ledger import agent_keys
from tests.factories import UserFactory
from tests.support.processes import ROOT


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def api_server(django_db_setup, tmp_path_factory):
    """The base URL of `uvicorn config.asgi:application` serving the test database, logged
    in as the web process's login (agent and desk: tests/conftest.py, docs/security.md)."""
    from django.db import connection

    from tests.conftest import TEST_LOGINS

    port = _free_port()
    log = open(tmp_path_factory.mktemp("api-server") / "server.log", "w+")  # noqa: SIM115
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               LEDGER_DATABASE_NAME=connection.settings_dict["NAME"],
               LEDGER_DATABASE_USER=TEST_LOGINS["web"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "config.asgi:application", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/api/v1/openapi.json", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=10)
            log.seek(0)
            raise AssertionError(f"expected the API server to answer, found it down:\n"
                                 f"{log.read()}")
        time.sleep(0.2)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    log.close()


@pytest.fixture
def admin(transactional_db):
    # Keys name only tenants their creator may see: this admin holds every tenant.
    user = UserFactory(username="keys-admin", role="admin", tenants=[])
    user.is_superuser = True
    user.save(update_fields=["is_superuser"])
    return user


@pytest.fixture
def make_key(admin):
    """make_key(name, tenants=["default"]) -> the secret of a new agent key."""

    def make(name: str, tenants=("default",)) -> str:
        return agent_keys.create(name, tenants=list(tenants), user=admin)[1]

    return make


@pytest.fixture
def client_for(api_server):
    """client_for(secret) -> an httpx.Client on the server sending that bearer key."""
    clients = []

    def make(secret: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        client = httpx.Client(base_url=api_server, headers=headers, timeout=30)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
