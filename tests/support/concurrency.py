"""Real threads racing on real PostgreSQL connections, and waiting for them to block."""

from __future__ import annotations

import threading
import time

from django.db import connection, connections


def run_threads(count: int, target, *, start_together: bool = True):
    """Start `target(i)` in `count` threads (released together by a barrier); returns
    (threads, results, errors) — `join(threads)` before reading the lists. Each thread
    closes its own connection when done."""
    barrier = threading.Barrier(count)
    results, errors = [], []
    lock = threading.Lock()

    def body(i):
        try:
            if start_together:
                barrier.wait()
            value = target(i)
            with lock:
                results.append(value)
        except Exception as exc:
            with lock:
                errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads, results, errors


def join(threads, timeout: float = 60.0) -> None:
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "expected every racing thread to finish, found one stuck"


def wait_for_lock_waiters(count: int, timeout: float = 30.0) -> None:
    """Poll until `count` other sessions of this database wait on a lock (they reached the
    contested statement). Raises AssertionError if they never do."""
    deadline = time.monotonic() + timeout
    waiting = 0
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            # Inside a transaction pg_stat_activity is a snapshot: take a fresh one.
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            )
            waiting = cursor.fetchone()[0]
        if waiting >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"expected {count} sessions waiting on a lock, found {waiting}")
