"""A real PgBouncer (Debian's /usr/sbin/pgbouncer) in transaction mode on a loopback port,
in front of the test database's server, started and stopped by the tests.

`PgBouncer(host, port, users).start()`; `url(database, user)` names a database through it.
`LEDGER_TEST_POOLER=1` (`make test-pooler`) puts one in front of the whole test session:
every child process and test server of the session (tests/support/processes.py,
tests/support/servers.py) then connects through it (`LEDGER_POOLER_URL`), while the test
process itself, which creates and drops the test database, connects directly.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PGBOUNCER = os.environ.get("LEDGER_PGBOUNCER", "/usr/sbin/pgbouncer")


def available() -> bool:
    return Path(PGBOUNCER).is_file() or shutil.which("pgbouncer") is not None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PgBouncer:
    """One pgbouncer process: `pool_mode = transaction`, every database name passed to the
    server at (host, port), `users` admitted (trust: the server still checks them), at most
    `pool_size` server connections per database and login."""

    def __init__(self, host: str, port: int | str, users, *, pool_size: int = 5):
        self.upstream = (host or "127.0.0.1", int(port or 5432))
        self.users = sorted(set(users))
        self.pool_size = pool_size
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="ledger-pgbouncer-"))
        self.proc: subprocess.Popen | None = None

    def url(self, database: str, user: str = "postgres") -> str:
        return f"postgres://{user}@127.0.0.1:{self.port}/{database}"

    def write_config(self) -> Path:
        host, port = self.upstream
        (self.dir / "users.txt").write_text("".join(f'"{u}" ""\n' for u in self.users))
        lines = [
            "[databases]",
            f"* = host={host} port={port}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {self.dir / 'users.txt'}",
            "pool_mode = transaction",
            f"default_pool_size = {self.pool_size}",
            "max_client_conn = 500",
            # PgBouncer older than 1.21 cannot carry prepared statements across
            # transactions: the ledger's processes behind it run with them off
            # (LEDGER_POOLER_URL, config/settings.py).
            "server_reset_query =",
            "ignore_startup_parameters = extra_float_digits,options",
            "log_connections = 0",
            "log_disconnections = 0",
        ]
        if os.geteuid() == 0:  # pgbouncer refuses to run as root: it drops to this user
            user = "postgres" if _user_exists("postgres") else "nobody"
            lines.append(f"user = {user}")
            self.dir.chmod(0o755)
        config = self.dir / "pgbouncer.ini"
        config.write_text("\n".join(lines) + "\n")
        return config

    def start(self) -> PgBouncer:
        config = self.write_config()
        log = open(self.dir / "pgbouncer.log", "w")  # noqa: SIM115 - the child holds it
        for path in self.dir.iterdir():
            path.chmod(0o644)
        self.proc = subprocess.Popen([PGBOUNCER if Path(PGBOUNCER).is_file() else "pgbouncer",
                                      str(config)], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise AssertionError(f"expected pgbouncer to listen on 127.0.0.1:{self.port}, found "
                             f"it {'exited' if self.proc is None else 'silent'}:\n{self.log()}")

    def log(self) -> str:
        path = self.dir / "pgbouncer.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def session_url() -> str | None:
    """The pooler URL children of this test session connect through, if any
    (`LEDGER_TEST_POOLER=1`: set by the session's fixture in tests/conftest.py)."""
    return os.environ.get("LEDGER_TEST_POOLER_URL") or None
