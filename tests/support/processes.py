"""Run Python code in a real child process against the test database (crash tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from django.db import connection

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import os, sys
sys.path.insert(0, {root!r})
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
import django
django.setup()
"""


def child_env(login: str | None = None) -> dict[str, str]:
    """The environment of a child on the test database; `login`: logged in as that role
    (`manage.py db_roles --login`) instead of the test's own login."""
    env = dict(os.environ)
    env["LEDGER_DATABASE_NAME"] = connection.settings_dict["NAME"]
    env["PYTHONUNBUFFERED"] = "1"
    if login is not None:
        env["LEDGER_DATABASE_USER"] = login
    return env


def spawn(code: str, *, login: str | None = None, **kwargs) -> subprocess.Popen:
    """Start `code` (after django.setup()) in a child process; stdout is a text pipe."""
    source = PRELUDE.format(root=str(ROOT)) + textwrap.dedent(code)
    return subprocess.Popen(
        [sys.executable, "-c", source],
        cwd=ROOT,
        env=child_env(login),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float = 60.0) -> str:
    """Read the child's stdout until a line starting with `prefix`; returns that line."""
    import selectors
    import time

    deadline = time.monotonic() + timeout
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
            break
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.strip()
    proc.kill()
    _, err = proc.communicate(timeout=10)
    raise AssertionError(f"expected a line starting with {prefix!r} from the child, found none; "
                         f"stderr:\n{err}")


def run_as(login: str, code: str, timeout: float = 120.0) -> dict:
    """Run `code` in a child logged in as `login`; it sets `result` (JSON-able), returned.
    A child that fails is an AssertionError with its stderr."""
    import json

    proc = spawn(code + "\nprint('RESULT ' + __import__('json').dumps(result))", login=login)
    out, err = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"expected the child as {login} to finish, found exit "
                             f"{proc.returncode}; stderr:\n{err}")
    return json.loads(lines[-1][len("RESULT "):])


_TRIES = """
from django.db import connection, transaction

result = {}
for name, sql in statements.items():
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql)
        result[name] = "accepted"
    except Exception as exc:
        result[name] = [getattr(exc.__cause__, "sqlstate", None), str(exc).splitlines()[0]]
"""


def tries_as(login: str, statements: dict[str, str]) -> dict:
    """Each of `statements` (name -> SQL without parameters) run in a transaction of its own
    in a child logged in as `login`: name -> "accepted", or [SQLSTATE, the error's first
    line] for a refusal."""
    return run_as(login, f"statements = {statements!r}\n" + _TRIES)
