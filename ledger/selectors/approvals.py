"""Reads of approvals: an operation's approval gate (which `ledger.approvals` asks too), the
desk's "Awaiting approval" list, one operation's approval panel, the policies page, and the
two-person rule's proposals (the pending one, which `ledger.transitions` completes, and the
status of each)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from django.db.models import Count, F, OuterRef, Q, Subquery
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce, Now

from ledger import access, rows
from ledger.errors import InvalidInput
from ledger.models import (
    Approval,
    ApprovalPolicy,
    ApprovalPolicyChange,
    ApprovalRequest,
    Operation,
    OperationEvent,
    ResolutionProposal,
)
from ledger.models.approval_gate import gate_sql
from ledger.prepared import prepared_cursor
from ledger.selectors.base import capped_count, visible
from ledger.selectors.pagination import Page, keyset_page
from ledger.states import NEEDS_REVIEW, State

AWAITING_COUNT_CAP = 500


@dataclass(frozen=True)
class Gate:
    """Where an operation stands: `needed` people (0: nothing asks), `have` live approvals
    of its current fingerprint by distinct people, the policies asking, and the reason of a
    denial if there was one."""

    needed: int
    have: int
    patterns: str
    state: str
    version: int
    intent_fingerprint: str
    denial: str | None

    @property
    def is_open(self) -> bool:
        return self.needed == 0 or self.have >= self.needed


_GATE = f"""
SELECT g.needed, g.have, g.patterns, o.state, o.version, o.intent_fingerprint,
       (SELECT a.reason FROM ledger_approval a
         WHERE a.operation_id = o.id AND a.decision = 'deny' ORDER BY a.id DESC LIMIT 1)
  FROM ledger_operation o,
       LATERAL ({gate_sql(op_id="o.id", tenant="o.tenant", operation="o.operation",
                          fingerprint="o.intent_fingerprint")}) g
 WHERE o.id = %s
"""


def gate(op: Operation) -> Gate:
    """The operation's approval gate as the database sees it now (one prepared statement:
    every submission asks it)."""
    with prepared_cursor() as cursor:
        cursor.execute(_GATE, [op.pk])
        row = cursor.fetchone()
    return _gate_from_row(op, row)


_GATE_WIDTH = len(fields(Gate))


def _gate_from_row(op: Operation, row: Sequence[Any] | None) -> Gate:
    """The gate from a row that starts with `_GATE`'s columns (None: it found no row)."""
    if row is None:
        raise InvalidInput(f"expected operation {op.operation_id} in the ledger, found none")
    return Gate(*row[:_GATE_WIDTH])


# The gate's `needed` of the operation joined as "ledger_operation" (visible_awaiting).
_NEEDED = f"""(SELECT g.needed FROM ({gate_sql(op_id='"ledger_operation"."id"',
                                             tenant='"ledger_operation"."tenant"',
                                             operation='"ledger_operation"."operation"',
                                             fingerprint='"ledger_operation"."intent_fingerprint"')
                                    }) g)"""


@dataclass(frozen=True)
class ApprovalStatus:
    """Where an operation stands with approvals, as an agent polls it: `status` one of
    not_required, awaiting, approved, denied; `needed` people, `live` approvals of its
    current fingerprint, the `policies` asking, a denial's reason, and the agent's request
    (`requested`, its `note` and `requested_at`)."""

    status: str
    needed: int
    live: int
    policies: str
    denied_reason: str | None
    intent_fingerprint: str
    requested: bool
    note: str
    requested_at: datetime | None


_REQUEST_ROWS = rows.ModelRows(ApprovalRequest)
_REQUEST_OF = (f"SELECT {_REQUEST_ROWS.columns} FROM {_REQUEST_ROWS.table}"
               f" WHERE {_REQUEST_ROWS.column('operation')} = %s ORDER BY id LIMIT 1")

