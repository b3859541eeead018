"""Reads the review desk needs: the queue, one operation, its duplicates, fact conflicts,
overdue obligations, one run, the audit log.

Every function takes the acting `user` and only ever returns rows of tenants that user
may see (`ledger.access.tenants_for`). List reads are keyset-paginated on
(timestamp, id) and run a fixed number of queries whatever the page size; nothing here
counts the whole operations table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import (
    Count,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
)
from django.db.models.functions import Left, Length
from django.utils import timezone

from ledger import access, facts, obligations, states
from ledger.errors import InvalidInput
from ledger.models import (
    Episode,
    Evidence,
    Fact,
    FactConflict,
    Lease,
    Obligation,
    Operation,
    OperationEvent,
    Run,
    Step,
)
from ledger.models.operations import Conflict
from ledger.states import RetryPolicy, State

# The pseudo-state the queue uses for conflicting operations.
CONFLICTING = "conflicting"
# Conflicting operations are counted up to this many (then shown as "100+").
CONFLICT_COUNT_CAP = 100
MAX_PAGE_SIZE = 200


def visible_operations(user) -> QuerySet[Operation]:
    """Operations of the tenants `user` may see (none for a user without grants)."""
    return Operation.objects.for_tenants(access.tenants_for(user))


def _latest_evidence():
    return Evidence.objects.filter(operation=OuterRef("pk")).order_by("-created_at", "-id")


def with_review_flags(qs: QuerySet[Operation]) -> QuerySet[Operation]:
    """Annotate `is_ambiguous`, `is_duplicate` and `latest_verdict` (all in the one query).

    The two flags read `Operation.conflict`, which the reconciler (several matching
    effects, until a person decides) and every move to succeeded (another operation with
    the same fingerprint succeeded too) keep up to date: nothing here scans history.
    """
    return qs.annotate(
        is_ambiguous=Q(conflict=Conflict.AMBIGUOUS),
        is_duplicate=Q(conflict=Conflict.DUPLICATE),
        latest_verdict=Subquery(_latest_evidence().values("verdict")[:1]),
    )


# --- the queue ---------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueFilters:
    """What the reviewer asked for. `state` is a State value, "conflicting" or ""."""

    state: str = ""
    operation: str = ""
    tenant: str = ""
    older_than: timedelta | None = None
    search: str = ""
    oldest_first: bool = False


@dataclass
class Page:
    items: list[Any]
    next_cursor: str = ""
    per_page: int = 50


@dataclass
class QueuePage(Page):
    counts: dict[str, int] = field(default_factory=dict)
    conflicts_capped: bool = False


QUEUE_STATES: tuple[str, ...] = (State.OUTCOME_UNKNOWN, State.MANUAL_REVIEW)


def _filtered(user, filters: QueueFilters, *, now: datetime) -> QuerySet[Operation]:
    """Every filter except the state (the counts per state ignore the state filter)."""
    qs = visible_operations(user)
    if filters.operation:
        qs = qs.filter(operation=filters.operation)
    if filters.tenant:
        qs = qs.filter(tenant=filters.tenant)
    if filters.older_than is not None:
        qs = qs.filter(state_changed_at__lte=now - filters.older_than)
    if filters.search:
        term = filters.search.strip()
        qs = qs.filter(Q(operation_id=term) | Q(external_id=term) | Q(idempotency_key=term))
    return qs


def _conflicting() -> Q:
    return Q(conflict__gt="")


def _in_queue(qs: QuerySet[Operation], state: str, *, searching: bool) -> QuerySet[Operation]:
    if state == CONFLICTING:
        return qs.filter(_conflicting())
    if state:
        return qs.filter(state=state)
    if searching:
        # A search finds the operation whatever its state: reviewers look things up.
        return qs
    return qs.filter(Q(state__in=QUEUE_STATES) | _conflicting())


def review_queue(
    user,
    filters: QueueFilters | None = None,
    *,
    cursor: str = "",
    per_page: int = 50,
    now: datetime | None = None,
) -> QueuePage:
    """One page of the operations waiting on a person, plus counts per queue state.

    Ordered by when the operation entered its state (newest first unless
    `oldest_first`), keyset-paginated: `cursor` is the `next_cursor` of the page before.
    Three queries whatever `per_page`: the page, a grouped count over the indexed
    unresolved states, and a count of conflicting operations capped at
    CONFLICT_COUNT_CAP. Raises InvalidInput for a malformed cursor or page size.
    """
    filters = filters or QueueFilters()
    now = now or timezone.now()
    per_page = _check_per_page(per_page)
    filtered = _filtered(user, filters, now=now)
    flagged = with_review_flags(filtered).select_related("run").defer("intent", "error_detail")
    qs = _in_queue(flagged, filters.state, searching=bool(filters.search))
    qs = _after_cursor(qs, "state_changed_at", cursor, descending=not filters.oldest_first)
    order = ("state_changed_at", "id") if filters.oldest_first else ("-state_changed_at", "-id")
    page = QueuePage(**_paginate(qs.order_by(*order), "state_changed_at", per_page))
    page.counts, page.conflicts_capped = _queue_counts(filtered)
    return page


def _queue_counts(filtered: QuerySet[Operation]) -> tuple[dict[str, int], bool]:
    counts = dict.fromkeys(QUEUE_STATES, 0)
    counts.update(
        filtered.filter(state__in=QUEUE_STATES)
        .order_by()
        .values("state")
        .annotate(n=Count("id"))
        .values_list("state", "n")
    )
    conflicting = (
        with_review_flags(filtered)
        .filter(_conflicting())
        .order_by()
        .values("pk")[: CONFLICT_COUNT_CAP + 1]
        .count()
    )
    counts[CONFLICTING] = min(conflicting, CONFLICT_COUNT_CAP)
    return counts, conflicting > CONFLICT_COUNT_CAP


# --- keyset pagination -------------------------------------------------------------------


def make_cursor(at: datetime, pk: int) -> str:
    """An opaque position: the sort timestamp and the id of the last row shown."""
    return f"{at.isoformat()}~{pk}"


def parse_cursor(cursor: str) -> tuple[datetime, int]:
    stamp, sep, pk = cursor.rpartition("~")
    try:
        if not sep:
            raise ValueError(cursor)
        at = datetime.fromisoformat(stamp)
        if at.tzinfo is None:
            raise ValueError(cursor)
        return at, int(pk)
    except ValueError:
        raise InvalidInput(
            "expected a page cursor like '2026-08-16T01:20:30+00:00~42' (from a 'Next' link), "
            f"found {cursor[:80]!r}"
        ) from None


def _after_cursor(qs: QuerySet, column: str, cursor: str, *, descending: bool) -> QuerySet:
    if not cursor:
        return qs
    at, pk = parse_cursor(cursor)
    if descending:
        return qs.filter(Q(**{f"{column}__lt": at}) | Q(**{column: at, "pk__lt": pk}))
    return qs.filter(Q(**{f"{column}__gt": at}) | Q(**{column: at, "pk__gt": pk}))


def _check_per_page(per_page: int) -> int:
    if not isinstance(per_page, int) or isinstance(per_page, bool) or not (
        1 <= per_page <= MAX_PAGE_SIZE
    ):
        raise InvalidInput(
            f"expected a page size between 1 and {MAX_PAGE_SIZE}, found {per_page!r}"
        )
    return per_page


def _paginate(qs: QuerySet, column: str, per_page: int) -> dict[str, Any]:
    """Fetch one row more than the page to know whether a next page exists (no COUNT)."""
    rows = list(qs[: per_page + 1])
    result: dict[str, Any] = {"items": rows[:per_page], "per_page": per_page}
    if len(rows) > per_page:
        last = rows[per_page - 1]
        result["next_cursor"] = make_cursor(getattr(last, column), last.pk)
    return result


# --- one operation -----------------------------------------------------------------------


@dataclass
class OperationDetail:
    operation: Operation
    events: list[OperationEvent]
    evidence: list[Evidence]
    duplicates: list[Operation]
    resolutions: list[str]


DUPLICATES_SHOWN = 50


def operation_detail(user, operation_id: str) -> OperationDetail:
    """Everything the detail page shows; Operation.DoesNotExist for another tenant's."""
    op = (
        with_review_flags(visible_operations(user))
        .select_related("run", "step")
        .get(operation_id=operation_id)
    )
    return OperationDetail(
        operation=op,
        events=list(op.events.order_by("version")),
        evidence=list(op.evidence.order_by("created_at", "id")),
        duplicates=duplicates_of(op),
        resolutions=resolutions_for(op, user),
    )


