"""Reads of operations: the queue, one operation with its timeline and duplicates.

Every function takes the acting principal (`user`) and only ever returns operations of
tenants it may see (`base.visible`). The queue is keyset-paginated on (state_changed_at, id)
and runs a fixed number of queries whatever the page size; nothing here counts the whole
operations table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import connection
from django.db.models import Count, OuterRef, Q, QuerySet, Subquery
from django.utils import timezone

from ledger import access, rows, states
from ledger.errors import NotFound
from ledger.models import (
    Claim,
    Evidence,
    Fact,
    Operation,
    OperationEvent,
    OperationNote,
    OperationSearch,
    ResolutionProposal,
)
from ledger.models.operations import Conflict
from ledger.prepared import prepared_cursor
from ledger.selectors.approvals import (
    APPROVAL_STATUS_SQL,
    APPROVAL_STATUS_WIDTH,
    ApprovalStatus,
    approval_status_from_row,
)
from ledger.selectors.base import fetch_one, lookup_id, visible
from ledger.selectors.pagination import Page, check_per_page, key_page, keyset_page
from ledger.states import RetryPolicy, State

# The pseudo-state the queue uses for conflicting operations.
CONFLICTING = "conflicting"
# Conflicting operations are counted up to this many (then shown as "100+").
CONFLICT_COUNT_CAP = 100


def visible_operations(user) -> QuerySet[Operation]:
    """Operations of the tenants `user` may see (none for a user without grants)."""
    return visible(user, Operation)


_ACCESS_OPERATION = (
    f"SELECT {rows.OPERATION_COLUMNS} FROM {Operation._meta.db_table}"
    " WHERE operation_id = %s AND (%s OR tenant = ANY(%s))"
)


def access_operation(user, operation_id: str) -> Operation:
    """The operation `operation_id` if `user` (a person or an agent key) may see its
    tenant; errors.NotFound otherwise (another tenant's operation is reported exactly like
    a missing one, and so is anything but an id of 1 to 40 characters); InvalidInput for
    an id the input gate refuses.

    One prepared statement, without the ORM's query compilation (every mark of every agent
    comes through here), or none when the principal's authentication already read it
    (`remember_read`).
    """
    lookup_id(operation_id, what="an operation id", name="operation_id", max_length=40)
    read = getattr(user, "_operation_read", None)
    if read is not None:
        user._operation_read = None  # used once, by the request it was made for
    if read is not None and read[0] == operation_id:
        found = read[1]
    else:
        tenants = access.tenants_for(user)
        with prepared_cursor() as cursor:
            cursor.execute(_ACCESS_OPERATION,
                           [operation_id, tenants is None, sorted(tenants or ())])
            row = cursor.fetchone()
        found = None if row is None else rows.operation_from_row(row)
    if found is None:
        raise NotFound(
            f"expected operation {operation_id!r} among the tenants you may see, found none"
        )
    return found


@dataclass(frozen=True)
class OperationReceipt:
    """One operation as an agent reads it back: the receipt, its events (oldest first),
    its evidence and its approval status."""

    operation: Operation
    events: list[OperationEvent]
    evidence: list[Evidence]
    approval: ApprovalStatus


_EVENT_ROWS = rows.ModelRows(OperationEvent)
_EVIDENCE_ROWS = rows.ModelRows(Evidence)


def _receipt_sql() -> str:
    """The approval status, the events and the evidence of one operation in one statement:
    a UNION ALL whose rows are tagged by kind (0: `approval_status`'s row, as its own
    statement reads it; 1: an event; 2: evidence), each kind's columns in a block of their
    own and NULL elsewhere. Every column keeps its table's type, so psycopg decodes each
    value as it does for the ORM (no JSON round trip turning times into text). Ordered by
    kind, the events by version, the evidence by (created_at, id). Its parameters: the
    operation's pk, four times.

    PostgreSQL types a UNION's columns pair by pair from the left, and two bare NULLs make
    text: the approval status comes first, so its NULLs elsewhere take its types; a model's
    NULLs are cast to its columns' types."""

    def nulls(model_rows: rows.ModelRows) -> str:
        return ", ".join(f"NULL::{f.db_type(connection)}" for f in model_rows.fields)

    def columns(model_rows: rows.ModelRows, alias: str) -> str:
        return ", ".join(f"{alias}.{connection.ops.quote_name(f.column)}"
                         for f in model_rows.fields)

    status_nulls = ", ".join(["NULL"] * APPROVAL_STATUS_WIDTH)
    # 1-based positions of the sort keys in the combined row (the kind is column 1).
    events_at = 2 + APPROVAL_STATUS_WIDTH
    evidence_at = events_at + len(_EVENT_ROWS.fields)
    version = events_at + _EVENT_ROWS.fields.index(OperationEvent._meta.get_field("version"))
    created_at = evidence_at + _EVIDENCE_ROWS.fields.index(
        Evidence._meta.get_field("created_at"))
    evidence_id = evidence_at + _EVIDENCE_ROWS.fields.index(Evidence._meta.pk)
    return f"""
SELECT 0, s.*, {nulls(_EVENT_ROWS)}, {nulls(_EVIDENCE_ROWS)}
  FROM ({APPROVAL_STATUS_SQL}) s
UNION ALL
SELECT 1, {status_nulls}, {columns(_EVENT_ROWS, "e")}, {nulls(_EVIDENCE_ROWS)}
  FROM {_EVENT_ROWS.table} e WHERE e.{_EVENT_ROWS.column("operation")} = %s
UNION ALL
SELECT 2, {status_nulls}, {nulls(_EVENT_ROWS)}, {columns(_EVIDENCE_ROWS, "v")}
  FROM {_EVIDENCE_ROWS.table} v WHERE v.{_EVIDENCE_ROWS.column("operation")} = %s
ORDER BY 1, {version}, {created_at}, {evidence_id}
"""


