"""`manage.py` with a DATABASE_URL naming a database that does not exist yet."""

import os
import subprocess
import sys
import uuid
from urllib.parse import quote

import psycopg
import pytest
from django.db import connection

from tests.support.processes import ROOT


def server():
    """Host, port and the test run's (superuser) role of the server under test."""
    s = connection.settings_dict
    return s["HOST"] or "localhost", s["PORT"] or 5432, s["USER"] or "postgres"


def admin_sql(statement):
    host, port, user = server()
    with psycopg.connect(dbname="postgres", host=host, port=port, user=user,
                         autocommit=True) as conn:
        cursor = conn.execute(statement)
        return cursor.fetchall() if statement.startswith("SELECT") else None


def database_exists(name):
    return admin_sql(f"SELECT 1 FROM pg_database WHERE datname = '{name}'") != []


def manage(*args, user):
    host, port, _ = server()
    env = {k: v for k, v in os.environ.items() if k != "LEDGER_DATABASE_NAME"}
    name = f"ledger_fresh_{uuid.uuid4().hex[:10]}"
    # The embedded server listens on a socket directory: a path, percent-encoded in the URL.
    netloc_host = quote(host, safe="") if host.startswith("/") else host
    env["DATABASE_URL"] = f"postgres://{user}@{netloc_host}:{port}/{name}"
    done = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    return name, done


@pytest.fixture
def fresh():
    names = []
    yield names
    for name in names:
        admin_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.django_db
def test_migrate_creates_the_database_when_the_role_may(fresh):
    name, done = manage("migrate", "--no-input", user=server()[2])
    fresh.append(name)
    assert done.returncode == 0, done.stderr
    assert f'created database "{name}"' in done.stderr
    assert "Applying ledger.0001_initial... OK" in done.stdout
    assert database_exists(name)


@pytest.mark.django_db
def test_a_role_that_may_not_create_it_is_told_the_createdb_command(fresh):
    role = f"ledger_nocreate_{uuid.uuid4().hex[:8]}"
    admin_sql(f"CREATE ROLE {role} LOGIN NOCREATEDB")
    try:
        name, done = manage("migrate", "--no-input", user=role)
        fresh.append(name)
    finally:
        admin_sql(f"DROP ROLE {role}")
    assert done.returncode == 1
    host, port, _ = server()
    assert f"createdb -h {host} -p {port} -U postgres {name}" in done.stderr
    assert f'expected database "{name}"' in done.stderr and "found none" in done.stderr
    assert "Traceback" not in done.stderr
    assert not database_exists(name)


@pytest.mark.django_db
def test_other_connection_errors_are_not_taken_for_a_missing_database(fresh):
    name, done = manage("migrate", "--no-input", user="no_such_role_" + uuid.uuid4().hex[:6])
    fresh.append(name)
    assert done.returncode == 1
    assert "does not exist" in done.stderr and "created database" not in done.stderr
    assert not database_exists(name)