def duplicates_of(op: Operation, *, limit: int = DUPLICATES_SHOWN) -> list[Operation]:
    """Other operations with the same (tenant, operation, intent_fingerprint), oldest first."""
    return list(
        Operation.objects.filter(
            tenant=op.tenant, operation=op.operation, intent_fingerprint=op.intent_fingerprint
        )
        .exclude(pk=op.pk)
        .order_by("created_at", "id")[:limit]
    )


def resolutions_for(op: Operation, user) -> list[str]:
    """The decisions `user` may take on `op` now, in the order the desk offers them.

    Legal from the operation's state (`states.resolutions_from`), and allowed for the user:
    `ledger.resolve_operation`, a grant for the tenant, and `ledger.override_retry_policy`
    for safe_to_retry on a `never` operation. `receipts.resolve` checks the same again.
    """
    if not user.has_perm("ledger.resolve_operation") or not access.can_see(user, op.tenant):
        return []
    allowed = states.resolutions_from(op.state)
    if op.retry_policy == RetryPolicy.NEVER and not user.has_perm(
        "ledger.override_retry_policy"
    ):
        allowed = [s for s in allowed if s != State.SAFE_TO_RETRY]
    return allowed


# --- execution state: fact conflicts, overdue obligations, runs --------------------------

# Fact conflicts and overdue obligations are counted up to this many (then "100+").
EXECUTION_COUNT_CAP = 100
# The most rows of each kind the run page shows (operations, obligations, episodes).
RUN_ROWS_SHOWN = 200
# Episodes are shown cut to this many characters (the page never loads a whole transcript).
EPISODE_CHARS_SHOWN = 2000


