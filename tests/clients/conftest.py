"""A ledger served by a real uvicorn process on config.asgi, against pytest-django's test
database, that a test may kill (SIGKILL) and start again on the same port; and the client
package from this tree (clients/python) ahead of any installed copy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ledger import agent_keys
from tests.factories import UserFactory
from tests.support.processes import ROOT
from tests.support.servers import LedgerServer

CLIENT_SRC = Path(ROOT) / "clients" / "python"
sys.path.insert(0, str(CLIENT_SRC))


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
