"""Reads of runs and what they hold: a run's records (the one builder behind both the
hand-off view `runs.resume` returns and the desk's run page), overdue obligations, and the
counts of execution state waiting on a person.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import QuerySet
from django.db.models.functions import Left, Length
from django.utils import timezone

from ledger import access, states
from ledger.inputs import check_identifier
from ledger.models import (
    Episode,
    Fact,
    FactConflict,
    Lease,
    Obligation,
    Operation,
    Run,
    Step,
)
from ledger.selectors.base import capped_count, fetch_one, lookup_id, visible
from ledger.selectors.facts import facts_of_run, visible_conflicts
from ledger.selectors.pagination import Page, keyset_page

# Fact conflicts and overdue obligations are counted up to this many (then "100+").
EXECUTION_COUNT_CAP = 100
# The most rows of each kind the run page shows (operations, obligations, episodes).
RUN_ROWS_SHOWN = 200
# Episodes are shown cut to this many characters (the page never loads a whole transcript).
EPISODE_CHARS_SHOWN = 2000


# --- one run -----------------------------------------------------------------------------


def access_run(user, run_id: str, *, tenant: str | None = None) -> Run:
    """The run `run_id` of the tenants `user` (a person or an agent key) may see (of
    `tenant` alone, when given); errors.NotFound otherwise, and for anything but an id of 1
    to 100 characters; InvalidInput for an id the input gate refuses, and for an id that
    names runs of several of those tenants (run ids are unique per tenant). One query."""
    lookup_id(run_id, what="a run id", name="run_id", max_length=100)
    return fetch_one(_of(visible(user, Run), tenant), f"run {run_id!r}", run_id=run_id)


def access_obligation(user, key: str, *, tenant: str | None = None) -> Obligation:
    """The obligation `key` of the tenants `user` (a person or an agent key) may see (of
    `tenant` alone, when given); errors.NotFound otherwise, and for anything but a key of 1
    to 200 characters; InvalidInput for a key the input gate refuses, and for a key that
    names obligations of several of those tenants (keys are unique per tenant). One query."""
    lookup_id(key, what="an obligation key", name="obligation_key", max_length=200)
    return fetch_one(_of(visible(user, Obligation), tenant), f"obligation {key!r}", key=key)


def _of(qs, tenant: str | None):
    return qs if tenant is None else qs.filter(tenant=check_identifier(tenant, "tenant", 100))


@dataclass(frozen=True)
class RunRecords:
    """A run's records as its tables hold them: steps (with their dependencies loaded),
    operations, obligations, the current facts it wrote and the conflicts its writes
    opened that no person has decided."""

    steps: list[Step]
    operations: list[Operation]
    obligations: list[Obligation]
    facts: list[Fact]
    open_conflicts: list[FactConflict]


def run_records(run: Run, *, open_only: bool = False, limit: int | None = None) -> RunRecords:
    """The records of `run`, in six queries whatever it holds.

    `open_only`: only the operations that are not terminal and the obligations still open
    (what a worker taking the run over must finish). `limit`: each list cut to that many
    rows, and the operations' payloads (intent, error detail) left unloaded (for pages).
    """
    operations = Operation.objects.filter(run=run).select_related("step")
    obligations = Obligation.objects.filter(run=run)
    if open_only:
        operations = operations.exclude(state__in=states.TERMINAL)
        obligations = obligations.pending()
    if limit is not None:
        operations = operations.defer("intent", "error_detail")
    conflicts = (
        FactConflict.objects.open().filter(candidate__run=run)
        .select_related("current", "candidate")
    )
    return RunRecords(
        steps=list(Step.objects.filter(run=run).prefetch_related("depends_on").order_by("id")),
        operations=_first(operations.order_by("created_at", "id"), limit),
        obligations=_first(obligations.order_by("created_at", "id"), limit),
        facts=facts_of_run(run),
        open_conflicts=_first(conflicts.order_by("created_at", "id"), limit),
    )


def _first(qs: QuerySet, limit: int | None) -> list:
    return list(qs if limit is None else qs[:limit])


@dataclass
class RunDetail:
    """What the run page shows: the run's records, and its lease as the table holds it."""

    run: Run
    lease: Lease | None
    steps: list[Step]
    operations: list[Operation]
    obligations: list[Obligation]
    facts: list[Fact]
    open_conflicts: list[FactConflict]
    episodes: list[Episode]
    rows_shown: int = RUN_ROWS_SHOWN

    @property
    def lease_is_live(self) -> bool:
        return self.lease is not None and self.lease.expires_at > timezone.now()


def run_detail(user, run_id: str, *, tenant: str | None = None) -> RunDetail:
    """The run `run_id` with its steps (and dependencies), operations, obligations, the
    current facts it wrote (with provenance), its open conflicts, its latest episodes and
    its lease: nine queries whatever the run holds (each list capped at RUN_ROWS_SHOWN).
    errors.NotFound for a run of a tenant `user` may not see (or not of `tenant`, given)."""
    run = access_run(user, run_id, tenant=tenant)
    lease = Lease.objects.filter(resource=run.lease_resource).first()
    records = run_records(run, limit=RUN_ROWS_SHOWN)
    episodes = (
        Episode.objects.filter(run=run)
        .annotate(excerpt=Left("content", EPISODE_CHARS_SHOWN), length=Length("content"))
        .defer("content").order_by("-created_at", "-id")[:RUN_ROWS_SHOWN]
    )
    return RunDetail(
        run=run, lease=lease, steps=records.steps, operations=records.operations,
        obligations=records.obligations, facts=records.facts,
        open_conflicts=records.open_conflicts, episodes=list(reversed(list(episodes))),
    )


# --- obligations -------------------------------------------------------------------------


def overdue_obligations(*, tenants=None, now: datetime | None = None) -> QuerySet[Obligation]:
    """Open obligations past their deadline, of the given tenants (None: every tenant),
    most overdue first, with their runs loaded."""
    return (
        Obligation.objects.overdue(now).for_tenants(tenants)
        .select_related("run").order_by("deadline", "id")
    )


def visible_overdue(user, *, tenant: str = "", now: datetime | None = None):
    """Open obligations past their deadline, of the tenants `user` may see, most overdue
    first, with their runs loaded."""
    qs = overdue_obligations(tenants=access.tenants_for(user), now=now)
    return qs.filter(tenant=tenant) if tenant else qs


def overdue_page(user, *, tenant: str = "", cursor: str = "", per_page: int = 50,
                 now: datetime | None = None) -> Page:
    """One keyset page of overdue obligations, most overdue first: one query."""
    return Page(**keyset_page(visible_overdue(user, tenant=tenant, now=now), "deadline",
                              cursor=cursor, per_page=per_page, descending=False))


# --- what waits on a person --------------------------------------------------------------


@dataclass(frozen=True)
class ExecutionCounts:
    fact_conflicts: int
    fact_conflicts_capped: bool
    overdue_obligations: int
    overdue_capped: bool


def execution_counts(user, *, tenant: str = "", now: datetime | None = None) -> ExecutionCounts:
    """How many open fact conflicts and overdue obligations wait: two capped counts."""
    conflicts, conflicts_capped = capped_count(visible_conflicts(user, tenant=tenant),
                                               EXECUTION_COUNT_CAP)
    overdue, overdue_capped = capped_count(visible_overdue(user, tenant=tenant, now=now),
                                           EXECUTION_COUNT_CAP)
    return ExecutionCounts(conflicts, conflicts_capped, overdue, overdue_capped)