def _capped_count(qs: QuerySet) -> tuple[int, bool]:
    n = qs.order_by().values("pk")[: EXECUTION_COUNT_CAP + 1].count()
    return min(n, EXECUTION_COUNT_CAP), n > EXECUTION_COUNT_CAP


def conflicts_for(user) -> QuerySet[FactConflict]:
    """Fact conflicts, open or decided, of the tenants `user` may see."""
    return FactConflict.objects.for_tenants(access.tenants_for(user))


def visible_conflicts(user, *, tenant: str = "") -> QuerySet[FactConflict]:
    """Open fact conflicts of the tenants `user` may see (one tenant if `tenant`), oldest
    first, with both sides and their runs loaded."""
    qs = facts.open_conflicts(tenants=access.tenants_for(user))
    return qs.filter(tenant=tenant) if tenant else qs


def visible_overdue(user, *, tenant: str = "", now: datetime | None = None):
    """Open obligations past their deadline, of the tenants `user` may see, most overdue
    first, with their runs loaded."""
    qs = obligations.overdue(tenants=access.tenants_for(user), now=now)
    return qs.filter(tenant=tenant) if tenant else qs


@dataclass(frozen=True)
class ExecutionCounts:
    fact_conflicts: int
    fact_conflicts_capped: bool
    overdue_obligations: int
    overdue_capped: bool


def execution_counts(user, *, tenant: str = "", now: datetime | None = None) -> ExecutionCounts:
    """How many open fact conflicts and overdue obligations wait: two capped counts."""
    conflicts, conflicts_capped = _capped_count(visible_conflicts(user, tenant=tenant))
    overdue, overdue_capped = _capped_count(visible_overdue(user, tenant=tenant, now=now))
    return ExecutionCounts(conflicts, conflicts_capped, overdue, overdue_capped)


def conflict_page(user, *, tenant: str = "", cursor: str = "", per_page: int = 50) -> Page:
    """One keyset page of open fact conflicts, oldest first: one query whatever `per_page`."""
    per_page = _check_per_page(per_page)
    qs = _after_cursor(visible_conflicts(user, tenant=tenant), "created_at", cursor,
                       descending=False)
    return Page(**_paginate(qs, "created_at", per_page))


def overdue_page(user, *, tenant: str = "", cursor: str = "", per_page: int = 50,
                 now: datetime | None = None) -> Page:
    """One keyset page of overdue obligations, most overdue first: one query."""
    per_page = _check_per_page(per_page)
    qs = _after_cursor(visible_overdue(user, tenant=tenant, now=now), "deadline", cursor,
                       descending=False)
    return Page(**_paginate(qs, "deadline", per_page))


@dataclass
class ConflictDetail:
    """A conflict, and the version that is current now (newer than `conflict.current`
    when the fact moved on since the conflict opened; None never, a conflict has one)."""

    conflict: FactConflict
    live: Fact | None
    can_decide: bool

    @property
    def moved_on(self) -> bool:
        return self.live is not None and self.live.pk != self.conflict.current_id