_RECEIPT = _receipt_sql()
_EVENTS_AT = 1 + APPROVAL_STATUS_WIDTH
_EVIDENCE_AT = _EVENTS_AT + len(_EVENT_ROWS.fields)


def operation_receipt(user, operation_id: str) -> OperationReceipt:
    """The operation `operation_id` with its events, evidence and approval status (as
    `access_operation` fetches and checks it): one query after that look-up, a prepared
    statement written out once (an agent polls this), without the ORM's query compilation.
    Its approval status is `approval_status`'s, read by the same SQL; the events and the
    evidence are the instances the ORM would make, in the same order."""
    op = access_operation(user, operation_id)
    with prepared_cursor() as cursor:
        cursor.execute(_RECEIPT, [op.pk, op.pk, op.pk, op.pk])
        found = cursor.fetchall()
    status_row = found[0][1:] if found and found[0][0] == 0 else None
    status = approval_status_from_row(op, status_row)
    events = [_EVENT_ROWS.instance(row[_EVENTS_AT:]) for row in found if row[0] == 1]
    evidence = [_EVIDENCE_ROWS.instance(row[_EVIDENCE_AT:]) for row in found if row[0] == 2]
    return OperationReceipt(operation=op, approval=status, events=events, evidence=evidence)


def remember_read(principal, operation_id: str, found: Operation | None) -> None:
    """Leave what a read made along with `principal`'s authentication found for
    `operation_id` (None: nothing it may see) to the next `access_operation` of that id by
    that principal, which answers from it once instead of asking again."""
    principal._operation_read = (operation_id, found)


def operations_page(
    user,
    *,
    state: str | None = None,
    operation: str | None = None,
    tenant: str | None = None,
    idempotency_key: str | None = None,
    account: str | None = None,
    cursor: str = "",
    per_page: int = 50,
) -> Page:
    """Operations of the tenants `user` may see, newest first, filtered, keyset-paged on
    the operation id (`next_cursor` is the last id shown, "" on the last page), with their
    run and step loaded: one query per page. `idempotency_key` (with `operation`): a call's
    receipt, looked up without recording anything."""
    qs = visible_operations(user).select_related("run", "step")
    if tenant is not None:
        qs = qs.filter(tenant=tenant)
    if idempotency_key is not None:
        qs = qs.filter(idempotency_key=idempotency_key)
    if state is not None:
        qs = qs.filter(state=state)
    if operation is not None:
        qs = qs.filter(operation=operation)
    if account is not None:
        qs = qs.filter(account=account)
    return Page(**key_page(qs, "operation_id", cursor=cursor, per_page=per_page,
                           descending=True))


def _latest_evidence():
    return Evidence.objects.filter(operation=OuterRef("pk")).order_by("-created_at", "-id")


