"""`make demo-reset` (`manage.py demo_seed --reset`): the demo's database dropped, migrated
and seeded again, so what a person did to the demo is gone; refused where it would drop
something that is not the demo."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest
from django.db import connection

from ledger import receipts
from ledger.models import Operation, Run
from tests.support.processes import ROOT, child_env
from tests.support.servers import free_port


def manage(*args: str, database: str, **env: str) -> subprocess.CompletedProcess:
    # The desk and the articles service of a demo that is not running: free ports (another
    # server on this machine's 8000 is no demo of this test's).
    ports = {"LEDGER_DESK_URL": f"http://127.0.0.1:{free_port()}",
             "DEMO_ARTICLES_PORT": str(free_port())}
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=600, env={**child_env(), **ports, "LEDGER_DATABASE_NAME": database, **env})


def server(dbname: str = "postgres") -> psycopg.Connection:
    db = connection.settings_dict
    return psycopg.connect(host=db["HOST"] or "127.0.0.1", port=db["PORT"] or 5432,
                           user=db["USER"], password=db["PASSWORD"] or None, dbname=dbname,
                           autocommit=True)


@pytest.mark.django_db(transaction=True)
def test_reset_refuses_a_database_with_operations_and_no_demo_run():
    receipts.record_intent("mail.send", "smtp://mail.example", {"to": "ada@example.com"},
                           idempotency_key="not-a-demo")
    done = manage("demo_seed", "--reset", database=connection.settings_dict["NAME"])
    assert done.returncode != 0
    assert "found operations and no demo run; --reset --force drops it anyway" in done.stderr
    assert Operation.objects.count() == 1  # nothing dropped


@pytest.mark.django_db(transaction=True)
def test_reset_while_the_demo_runs_is_refused_in_one_sentence_and_drops_nothing():
    """The running demo's desk answers on its port and its processes hold sessions: the
    reset says to stop the demo first, without a traceback, and the database stays."""
    import socket

    from tests.factories import RunFactory

    RunFactory(run_id="demo-newsroom")  # the demo's database, so only the running demo stops it
    with socket.socket() as desk:
        desk.bind(("127.0.0.1", 0))
        desk.listen()
        port = desk.getsockname()[1]
        done = manage("demo_seed", "--reset", database=connection.settings_dict["NAME"],
                      LEDGER_DESK_URL=f"http://127.0.0.1:{port}")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.strip()]
    assert line.startswith("CommandError: The demo is running (the desk answers on "
                           f"127.0.0.1:{port}"), line
    assert "stop it first (Ctrl-C where `make demo` runs)" in line
    assert Run.objects.filter(run_id="demo-newsroom").exists()  # nothing dropped


def test_reset_is_refused_in_production():
    done = manage("demo_seed", "--reset", database="unused", DJANGO_ENV="production",
                  DJANGO_SECRET_KEY="x" * 50, DJANGO_ALLOWED_HOSTS="localhost",
                  DATABASE_URL=os.environ.get("DATABASE_URL", "postgres://u@127.0.0.1/x"))
    assert done.returncode != 0
    assert "found DJANGO_ENV=production" in done.stderr


@pytest.mark.django_db
def test_reset_puts_the_demo_back_as_it_first_was():
    scratch = f"{connection.settings_dict['NAME']}_demo_reset"
    with server() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{scratch}" WITH (FORCE)')
    try:
        first = manage("demo_seed", "--reset", database=scratch)  # from no database at all
        assert first.returncode == 0, first.stderr
        assert "Open http://" in first.stdout and "reviewer-demo-pass" in first.stdout
        with server(scratch) as conn:
            seeded = conn.execute("SELECT count(*) FROM ledger_operation").fetchone()[0]
            conn.execute("UPDATE auth_user SET username = 'renamed' WHERE username = 'viewer'")
        added = manage("shell", "-c", "from ledger import receipts; receipts.record_intent("
                       "'mail.send', 'smtp://x', {'n': 1}, idempotency_key='added-by-hand')",
                       database=scratch)
        assert added.returncode == 0, added.stderr

        again = manage("demo_seed", "--reset", database=scratch)
        assert again.returncode == 0, again.stderr
        assert f'Database "{scratch}" dropped and created again' in again.stdout
        with server(scratch) as conn:
            assert conn.execute("SELECT count(*) FROM ledger_operation").fetchone()[0] == seeded
            assert conn.execute("SELECT count(*) FROM ledger_operation WHERE idempotency_key"
                                " = 'added-by-hand'").fetchone()[0] == 0
            users = {r[0] for r in conn.execute("SELECT username FROM auth_user")}
            assert {"admin", "reviewer", "viewer"} <= users and "renamed" not in users
    finally:
        with server() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{scratch}" WITH (FORCE)')
