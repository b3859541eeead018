"""A Procfile's process set under honcho, as `make serve` / `make demo` start it: real
processes, read line by line, stopped (with everything they started) at the end."""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

from django.db import connection

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def database_url() -> str:
    db = connection.settings_dict
    host = quote(db["HOST"] or "127.0.0.1", safe="")
    return f"postgres://{db['USER']}@{host}:{db['PORT'] or 5432}/{db['NAME']}"



def procfile_for_tests(name: str, tmp_path: Path, replace: dict[str, str] | None = None) -> Path:
    """The project's Procfile `name` as it is, but with `.venv/bin/` pointing at the venv
    running the tests (a worktree may have none of its own) and `replace` applied."""
    text = (ROOT / name).read_text().replace(".venv/bin/", f"{BIN}/")
    for old, new in (replace or {}).items():
        assert old in text, f"expected {old!r} in {name}, found none"
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return path


def process_names(name: str) -> list[str]:
    return re.findall(r"^(\w+):", (ROOT / name).read_text(), re.M)


class Honcho:
    """`honcho start` of a Procfile; `lines` is everything it printed so far."""

    def __init__(self, procfile: Path, *, port: int, env: dict[str, str]):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [str(BIN / "honcho"), "start", "-f", str(procfile), "-d", str(ROOT),
             "-p", str(port)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)

    def read_until(self, pattern: str, timeout: float = 90.0) -> re.Match:
        """Read lines until one matches `pattern` (searched in every line read so far)."""
        regex = re.compile(pattern)
        for line in self.lines:
            if found := regex.search(line):
                return found
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._selector.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip("\n"))
            if found := regex.search(line):
                return found
        raise AssertionError(f"expected a line matching {pattern!r} from honcho, found none "
                             f"in:\n" + "\n".join(self.lines[-80:]))

    def child_of(self, process: str) -> int:
        """The pid of the command honcho started for `process` (honcho prints the pid of
        the shell it runs it in)."""
        shell = int(self.read_until(rf"system\s+\| {process}\.1 started \(pid=(\d+)\)")[1])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            children = Path(f"/proc/{shell}/task/{shell}/children").read_text().split()
            if children:
                return int(children[0])
            time.sleep(0.1)
        return shell  # the shell exec'd the command itself

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C, as a person stops it
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        rest = self.proc.stdout.read()
        self.lines += rest.splitlines()
        return "\n".join(self.lines)


def wait_for_port(port: int, honcho: Honcho, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if honcho.proc.poll() is not None:
                break
            time.sleep(0.2)
    raise AssertionError(f"expected a server on port {port}, found none:\n" +
                         honcho.stop()[-6000:])


def connected_logins(*, since=None) -> set[str]:
    """The logins of every other session on the test database now (pg_stat_activity);
    with `since` (a time of the database's clock), only of sessions that began after it,
    so that processes other tests left connected do not count."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT DISTINCT usename::text FROM pg_stat_activity WHERE datname = "
                       "current_database() AND pid <> pg_backend_pid() AND usename IS NOT NULL"
                       " AND (%s::timestamptz IS NULL OR backend_start >= %s::timestamptz)",
                       [since, since])
        return {row[0] for row in cursor.fetchall()}


def database_now():
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]
