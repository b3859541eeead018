"""Health of one ledger deployment, for load balancers and on-call people (`/healthz`).

A health check is a function returning a `Check`. `CHECKS` lists them in the order they
run; a component that has its own lag to report (a background worker, a sealer) adds its
check with `@register`. A check is either *critical* (the process cannot serve: the
database is unreachable, migrations are missing) or a *warning* (the process can serve
but something behind it is late: the reconcile backlog). Only a failed critical check
makes `/healthz` answer 503, so a late background worker never takes every web process
out of a load balancer; warnings are reported in the body and in `/metrics`.

Each check runs at most one cheap query (index look-ups, nothing that counts a table).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cache
from typing import Any, Literal

from django.db import DatabaseError, connection
from django.db.migrations.loader import MigrationLoader
from django.utils import timezone

from ledger import conf
from ledger.states import State

Severity = Literal["critical", "warning"]


@dataclass(frozen=True)
class Check:
    """The answer of one health check. `ok` False on a critical check means 503."""

    name: str
    ok: bool
    severity: Severity
    detail: str
    value: Any = None

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "severity": self.severity, "detail": self.detail,
                "value": self.value}


@dataclass(frozen=True)
class Report:
    checks: list[Check] = field(default_factory=list)

    @property
    def is_healthy(self) -> bool:
        """False when a critical check failed (warnings never make a process unhealthy)."""
        return all(c.ok for c in self.checks if c.severity == "critical")

    @property
    def status(self) -> str:
        if not self.is_healthy:
            return "fail"
        return "ok" if all(c.ok for c in self.checks) else "warn"

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "checks": {c.name: c.as_dict() for c in self.checks}}


HealthCheck = Callable[[datetime], Check]
CHECKS: list[HealthCheck] = []


def register(check: HealthCheck) -> HealthCheck:
    """Add `check(now) -> Check` to every later `run()`; usable as a decorator."""
    if check not in CHECKS:
        CHECKS.append(check)
    return check


def run(*, now: datetime | None = None) -> Report:
    """Run every registered check in order. After a failed database check, the checks that
    need the database are reported as skipped (failed) rather than run against it."""
    now = now or timezone.now()
    results: list[Check] = []
    for check in CHECKS:
        if results and not results[0].ok and check is not database:
            results.append(Check(check.__name__, False, _severity(check),
                                 "skipped: the database is unreachable"))
            continue
        try:
            results.append(check(now))
        except DatabaseError as exc:
            results.append(Check(check.__name__, False, _severity(check),
                                 f"expected the query to answer, found {type(exc).__name__}: "
                                 f"{_first_line(exc)}"))
    return Report(results)


def _severity(check: HealthCheck) -> Severity:
    return getattr(check, "severity", "critical")


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def severity(level: Severity) -> Callable[[HealthCheck], HealthCheck]:
    def mark(check: HealthCheck) -> HealthCheck:
        check.severity = level  # type: ignore[attr-defined]
        return check
    return mark


# --- the checks ------------------------------------------------------------------------------


@register
@severity("critical")
def database(now: datetime) -> Check:
    """The database answers a query (a pooled connection is checked out and returned)."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except DatabaseError as exc:
        return Check("database", False, "critical",
                     f"expected PostgreSQL to answer, found {type(exc).__name__}: "
                     f"{_first_line(exc)}")
    return Check("database", True, "critical", "PostgreSQL answers")


@cache
def _expected_migrations() -> frozenset[tuple[str, str]]:
    """The leaf migration of every app on disk (read once per process: the code of a running
    process does not change). Applying a leaf requires applying everything before it."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    return frozenset(loader.graph.leaf_nodes())


@register
@severity("critical")
def migrations(now: datetime) -> Check:
    """Every migration this code ships with is applied (one indexed read of the recorder)."""
    expected = _expected_migrations()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT app, name FROM django_migrations WHERE (app, name) IN "
            "(SELECT * FROM unnest(%s::text[], %s::text[]))",
            [[a for a, _ in expected], [n for _, n in expected]],
        )
        applied = set(cursor.fetchall())
    missing = sorted(f"{a}.{n}" for a, n in expected - applied)
    if missing:
        return Check("migrations", False, "critical",
                     f"expected every migration applied, found {len(missing)} missing "
                     f"(latest per app: {', '.join(missing)}); run manage.py migrate",
                     value=missing)
    return Check("migrations", True, "critical", f"all applied ({len(expected)} apps)")


def reconcile_backlog_seconds(now: datetime) -> float:
    """How long the operation at the head of the reconcile queue has been due (0 if none).

    Reads the head of the claim order straight from the partial index the claims use.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            f"""SELECT coalesce(next_attempt_at, state_changed_at) FROM ledger_operation
                 WHERE state = '{State.OUTCOME_UNKNOWN}'
                   AND (next_attempt_at IS NULL OR next_attempt_at <= %s)
                 ORDER BY next_attempt_at ASC NULLS FIRST, id LIMIT 1""",
            [now],
        )
        row = cursor.fetchone()
    return max(0.0, (now - row[0]).total_seconds()) if row else 0.0


@register
@severity("warning")
def reconcile_backlog(now: datetime) -> Check:
    """The oldest operation due for reconciliation waits less than the configured limit."""
    limit = timedelta(seconds=conf.HEALTH_RECONCILE_BACKLOG_SECONDS)
    age = reconcile_backlog_seconds(now)
    if age > limit.total_seconds():
        return Check("reconcile_backlog", False, "warning",
                     f"expected the oldest due operation to wait under {limit.total_seconds():.0f}"
                     f" s, found {age:.0f} s: are `manage.py reconcile` workers running?",
                     value=round(age, 3))
    return Check("reconcile_backlog", True, "warning",
                 f"oldest due operation waits {age:.0f} s", value=round(age, 3))


@register
@severity("warning")
def sealer_lag(now: datetime) -> Check:
    """The oldest committed event waits for the sealer less than the configured limit."""
    from ledger import chain

    limit = conf.HEALTH_SEAL_LAG_SECONDS
    lag = chain.seal_lag_seconds(now)
    if lag > limit:
        return Check("sealer_lag", False, "warning",
                     f"expected the oldest unsealed event to wait under {limit:.0f} s, found "
                     f"{lag:.0f} s: is a sealer running (`manage.py seal`, or `manage.py "
                     "reconcile` without --no-seal)?", value=round(lag, 3))
    return Check("sealer_lag", True, "warning",
                 f"oldest unsealed event waits {lag:.1f} s", value=round(lag, 3))
