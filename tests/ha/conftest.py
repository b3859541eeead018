"""The pooler and lost-answer tests reach the test database's server over TCP (a
pgbouncer and a fault proxy in front of it). On the embedded server (a Unix socket owned by
its own system user) they are skipped, and say so: CI runs them in its pass against the
PostgreSQL server at 127.0.0.1:5432 (they carry the `server` marker)."""

import pytest


@pytest.fixture(autouse=True)
def _server_on_tcp():
    from django.db import connection

    if (connection.settings_dict.get("HOST") or "").startswith("/"):
        pytest.skip("expected the test database's server on TCP (DATABASE_URL), found the "
                    "embedded server on a Unix socket")
