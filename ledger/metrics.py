"""Prometheus metrics of the ledger, read from the database at each scrape (`/metrics`).

Every web process answers for the whole deployment, so the metrics are gauges computed
from PostgreSQL, not counters kept in one process's memory. A collector is a function
`collector(now) -> Iterable[Metric]`; `COLLECTORS` lists them and `@register` adds one
(a later component, e.g. notifications or an audit sealer, registers its own). Each runs
a fixed number of index-backed queries; none counts the operations or events table as a
whole (the test pins the query count of a scrape):

- `ledger_operations{tenant,state}`: operations per tenant in each *non-terminal* state
  (the partial states are small and indexed); terminal states grow without bound, so the
  table's size comes as one planner estimate, `ledger_operations_estimated_rows`.
- `ledger_oldest_waiting_seconds{queue}`: age of the oldest item waiting in each desk
  queue (outcome_unknown, manual_review, open fact conflicts, overdue obligations).
- `ledger_outcome_unknown_ratio{tenant}` over the last `WINDOW`: transitions into
  outcome_unknown / transitions into submitted (the share of sends with no known outcome),
  and the two counts behind it.
- `ledger_reconcile_backlog_seconds` / `ledger_reconcile_due_operations`: how long the head
  of the reconcile queue has been due, and how many are due.
- `ledger_sealer_lag_seconds{tenant}` / `ledger_unsealed_events{tenant}` /
  `ledger_sealer_max_lag_seconds`: how far the audit chain trails the committed events
  (`ledger.chain.unsealed`, over the partial index of unsealed events).
- `ledger_reconciler_blind{tenant,operation,target}` (1: a reader found nothing and could
  not find its positive control either, in the last `WINDOW`),
  `ledger_reconciler_blind_readings{tenant,operation,target,control}` (those readings,
  `control` "not_seen" or "none": no control yet and no declared trusted absence) and
  `ledger_unproven_blind_operations{tenant,operation,target}` (waiting operations whose last
  reading was blind): `ledger.reconcile.check_absence`, over the partial index of blind
  evidence and the waiting states, in one query.
- `ledger_unexplained_effects{tenant,operation,target}`: the effects no receipt explains,
  as the latest coverage reading (`ledger.coverage`) of each name and account found them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

from django.db import connection
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from ledger import health
from ledger.states import QUEUE_STATES, TERMINAL, State

WINDOW = timedelta(minutes=5)
WAITING_STATES = [s for s in State.values if s not in TERMINAL]

MetricCollector = Callable[[datetime], Iterable[Metric]]
COLLECTORS: list[MetricCollector] = []


def register(collector: MetricCollector) -> MetricCollector:
    """Add `collector(now) -> metrics` to every later scrape; usable as a decorator."""
    if collector not in COLLECTORS:
        COLLECTORS.append(collector)
    return collector


class _LedgerCollector:
    """Adapts `COLLECTORS` to prometheus-client's collector protocol for one scrape."""

    def __init__(self, now: datetime):
        self.now = now

    def collect(self) -> Iterable[Metric]:
        for collector in COLLECTORS:
            yield from collector(self.now)