def with_claims(qs: QuerySet[Operation], *, now: datetime) -> QuerySet[Operation]:
    """Annotate `claimed_by_name`, `claimed_by_user` (the user's id) and `claim_expires_at`:
    the live claim ("Ada is looking at this", `ledger.claims`) on each operation, or None;
    in the same query."""
    live = Claim.objects.filter(operation=OuterRef("pk"), expires_at__gt=now)
    return qs.annotate(
        claimed_by_name=Subquery(live.values("claimed_by_name")[:1]),
        claimed_by_user=Subquery(live.values("claimed_by_id")[:1]),
        claim_expires_at=Subquery(live.values("expires_at")[:1]),
    )


def _pending_proposal():
    """The latest proposal of an operation's current version (the two-person rule)."""
    return (ResolutionProposal.objects
            .filter(operation=OuterRef("pk"), version=OuterRef("version"))
            .order_by("-created_at", "-id"))


def with_review_flags(qs: QuerySet[Operation]) -> QuerySet[Operation]:
    """Annotate `is_ambiguous`, `is_duplicate`, `latest_verdict` and the pending proposal
    of the two-person rule, `proposed_to_state` and `proposed_by_name` (all in the one
    query).

    The two flags read `Operation.conflict`, which the reconciler (several matching
    effects, until a person decides) and every move to succeeded (another operation with
    the same fingerprint succeeded too) keep up to date: nothing here scans history.
    """
    return qs.annotate(
        is_ambiguous=Q(conflict=Conflict.AMBIGUOUS),
        is_duplicate=Q(conflict=Conflict.DUPLICATE),
        latest_verdict=Subquery(_latest_evidence().values("verdict")[:1]),
        proposed_to_state=Subquery(_pending_proposal().values("to_state")[:1]),
        proposed_by_name=Subquery(_pending_proposal().values("proposed_by_name")[:1]),
    )


# --- the queue ---------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueFilters:
    """What the reviewer asked for. `state` is a State value, "conflicting" or ""."""

    state: str = ""
    operation: str = ""
    tenant: str = ""
    # The provider account the calls acted as (Operation.account).
    account: str = ""
    older_than: timedelta | None = None
    search: str = ""
    oldest_first: bool = False


@dataclass
class QueuePage(Page):
    counts: dict[str, int] = field(default_factory=dict)
    conflicts_capped: bool = False
    # Everything waiting on a person ("All waiting"): the queue states plus conflicting
    # operations in other states; `total_capped` when the conflicting part was capped.
    total: int = 0
    total_capped: bool = False


QUEUE_STATES: tuple[str, ...] = states.QUEUE_STATES


def _filtered(user, filters: QueueFilters, *, now: datetime) -> QuerySet[Operation]:
    """Every filter except the state (the counts per state ignore the state filter)."""
    qs = visible_operations(user)
    if filters.operation:
        qs = qs.filter(operation=filters.operation)
    if filters.tenant:
        qs = qs.filter(tenant=filters.tenant)
    if filters.account:
        qs = qs.filter(account=filters.account)
    if filters.older_than is not None:
        qs = qs.filter(state_changed_at__lte=now - filters.older_than)
    if filters.search:
        qs = qs.filter(_search(filters.search.strip()))
    return qs


# A fragment this long or longer is searched inside ids, keys and external ids (the rows
# of OperationSearch beside each operation, their trigram GIN index
# operation_search_text_idx); a shorter one must be a whole value (pg_trgm cannot index
# fewer than three characters).
SEARCH_MIN_FRAGMENT = 3


