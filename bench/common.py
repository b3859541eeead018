"""Shared plumbing for the benchmarks: a separate database, timing, results, the table.

Every benchmark runs on the PostgreSQL the project uses (the embedded one, or the server
named by DATABASE_URL) but in its own database, `agent_ledger_bench`, so the demo data is
never touched. Ratios are the claim: both sides of a comparison run in the same process,
interleaved in rounds, so machine noise hits both alike. Absolute times are printed too.
Results go to bench/results/latest.json, or to the file LEDGER_BENCH_RESULTS names.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("LEDGER_BENCH_RESULTS")
               or ROOT / "bench" / "results" / "latest.json")
BENCH_DATABASE = os.environ.get("LEDGER_BENCH_DATABASE", "agent_ledger_bench")


def setup_django() -> None:
    """django.setup() against the bench database, creating and migrating it if needed."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ["LEDGER_DATABASE_NAME"] = BENCH_DATABASE
    import django
    from django.conf import settings

    settings.DEBUG = False
    ensure_database()
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)


def ensure_database(name: str = BENCH_DATABASE) -> None:
    """Create database `name` on the server of the project's settings, if it is missing."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(**_server_params("postgres"), autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                            [name]).fetchone():
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def database_url(name: str, **query: str) -> str:
    """A postgres:// URL of database `name` on the server of the project's settings (for a
    child process's DATABASE_URL); `query`: parameters such as application_name."""
    from urllib.parse import quote, urlencode

    params = _server_params(name)
    auth = quote(params.get("user", ""), safe="") + (
        f":{quote(params['password'], safe='')}" if params.get("password") else "")
    port = f":{params['port']}" if params.get("port") else ""
    return (f"postgres://{auth}@{quote(params.get('host', '127.0.0.1'), safe='')}{port}/"
            f"{quote(name, safe='')}" + (f"?{urlencode(query)}" if query else ""))


def _server_params(dbname: str) -> dict:
    from django.conf import settings

    db = dict(settings.DATABASES["default"])
    params = {"dbname": dbname, "user": db.get("USER") or None,
              "password": db.get("PASSWORD") or None, "host": db.get("HOST") or None,
              "port": db.get("PORT") or None,  # several hosts: the primary among them
              "target_session_attrs": db.get("OPTIONS", {}).get("target_session_attrs")}
    return {k: str(v) for k, v in params.items() if v}


def quiet_server(timeout: float = 120.0) -> None:
    """Let the server finish the background work earlier benchmarks left it, before measuring.

    A purge of a million rows keeps autovacuum and the checkpointer writing for minutes;
    measured meanwhile, the side that writes to the purged tables pays for it. Forces a
    checkpoint (where the role may) and waits for autovacuum workers to finish.
    """
    from django.db import DatabaseError, connection, transaction

    with connection.cursor() as cursor:
        try:
            with transaction.atomic():
                cursor.execute("CHECKPOINT")
        except DatabaseError:
            pass  # CHECKPOINT needs superuser or pg_checkpoint: then only wait
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            cursor.execute("SELECT count(*) FROM pg_stat_activity"
                           " WHERE backend_type = 'autovacuum worker'")
            if cursor.fetchone()[0] == 0:
                return
            time.sleep(1)
    print(f"note: autovacuum still busy after {timeout:.0f} s; measuring anyway", flush=True)


def parse_args(description: str, **extra) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--scale", choices=["quick", "full"], default="quick",
                        help="quick: about a minute; full: the sizes the README reports")
    for name, kwargs in extra.items():
        parser.add_argument(f"--{name.replace('_', '-')}", **kwargs)
    return parser.parse_args()


class Stopwatch:
    """Collects per-call durations (seconds) for one side of a comparison."""

    def __init__(self, name: str):
        self.name = name
        self.samples: list[float] = []

    def time(self, fn: Callable[[], object]) -> None:
        started = time.perf_counter()
        fn()
        self.samples.append(time.perf_counter() - started)

    @property
    def total(self) -> float:
        return sum(self.samples)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def interleave(rounds: int, sides: list[tuple[Stopwatch, Callable[[], None]]], *,
               between: Callable[[], None] | None = None, every: int = 100) -> None:
    """Run each side once per round, alternating who goes first, so drift hits both;
    `between` (untimed) after every `every` rounds."""
    for r in range(rounds):
        order = sides if r % 2 == 0 else list(reversed(sides))
        for watch, fn in order:
            watch.time(fn)
        if between is not None and (r + 1) % every == 0:
            between()


def analyzer(tables: list[str]) -> Callable[[], None] | None:
    """What autovacuum would do for `tables` (none: the whole database) while a benchmark
    writes them, when the server does not: None where autovacuum runs, else a function that
    ANALYZEs them (untimed, for `interleave(between=)`). Without it, on a server with
    autovacuum off, the planner keeps the statistics of the tables as a benchmark's TRUNCATE
    left them (empty), its cached plans (the triggers' among them) scan what has grown
    since, and each write costs more than the last: P1's full scale measured the ledger's
    lifecycle at 2-5x its quick one."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW autovacuum")
        if cursor.fetchone()[0] == "on":
            return None
    print(f"note: autovacuum is off on this server: {', '.join(tables) or 'the database'} "
          "analyzed between rounds, as autovacuum would", flush=True)

    def analyze() -> None:
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {', '.join(tables)}")

    return analyze


def record(benchmark: str, data: dict) -> None:
    """Merge `data` under `benchmark` into bench/results/latest.json and print it."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[benchmark] = {**data, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                               time.gmtime())}
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True))


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    print("-" * (width + 30))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"
