"""A real ASGI server process (uvicorn on config.asgi, as in production) on loopback,
against pytest-django's test database, and agent keys to call it with."""

from __future__ import annotations

import httpx
import pytest

from ledger import agent_keys
from tests.factories import UserFactory
from tests.support.servers import LedgerServer


@pytest.fixture(scope="session")
def api_server(django_db_setup, tmp_path_factory):
    """The base URL of `uvicorn config.asgi:application` serving the test database, logged
    in as the web process's login (agent and desk: tests/conftest.py, docs/security.md)."""
    from django.db import connection

    from tests.conftest import TEST_LOGINS

    server = LedgerServer(connection.settings_dict["NAME"],
                          tmp_path_factory.mktemp("api-server") / "server.log",
                          login=TEST_LOGINS["web"])
    server.start()
    yield server.url
    server.stop()


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