def _search(term: str) -> Q:
    """Operations whose id, idempotency key or external id contains `term` (or equals it,
    for a term shorter than SEARCH_MIN_FRAGMENT). Case-sensitive, as the values are. A
    subquery of the page's own query: the search adds no query."""
    if len(term) < SEARCH_MIN_FRAGMENT or "\x1f" in term:
        return Q(operation_id=term) | Q(external_id=term) | Q(idempotency_key=term)
    return Q(pk__in=OperationSearch.objects.filter(text__contains=term).values("operation_id"))


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
    before: str = "",
    per_page: int = 50,
    now: datetime | None = None,
) -> QueuePage:
    """One page of the operations waiting on a person, plus counts per queue state.

    Ordered by when the operation entered its state (newest first unless
    `oldest_first`), keyset-paginated: `cursor` is the `next_cursor` of the page before,
    `before` the `previous_cursor` of the page after. `filters.state` may be any state
    (browsing settled ones too) or "conflicting"; "" is everything waiting on a person.
    Three queries whatever `per_page`: the page, a grouped count over the indexed
    unresolved states, and the conflicting operations capped at CONFLICT_COUNT_CAP (which
    also gives the total of "All waiting"). Raises InvalidInput for a malformed cursor or
    page size.
    """
    filters = filters or QueueFilters()
    now = now or timezone.now()
    per_page = check_per_page(per_page)
    filtered = _filtered(user, filters, now=now)
    flagged = with_claims(with_review_flags(filtered), now=now)
    flagged = flagged.select_related("run").defer("intent", "error_detail")
    qs = _in_queue(flagged, filters.state, searching=bool(filters.search))
    order = ("state_changed_at", "id") if filters.oldest_first else ("-state_changed_at", "-id")
    page = QueuePage(**keyset_page(qs.order_by(*order), "state_changed_at", cursor=cursor,
                                   before=before, per_page=per_page,
                                   descending=not filters.oldest_first))
    page.counts, page.conflicts_capped, outside = _queue_counts(filtered)
    page.total = sum(page.counts[state] for state in QUEUE_STATES) + outside
    page.total_capped = page.conflicts_capped
    return page


def queue_selection(user, filters: QueueFilters, *, limit: int,
                    now: datetime | None = None) -> list[tuple[str, int]]:
    """(operation_id, version) of the queue's operations matching `filters` (as the queue
    shows them, oldest in their state first), at most `limit`: one query. What "select all
    matching this filter" of a bulk decision takes."""
    now = now or timezone.now()
    qs = _in_queue(_filtered(user, filters, now=now), filters.state,
                   searching=bool(filters.search))
    return list(qs.order_by("state_changed_at", "id")
                .values_list("operation_id", "version")[:limit])


def queue_next(user, filters: QueueFilters, *, after: str = "",
               now: datetime | None = None) -> str | None:
    """The operation id a reviewer works on next under `filters`: the first of the
    queue's view (its order and filters, as `review_queue` shows it) other than `after`
    (the one just decided, which may still be listed). None when nothing is left. One
    query."""
    now = now or timezone.now()
    qs = _in_queue(_filtered(user, filters, now=now), filters.state,
                   searching=bool(filters.search))
    if after:
        qs = qs.exclude(operation_id=after)
    order = ("state_changed_at", "id") if filters.oldest_first else ("-state_changed_at", "-id")
    return qs.order_by(*order).values_list("operation_id", flat=True).first()


@dataclass
class QueuePulse:
    """What the live queue polls for: the counts of `review_queue` (same fields, so the
    same counts fragment renders them) and how many items of the filtered view entered
    their state after `since` (`new`, capped at NEW_COUNT_CAP)."""

    counts: dict[str, int]
    conflicts_capped: bool
    total: int
    total_capped: bool
    new: int
    new_capped: bool

    @property
    def signature(self) -> str:
        """The counts in one short string: a page compares it with what it shows."""
        return queue_signature(self)


NEW_COUNT_CAP = 100


def queue_signature(page) -> str:
    """`total` and every count of a QueuePage or QueuePulse, as "12.3.4.5": equal
    signatures mean equal counts."""
    parts = [page.total, *(page.counts.get(s, 0) for s in (*QUEUE_STATES, CONFLICTING))]
    return ".".join(str(n) for n in parts)


def queue_pulse(user, filters: QueueFilters | None = None, *, since: datetime | None,
                now: datetime | None = None) -> QueuePulse:
    """The counts of the queue under `filters` and the items of its view (`filters.state`
    too) that entered their state after `since`: three queries (grouped counts, capped
    conflicting, capped new), none touching the rows' intent. Read-only."""
    filters = filters or QueueFilters()
    now = now or timezone.now()
    filtered = _filtered(user, filters, now=now)
    counts, capped, outside = _queue_counts(filtered)
    new = 0
    if since is not None:
        view = _in_queue(filtered, filters.state, searching=bool(filters.search))
        new = (view.filter(state_changed_at__gt=since).order_by()
               .values("pk")[: NEW_COUNT_CAP + 1].count())
    return QueuePulse(
        counts=counts, conflicts_capped=capped,
        total=sum(counts[state] for state in QUEUE_STATES) + outside, total_capped=capped,
        new=min(new, NEW_COUNT_CAP), new_capped=new > NEW_COUNT_CAP,
    )