def conflict_detail(user, conflict_id: int) -> ConflictDetail:
    """Everything the conflict page shows, in two queries; FactConflict.DoesNotExist for
    another tenant's. `can_decide`: open, and `user` holds `ledger.resolve_factconflict`
    (`facts.resolve_conflict` checks the same again)."""
    conflict = (
        conflicts_for(user)
        .select_related("current", "candidate", "current__run", "candidate__run",
                        "resolved_by", "resolved_fact")
        .get(pk=conflict_id)
    )
    live = (
        Fact.objects.current()
        .filter(tenant=conflict.tenant, subject=conflict.subject, predicate=conflict.predicate)
        .select_related("run").first()
    )
    can_decide = conflict.is_open and user.has_perm("ledger.resolve_factconflict")
    return ConflictDetail(conflict=conflict, live=live, can_decide=can_decide)


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


def run_detail(user, run_id: str) -> RunDetail:
    """The run `run_id` with its steps (and dependencies), operations, obligations, the
    current facts it wrote (with provenance), its open conflicts, its latest episodes and
    its lease: ten queries whatever the run holds (each list capped at RUN_ROWS_SHOWN).
    Run.DoesNotExist for a run of a tenant `user` may not see."""
    tenants = access.tenants_for(user)
    runs = Run.objects.all() if tenants is None else Run.objects.filter(tenant__in=tenants)
    run = runs.get(run_id=run_id)
    episodes = (
        Episode.objects.filter(run=run)
        .annotate(excerpt=Left("content", EPISODE_CHARS_SHOWN), length=Length("content"))
        .defer("content").order_by("-created_at", "-id")[:RUN_ROWS_SHOWN]
    )
    return RunDetail(
        run=run,
        lease=Lease.objects.filter(resource=run.lease_resource).first(),
        steps=list(Step.objects.filter(run=run).prefetch_related("depends_on").order_by("id")),
        operations=list(
            Operation.objects.filter(run=run).select_related("step")
            .defer("intent", "error_detail").order_by("created_at", "id")[:RUN_ROWS_SHOWN]
        ),
        obligations=list(Obligation.objects.filter(run=run)
                         .order_by("created_at", "id")[:RUN_ROWS_SHOWN]),
        facts=facts.facts_of_run(run),
        open_conflicts=list(
            FactConflict.objects.open().filter(candidate__run=run)
            .select_related("current", "candidate").order_by("created_at", "id")[:RUN_ROWS_SHOWN]
        ),
        episodes=list(reversed(list(episodes))),
    )


# --- the audit log -----------------------------------------------------------------------


@dataclass(frozen=True)
class AuditFilters:
    actor: str = ""
    operation: str = ""
    state: str = ""
    since: datetime | None = None
    until: datetime | None = None


def audit_events(user, filters: AuditFilters | None = None) -> QuerySet[OperationEvent]:
    """Every transition of the tenants `user` may see, newest first, filtered.

    `operation` matches an operation id or an operation name; `state` the state moved
    to; `since` inclusive, `until` exclusive.
    """
    filters = filters or AuditFilters()
    tenants = access.tenants_for(user)
    qs = OperationEvent.objects.select_related("operation")
    if tenants is not None:
        qs = qs.filter(tenant__in=tenants)
    if filters.actor:
        qs = qs.filter(actor_id=filters.actor)
    if filters.operation:
        qs = qs.filter(
            Q(operation__operation_id=filters.operation)
            | Q(operation__operation=filters.operation)
        )
    if filters.state:
        qs = qs.filter(to_state=filters.state)
    if filters.since is not None:
        qs = qs.filter(created_at__gte=filters.since)
    if filters.until is not None:
        qs = qs.filter(created_at__lt=filters.until)
    return qs.order_by("-created_at", "-id")


def audit_page(
    user, filters: AuditFilters | None = None, *, cursor: str = "", per_page: int = 50
) -> Page:
    """One keyset page of `audit_events`: one query whatever `per_page`."""
    per_page = _check_per_page(per_page)
    qs = _after_cursor(audit_events(user, filters), "created_at", cursor, descending=True)
    return Page(**_paginate(qs, "created_at", per_page))


def iter_audit_events(user, filters: AuditFilters | None = None, *, batch: int = 500):
    """Every matching event, newest first, fetched in keyset batches (for CSV export)."""
    cursor = ""
    while True:
        qs = _after_cursor(audit_events(user, filters), "created_at", cursor, descending=True)
        rows = list(qs[:batch])
        yield from rows
        if len(rows) < batch:
            return
        cursor = make_cursor(rows[-1].created_at, rows[-1].pk)
