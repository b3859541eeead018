"""Reads behind the desk's overview charts: how long the waiting items have waited, and how
often each operation's calls ended with an unknown outcome lately.

Both take the acting principal and count only the tenants it may see (`base.visible`);
each is one or two grouped queries, whatever the number of rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Case, CharField, Count, F, IntegerField, Q, Value, When
from django.utils import timezone

from ledger.models import OperationEvent
from ledger.selectors.approvals import visible_awaiting
from ledger.selectors.base import visible
from ledger.selectors.operations import CONFLICTING, QUEUE_STATES, visible_operations
from ledger.states import State

# (key, label, waited at least): the last bucket has no upper bound.
AGE_BUCKETS: tuple[tuple[str, str, timedelta], ...] = (
    ("lt5m", "< 5 min", timedelta(0)),
    ("5m", "5–60 min", timedelta(minutes=5)),
    ("1h", "1–6 h", timedelta(hours=1)),
    ("6h", "6–24 h", timedelta(hours=6)),
    ("1d", "1–7 d", timedelta(days=1)),
    ("7d", "> 7 d", timedelta(days=7)),
)
AWAITING_APPROVAL = "awaiting_approval"
# The kinds of waiting item, in the order charts stack them.
WAITING_KINDS: tuple[str, ...] = (*QUEUE_STATES, CONFLICTING, AWAITING_APPROVAL)
KIND_LABELS = {**{state: State(state).label for state in QUEUE_STATES},
               CONFLICTING: "Conflicting", AWAITING_APPROVAL: "Awaiting approval"}


@dataclass
class AgeDistribution:
    """counts[(kind, bucket key)]: waiting items of that kind that have waited that long.
    An operation both in a queue state and conflicting counts once, as conflicting."""

    now: datetime
    counts: dict[tuple[str, str], int] = field(default_factory=dict)

    def count(self, kind: str, bucket: str) -> int:
        return self.counts.get((kind, bucket), 0)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _bucket_of(column: str, now: datetime) -> Case:
    """The index of the AGE_BUCKETS bucket the time in `column` falls in, in SQL."""
    whens = [When(**{f"{column}__gt": now - AGE_BUCKETS[i + 1][2]}, then=Value(i))
             for i in range(len(AGE_BUCKETS) - 1)]
    return Case(*whens, default=Value(len(AGE_BUCKETS) - 1), output_field=IntegerField())


def queue_age_distribution(user, *, now: datetime | None = None) -> AgeDistribution:
    """How long each waiting item `user` may see has waited, per kind and AGE_BUCKETS: an
    operation since it entered its state, an approval request since it was asked. Two
    grouped queries."""
    now = now or timezone.now()
    waiting = visible_operations(user).filter(Q(state__in=QUEUE_STATES) | Q(conflict__gt=""))
    grouped = (waiting.order_by()
               .annotate(kind=Case(When(conflict__gt="", then=Value(CONFLICTING)),
                                   default=F("state"), output_field=CharField()),
                         bucket=_bucket_of("state_changed_at", now))
               .values_list("kind", "bucket").annotate(n=Count("id")))
    result = AgeDistribution(now=now)
    for kind, bucket, n in grouped:
        result.counts[(kind, AGE_BUCKETS[bucket][0])] = n
    awaiting = (visible_awaiting(user).order_by()
                .annotate(bucket=_bucket_of("requested_at", now))
                .values_list("bucket").annotate(n=Count("id")))
    for bucket, n in awaiting:
        result.counts[(AWAITING_APPROVAL, AGE_BUCKETS[bucket][0])] = n
    return result


@dataclass(frozen=True)
class OperationRate:
    """Calls of one operation name submitted in the window, and how many of those
    submissions ended `outcome_unknown` (a transport failure after sending)."""

    operation: str
    submitted: int
    unknown: int

    @property
    def rate(self) -> float:
        return self.unknown / self.submitted if self.submitted else 0.0


@dataclass
class UnknownOutcomeRates:
    since: datetime
    days: int
    rows: list[OperationRate]
    more: bool  # more operation names than shown


def unknown_outcome_rates(user, *, days: int = 7, limit: int = 20,
                          now: datetime | None = None) -> UnknownOutcomeRates:
    """Per operation name, over the last `days` days: submissions (every move into
    submitted, retries included) and moves submitted -> outcome_unknown among the events
    `user` may see; the `limit` names with the most unknown outcomes first. One grouped
    query over the events' time index."""
    now = now or timezone.now()
    since = now - timedelta(days=days)
    grouped = (visible(user, OperationEvent)
               .filter(created_at__gt=since,
                       to_state__in=(State.SUBMITTED, State.OUTCOME_UNKNOWN))
               .order_by()
               .values_list("operation__operation")
               .annotate(submitted=Count("id", filter=Q(to_state=State.SUBMITTED)),
                         unknown=Count("id", filter=Q(to_state=State.OUTCOME_UNKNOWN,
                                                      from_state=State.SUBMITTED)))
               .order_by("-unknown", "-submitted", "operation__operation"))
    rows = [OperationRate(name, submitted, unknown)
            for name, submitted, unknown in grouped[: limit + 1]]
    return UnknownOutcomeRates(since=since, days=days, rows=rows[:limit],
                               more=len(rows) > limit)