def _queue_counts(filtered: QuerySet[Operation]) -> tuple[dict[str, int], bool, int]:
    """Counts per queue state, the conflicting count (capped) and whether it was capped,
    and how many of the conflicting are in no queue state (settled duplicates, say)."""
    counts = dict.fromkeys(QUEUE_STATES, 0)
    counts.update(
        filtered.filter(state__in=QUEUE_STATES)
        .order_by()
        .values("state")
        .annotate(n=Count("id"))
        .values_list("state", "n")
    )
    conflicting = list(filtered.filter(_conflicting()).order_by()
                       .values_list("state", flat=True)[: CONFLICT_COUNT_CAP + 1])
    capped = len(conflicting) > CONFLICT_COUNT_CAP
    conflicting = conflicting[:CONFLICT_COUNT_CAP]
    counts[CONFLICTING] = len(conflicting)
    outside = sum(1 for state in conflicting if state not in QUEUE_STATES)
    return counts, capped, outside


# --- one operation -----------------------------------------------------------------------


@dataclass
class OperationDetail:
    operation: Operation
    events: list[OperationEvent]
    evidence: list[Evidence]
    duplicates: list[Operation]
    resolutions: list[str]
    # A person may settle the operation's conflict flag (`receipts.acknowledge`).
    can_acknowledge: bool = False
    # The live claim on it ("Ada is looking at this"), or None; people's notes.
    claim: Claim | None = None
    notes: list[OperationNote] = field(default_factory=list)
    # A person may claim it (while it is open) and write notes (`ledger.claims`).
    can_claim: bool = False
    can_note: bool = False
    # Waiting on people (a decision, a conflict flag, an approval): claims mean something.
    is_open: bool = False
    # The fact versions it was planned on (`record_intent(relies_on=)`), as they are now.
    relied_on: list[Fact] = field(default_factory=list)

    @property
    def timeline(self) -> list[tuple[str, object]]:
        """Events and notes in the order they happened: ("event" | "note", row)."""
        rows = [("event", ev) for ev in self.events] + [("note", n) for n in self.notes]
        return sorted(rows, key=lambda row: (row[1].created_at, row[0] == "note"))


DUPLICATES_SHOWN = 50


def operation_detail(user, operation_id: str, *, now: datetime | None = None) -> OperationDetail:
    """Everything the detail page shows; errors.NotFound for another tenant's."""
    now = now or timezone.now()
    op = fetch_one(
        with_review_flags(visible_operations(user)).select_related("run", "step"),
        f"operation {operation_id!r}", operation_id=operation_id,
    )
    # A claim says who is working on an open item; once the item is settled (no decision
    # and no conflict flag left) a leftover claim means nothing and is not shown.
    is_open = op.needs_review or bool(op.conflict) or op.state == State.PLANNED
    return OperationDetail(
        operation=op,
        events=list(op.events.order_by("version")),
        evidence=list(op.evidence.order_by("created_at", "id")),
        duplicates=duplicates_of(op),
        resolutions=resolutions_for(op, user),
        can_acknowledge=can_acknowledge(op, user),
        claim=Claim.objects.filter(operation=op, expires_at__gt=now).first() if is_open else None,
        notes=list(op.notes.order_by("created_at", "id")),
        can_claim=is_open and can_claim(op, user),
        can_note=can_claim(op, user),
        is_open=is_open,
        relied_on=relied_on(op),
    )


def relied_on(op: Operation) -> list:
    """The fact versions `op` relies on, oldest first; no query when it relies on none."""
    if not op.relies_on:
        return []
    return list(Fact.objects.filter(pk__in=op.relies_on).order_by("id"))


def can_claim(op: Operation, user) -> bool:
    """Whether `user` may claim `op` and write notes on it (`ledger.claims` checks again)."""
    return user.has_perm("ledger.resolve_operation") and access.can_see(user, op.tenant)


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




def can_acknowledge(op: Operation, user) -> bool:
    """Whether `user` may settle the conflict flag of `op` now: terminal and flagged, and
    `ledger.resolve_operation` with a grant for the tenant. `receipts.acknowledge` checks
    the same again."""
    return (op.is_terminal and bool(op.conflict)
            and user.has_perm("ledger.resolve_operation") and access.can_see(user, op.tenant))