def render(*, now: datetime | None = None,
           encoder: Callable[[CollectorRegistry], bytes] = generate_latest) -> bytes:
    """Every registered collector, read now, in Prometheus' text format (or `encoder`'s)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_LedgerCollector(now or timezone.now()))
    return encoder(registry)


def _rows(sql: str, params: list | None = None) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params or [])
        return cursor.fetchall()


# --- the collectors --------------------------------------------------------------------------


@register
def operations_by_state(now: datetime) -> Iterable[Metric]:
    by_state = GaugeMetricFamily(
        "ledger_operations", "Operations per tenant in each non-terminal state",
        labels=["tenant", "state"])
    for tenant, state, count in _rows(
        "SELECT tenant, state, count(*) FROM ledger_operation WHERE state = ANY(%s)"
        " GROUP BY tenant, state ORDER BY tenant, state", [WAITING_STATES]):
        by_state.add_metric([tenant, state], count)
    yield by_state
    estimate = _rows("SELECT greatest(reltuples, 0)::bigint FROM pg_class"
                     " WHERE oid = 'ledger_operation'::regclass")
    yield GaugeMetricFamily(
        "ledger_operations_estimated_rows",
        "Operations in every state, the planner's estimate (updated by autovacuum/analyze)",
        value=estimate[0][0] if estimate else 0)


@register
def oldest_waiting(now: datetime) -> Iterable[Metric]:
    family = GaugeMetricFamily(
        "ledger_oldest_waiting_seconds",
        "Age of the oldest item waiting in each desk queue (0 when the queue is empty)",
        labels=["queue"])
    # One column per queue state of the desk (states.QUEUE_STATES), then the two others.
    per_state = "".join("(SELECT min(state_changed_at) FROM ledger_operation"
                        " WHERE state = %s), " for _ in QUEUE_STATES)
    (*oldest, conflict, overdue), = _rows(
        f"""SELECT {per_state}
              (SELECT min(created_at) FROM ledger_factconflict WHERE state = 'open'),
              (SELECT min(deadline) FROM ledger_obligation
                WHERE state = 'open' AND deadline < %s)""", [*QUEUE_STATES, now])
    for queue, since in (*zip(QUEUE_STATES, oldest, strict=True),
                         ("fact_conflict", conflict), ("overdue_obligation", overdue)):
        family.add_metric([queue], max(0.0, (now - since).total_seconds()) if since else 0.0)
    yield family


@register
def outcome_unknown_rate(now: datetime) -> Iterable[Metric]:
    window = int(WINDOW.total_seconds())
    ratio = GaugeMetricFamily(
        "ledger_outcome_unknown_ratio",
        f"Transitions into outcome_unknown / into submitted over the last {window} s",
        labels=["tenant"])
    unknown = GaugeMetricFamily(
        "ledger_outcome_unknown_recent", f"Transitions into outcome_unknown in the last {window} s",
        labels=["tenant"])
    submitted = GaugeMetricFamily(
        "ledger_submitted_recent", f"Transitions into submitted in the last {window} s",
        labels=["tenant"])
    for tenant, n_submitted, n_unknown in _rows(
        f"""SELECT tenant, count(*) FILTER (WHERE to_state = '{State.SUBMITTED}'),
                   count(*) FILTER (WHERE to_state = '{State.OUTCOME_UNKNOWN}')
              FROM ledger_operationevent
             WHERE created_at > %s AND to_state IN ('{State.SUBMITTED}', '{State.OUTCOME_UNKNOWN}')
             GROUP BY tenant ORDER BY tenant""", [now - WINDOW]):
        submitted.add_metric([tenant], n_submitted)
        unknown.add_metric([tenant], n_unknown)
        ratio.add_metric([tenant], n_unknown / n_submitted if n_submitted else 0.0)
    yield from (ratio, unknown, submitted)


@register
def reconcile_lag(now: datetime) -> Iterable[Metric]:
    yield GaugeMetricFamily(
        "ledger_reconcile_backlog_seconds",
        "How long the operation at the head of the reconcile queue has been due",
        value=health.reconcile_backlog_seconds(now))
    due = _rows(f"""SELECT count(*) FROM ledger_operation
                     WHERE state = '{State.OUTCOME_UNKNOWN}'
                       AND (next_attempt_at IS NULL OR next_attempt_at <= %s)""", [now])
    yield GaugeMetricFamily("ledger_reconcile_due_operations",
                            "outcome_unknown operations due for reconciliation now",
                            value=due[0][0])


@register
def sealer_lag(now: datetime) -> Iterable[Metric]:
    from ledger import chain

    tails = chain.unsealed()
    lag = GaugeMetricFamily("ledger_sealer_lag_seconds",
                            "How long the oldest committed, unsealed operation event has "
                            "waited for the sealer, per tenant", labels=["tenant"])
    count = GaugeMetricFamily("ledger_unsealed_events",
                              "Committed operation events the sealer has not linked yet",
                              labels=["tenant"])
    for tail in tails:
        lag.add_metric([tail.tenant], tail.age_seconds(now))
        count.add_metric([tail.tenant], tail.events)
    yield lag
    yield count
    yield GaugeMetricFamily("ledger_sealer_max_lag_seconds",
                            "The sealer lag of the tenant furthest behind (0 when none)",
                            value=max((tail.age_seconds(now) for tail in tails), default=0.0))


# Waiting states in which an operation's last reading may have been blind.
_UNPROVEN_STATES = [State.OUTCOME_UNKNOWN, State.RECONCILING, State.MANUAL_REVIEW]


@register
def blind_verifiers(now: datetime) -> Iterable[Metric]:
    window = int(WINDOW.total_seconds())
    blind = GaugeMetricFamily(
        "ledger_reconciler_blind",
        f"1 when, in the last {window} s, a reconciler found nothing for an operation and "
        "could not find its positive control either: its not-found proves nothing",
        labels=["tenant", "operation", "target"])
    readings = GaugeMetricFamily(
        "ledger_reconciler_blind_readings",
        f"Readings in the last {window} s whose not-found was not backed by a positive "
        "control (control: not_seen, the control was not found; none, no control yet and "
        "no declared trusted absence)", labels=["tenant", "operation", "target", "control"])
    waiting = GaugeMetricFamily(
        "ledger_unproven_blind_operations",
        "Waiting operations (outcome_unknown, reconciling, manual_review) whose last "
        "reading was blind", labels=["tenant", "operation", "target"])
    shown_blind = set()
    for kind, tenant, operation, target, control, count in _rows(
        """SELECT 'recent', o.tenant, o.operation, o.target,
                  coalesce(e.observed -> 'positive_control' ->> 'status', ''), count(*)
             FROM ledger_evidence e JOIN ledger_operation o ON o.id = e.operation_id
            WHERE e.verdict = 'verifier_blind' AND e.created_at > %s
            GROUP BY 2, 3, 4, 5
           UNION ALL
           SELECT 'waiting', o.tenant, o.operation, o.target, '', count(*)
             FROM ledger_operation o
             CROSS JOIN LATERAL (SELECT e.verdict FROM ledger_evidence e
                                  WHERE e.operation_id = o.id
                                  ORDER BY e.created_at DESC, e.id DESC LIMIT 1) last
            WHERE o.state = ANY(%s) AND last.verdict = 'verifier_blind'
            GROUP BY 2, 3, 4
            ORDER BY 1, 2, 3, 4, 5""", [now - WINDOW, _UNPROVEN_STATES]):
        if kind == "waiting":
            waiting.add_metric([tenant, operation, target], count)
            continue
        readings.add_metric([tenant, operation, target, control], count)
        if control == "not_seen" and (tenant, operation, target) not in shown_blind:
            shown_blind.add((tenant, operation, target))
            blind.add_metric([tenant, operation, target], 1)
    yield from (blind, readings, waiting)


@register
def unexplained_effects(now: datetime) -> Iterable[Metric]:
    family = GaugeMetricFamily(
        "ledger_unexplained_effects",
        "Effects at a target that no receipt explains, as the latest coverage reading of each "
        "operation name and account there found them (manage.py coverage)",
        labels=["tenant", "operation", "target"])
    for tenant, operation, target, count in _rows(
        """SELECT tenant, operation, target, sum(unexplained_count)
             FROM (SELECT DISTINCT ON (tenant, operation, target, account)
                          tenant, operation, target, unexplained_count
                     FROM ledger_coveragereading
                    ORDER BY tenant, operation, target, account, created_at DESC, id DESC
                  ) latest
            GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"""):
        family.add_metric([tenant, operation, target], count)
    yield family
