"""Real server processes for tests: a free loopback port, and the ledger served by
`uvicorn config.asgi:application` (as in production) against pytest-django's test
database, that a test may stop, kill (SIGKILL) and start again on the same port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.processes import ROOT


def free_port() -> int:
    """A loopback port nothing listens on at this moment."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LedgerServer:
    """`uvicorn config.asgi:application` on one port, on the test database `database`,
    logged in as `login` (None: the test's own login): `start()`, `stop()` (SIGTERM),
    `kill()` (SIGKILL), `start()` again."""

    def __init__(self, database: str, log_path: Path, *, login: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database = database
        self.log_path = log_path
        self.login = login
        self.proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", LEDGER_DATABASE_NAME=self.database)
        if self.login is not None:
            env["LEDGER_DATABASE_USER"] = self.login
        log = open(self.log_path, "a")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "config.asgi:application", "--host",
             "127.0.0.1", "--port", str(self.port), "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/api/v1/openapi.json", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError("expected the ledger server to answer, found it down:\n"
                                     + self.log_path.read_text()[-3000:])
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None