# The gate and the request in one row: the gate's columns, then the request's (all NULL
# without one); no row for an operation not in the ledger. Its parameters: the
# operation's pk, twice. `operation_receipt` reads it within its own statement.
APPROVAL_STATUS_SQL = f"SELECT g.*, r.* FROM ({_GATE}) g LEFT JOIN ({_REQUEST_OF}) r ON true"
APPROVAL_STATUS_WIDTH = _GATE_WIDTH + len(_REQUEST_ROWS.fields)


def approval_status(op: Operation) -> ApprovalStatus:
    """The operation's approval status now (one prepared statement: the gate with the
    request)."""
    with prepared_cursor() as cursor:
        cursor.execute(APPROVAL_STATUS_SQL, [op.pk, op.pk])
        row = cursor.fetchone()
    return approval_status_from_row(op, row)


def approval_status_from_row(op: Operation, row: Sequence[Any] | None) -> ApprovalStatus:
    """The approval status of `op` from a row that starts with `APPROVAL_STATUS_SQL`'s
    columns (None: it found no row, and InvalidInput says so as `gate` does)."""
    current = _gate_from_row(op, row)
    asked = None if row[_GATE_WIDTH] is None else _REQUEST_ROWS.instance(row[_GATE_WIDTH:])
    if current.denial is not None:
        status = "denied"
    elif current.needed == 0:
        status = "not_required"
    elif current.state != State.PLANNED or current.is_open:
        status = "approved"
    else:
        status = "awaiting"
    return ApprovalStatus(
        status=status, needed=current.needed, live=current.have, policies=current.patterns,
        denied_reason=current.denial, intent_fingerprint=current.intent_fingerprint,
        requested=asked is not None, note=asked.note if asked is not None else "",
        requested_at=asked.requested_at if asked is not None else None,
    )


def visible_awaiting(user, *, tenant: str = ""):
    """Requests of planned operations the user may see that wait for a person (pending, or
    approved with approvals expired since), oldest first; each with `live_approvals`
    (distinct people, for the operation's current intent)."""
    live = (Approval.objects
            .filter(operation=OuterRef("operation"), decision=Approval.Decision.APPROVE,
                    intent_fingerprint=OuterRef("operation__intent_fingerprint"),
                    expires_at__gt=Now())
            .order_by().values("operation")
            .annotate(n=Count("decided_by", distinct=True)).values("n"))
    # An approved request whose approvals expired before the agent sent it waits again.
    # `needed` is the gate's (the strictest matching policy, or the request's own ask),
    # so the list and the operation's page say the same "1 of 2".
    qs = (visible(user, ApprovalRequest)
          .filter(operation__state=State.PLANNED)
          .select_related("operation", "operation__run", "operation__step")
          .annotate(live_approvals=Coalesce(Subquery(live), 0),
                    needed=RawSQL(_NEEDED, ()))
          .filter(Q(status=ApprovalRequest.Status.PENDING)
                  | Q(status=ApprovalRequest.Status.APPROVED,
                      live_approvals__lt=F("needed")))
          .order_by("requested_at", "id"))
    return qs.filter(tenant=tenant) if tenant else qs


def awaiting_page(user, *, tenant: str = "", cursor: str = "", per_page: int = 50) -> Page:
    """One keyset page of the "Awaiting approval" list: one query."""
    return Page(**keyset_page(visible_awaiting(user, tenant=tenant), "requested_at",
                              cursor=cursor, per_page=per_page, descending=False))


def awaiting_count(user, *, tenant: str = "") -> tuple[int, bool]:
    return capped_count(visible_awaiting(user, tenant=tenant), AWAITING_COUNT_CAP)


@dataclass(frozen=True)
class ApprovalPanel:
    """What the operation page shows about approval: the gate, the request, each decision,
    and whether this user may decide now."""

    needed: int
    have: int
    patterns: str
    request: ApprovalRequest | None
    approvals: list[Approval]
    can_decide: bool
    approved_by_me: bool

    @property
    def is_open(self) -> bool:
        return self.needed == 0 or self.have >= self.needed

    @property
    def pattern_list(self) -> list[str]:
        """The policies asking, one pattern each (`patterns` joins them with ", ")."""
        return [p for p in self.patterns.split(", ") if p]

    @property
    def proposer(self) -> Approval | None:
        """The first live approval of the current intent, when a second person is due."""
        live = [a for a in self.approvals if a.is_live_for_current]
        return live[0] if live and self.needed > 1 and self.have < self.needed else None


