"""A `DATABASE_URL` naming a database that does not exist yet: create it, or say how.

Where: `manage.py` runs the command; only when it fails with PostgreSQL's "database ...
does not exist" for the configured database does it come here, create the database (the
role needs CREATEDB, or to be a superuser) and run the command once more. The check costs
nothing on every other start, and nothing had been done before the failure: it is the
command's first connection. A role that may not create databases gets one line naming the
`createdb` command to run, instead of a traceback.

Not covered: `runserver` fails in its autoreloader's child thread, out of reach here; `make
demo` and `make serve` run `migrate` first, which creates the database.
"""

from __future__ import annotations

import re
import sys
from typing import Any

MISSING = re.compile(r'database "(?P<name>[^"]+)" does not exist')
MAINTENANCE_DATABASES = ("postgres", "template1")


class CannotCreateDatabase(Exception):
    """The configured database does not exist and this role may not create it."""


def missing_database(exc: BaseException, settings_dict: dict[str, Any]) -> str | None:
    """The configured database's name when `exc` says it does not exist, else None."""
    found = MISSING.search(str(exc))
    if found and found["name"] == settings_dict.get("NAME"):
        return found["name"]
    return None


def create_database(settings_dict: dict[str, Any]) -> None:
    """CREATE DATABASE for `settings_dict` through a maintenance database of the same server.

    CannotCreateDatabase (its message names the `createdb` command) when the role lacks the
    right; a database created meanwhile by someone else is fine.
    """
    import psycopg
    from psycopg import errors, sql

    name = settings_dict["NAME"]
    host = settings_dict.get("HOST") or "localhost"
    port = settings_dict.get("PORT") or 5432
    user = settings_dict.get("USER") or ""
    last: Exception | None = None
    for maintenance in MAINTENANCE_DATABASES:
        try:
            conn = psycopg.connect(
                dbname=maintenance, host=host, port=port, user=user or None,
                password=settings_dict.get("PASSWORD") or None, autocommit=True,
                connect_timeout=10,
            )
        except psycopg.OperationalError as exc:
            last = exc
            continue
        with conn:
            try:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            except errors.DuplicateDatabase:
                pass
            except errors.InsufficientPrivilege:
                raise CannotCreateDatabase(_createdb_hint(name, host, port, user)) from None
        return
    raise CannotCreateDatabase(
        f"{_createdb_hint(name, host, port, user)} (connecting to a maintenance database to "
        f"create it failed: {last})"
    )


def drop_database(settings_dict: dict[str, Any]) -> None:
    """DROP DATABASE ... WITH (FORCE) for `settings_dict` (its sessions are ended first),
    through a maintenance database of the same server. For `demo_seed --reset` only."""
    import psycopg
    from psycopg import sql

    last: Exception | None = None
    for maintenance in MAINTENANCE_DATABASES:
        try:
            conn = psycopg.connect(
                dbname=maintenance, host=settings_dict.get("HOST") or "localhost",
                port=settings_dict.get("PORT") or 5432,
                user=settings_dict.get("USER") or None,
                password=settings_dict.get("PASSWORD") or None, autocommit=True,
                connect_timeout=10,
            )
        except psycopg.OperationalError as exc:
            last = exc
            continue
        with conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(settings_dict["NAME"])))
        return
    raise CannotCreateDatabase(
        f'expected to reach a maintenance database to drop "{settings_dict["NAME"]}", '
        f"found none reachable: {last}")


def _createdb_hint(name: str, host: str, port: Any, user: str) -> str:
    return (
        f'expected database "{name}" on {host}:{port} (from DATABASE_URL) to exist, found none, '
        f'and role "{user or "(default)"}" may not create it: create it as a role that may, '
        f"`createdb -h {host} -p {port} -U postgres {name}`"
        + (f" (then `GRANT ALL ON DATABASE {name} TO {user}`)" if user else "")
        + ", then run `make migrate`"
    )


def create_if_missing(exc: BaseException) -> bool:
    """After a command failed with `exc`: True when it was the configured database missing
    and it has now been created; False when `exc` is about something else. Exits with the
    `createdb` hint (status 1) when the role may not create it."""
    from django.db import connections

    settings_dict = connections["default"].settings_dict
    name = missing_database(exc, settings_dict)
    if name is None:
        return False
    try:
        create_database(settings_dict)
    except CannotCreateDatabase as why:
        sys.stderr.write(f"{why}\n")
        raise SystemExit(1) from None
    sys.stderr.write(f'created database "{name}" (DATABASE_URL named a database that did '
                     "not exist)\n")
    return True