def approval_panel(user, op: Operation) -> ApprovalPanel | None:
    """None when approval plays no part (no decision, and for a planned operation no
    policy or request either). One query (the decisions), three for a planned operation
    (its gate and request too)."""
    decisions = list(Approval.objects.filter(operation=op).annotate(
        is_live_for_current=Q(decision=Approval.Decision.APPROVE,
                              intent_fingerprint=F("operation__intent_fingerprint"),
                              expires_at__gt=Now()),
    ).order_by("created_at", "id"))
    needed = have = 0
    patterns, request = "", None
    if op.state == State.PLANNED:
        current = gate(op)
        needed, have, patterns = current.needed, current.have, current.patterns
        request = ApprovalRequest.objects.filter(operation=op).first()
    if needed == 0 and request is None and not decisions:
        return None
    may = (op.state == State.PLANNED and user.has_perm("ledger.resolve_operation")
           and access.can_see(user, op.tenant))
    mine = any(a.is_live_for_current and a.decided_by_id == user.pk for a in decisions)
    return ApprovalPanel(needed=needed, have=have, patterns=patterns, request=request,
                         approvals=decisions, can_decide=may, approved_by_me=mine)


def approval_policies(user) -> dict:
    """The policies page: every policy of the user's tenants and their recent changes."""
    access.require_perm(user, "ledger.view_approvalpolicy", doing="see approval policies")
    return {
        "policies": list(visible(user, ApprovalPolicy).select_related("updated_by")),
        "changes": list(visible(user, ApprovalPolicyChange)[:50]),
    }


# --- the two-person rule's proposals -----------------------------------------------------


def pending_proposal(op: Operation) -> ResolutionProposal | None:
    """The proposal waiting for a second person on `op`: the latest one of its current
    version (one of an older version is stale), or None (one query, none when `op` waits on
    no person)."""
    if op.state not in NEEDS_REVIEW:
        return None
    return (ResolutionProposal.objects.filter(operation_id=op.pk, version=op.version)
            .order_by("-created_at", "-id").first())


# What each proposal has become, as the desk says it.
PROPOSAL_PENDING = "needs a second person"
PROPOSAL_COMPLETED = "completed by a second person"
PROPOSAL_REPLACED = "replaced by a later proposal"
PROPOSAL_STALE = "stale: the operation changed since"


@dataclass(frozen=True)
class Proposals:
    """Every proposal of an operation, oldest first, each with its `status` (one of the
    PROPOSAL_* texts), and the pending one (`pending_proposal`'s answer), if any."""

    rows: list[ResolutionProposal]
    pending: ResolutionProposal | None


def proposals_of(op: Operation, events: Iterable[OperationEvent]) -> Proposals:
    """The two-person proposals of `op` with their status (one query): the pending one
    needs a second person; one an event of `events` (the operation's events, already read)
    names as completed was completed by a second person; another of the current version was
    replaced by a later proposal; one of an older version is stale."""
    rows = list(op.proposals.order_by("created_at", "id"))
    pending = next((p for p in reversed(rows) if p.version == op.version), None)
    if op.state not in NEEDS_REVIEW:
        pending = None
    completed = {(ev.evidence or {}).get("two_person", {}).get("proposal_id")
                 for ev in events if isinstance(ev.evidence, dict)}
    for proposal in rows:
        proposal.status = (
            PROPOSAL_PENDING if proposal is pending
            else PROPOSAL_COMPLETED if proposal.pk in completed
            else PROPOSAL_REPLACED if proposal.version == op.version
            else PROPOSAL_STALE
        )
    return Proposals(rows=rows, pending=pending)
