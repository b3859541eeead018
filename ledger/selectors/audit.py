"""Reads of the audit trail: the log of transitions (filtered, keyset-paged, exported)
and the state of its hash chains as one principal may see them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Q, QuerySet

from ledger import access, chain
from ledger.models import AuditVerification, ChainHead, OperationEvent
from ledger.selectors.base import visible
from ledger.selectors.pagination import Page, iter_keyset, keyset_page

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
    qs = visible(user, OperationEvent.objects.select_related("operation"))
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
    return Page(**keyset_page(audit_events(user, filters), "created_at", cursor=cursor,
                              per_page=per_page, descending=True))


def iter_audit_events(
    user, filters: AuditFilters | None = None, *, batch: int = 500
) -> Iterator[OperationEvent]:
    """Every matching event, newest first, fetched in keyset batches (for CSV export)."""
    return iter_keyset(audit_events(user, filters), "created_at", descending=True, batch=batch)


# --- the hash chains ---------------------------------------------------------------------


def audit_status(tenants=None) -> dict[str, Any]:
    """Chain heads (of `tenants`; None: all), the events not sealed into them yet, and the
    last verification, for the desk."""
    heads = ChainHead.objects.all()
    if tenants is not None:
        heads = heads.filter(tenant__in=tenants)
    return {
        "heads": list(heads.values("chain", "tenant", "seq", "hash")),
        "unsealed": [tail for tail in chain.unsealed()
                     if tenants is None or tail.tenant in tenants],
        "last_verification": AuditVerification.objects.order_by("-finished_at", "-id").first(),
    }


@dataclass(frozen=True)
class HeadStatus:
    """One chain head as a user sees it, with what the last verification found for it."""

    chain: str
    tenant: str
    seq: int
    hash: str
    verified_seq: int | None  # the head's seq when last verified; None: never verified
    verified_intact: bool | None

    @property
    def short_hash(self) -> str:
        return self.hash[:12]

    @property
    def links_since_verified(self) -> int:
        return self.seq - (self.verified_seq or 0)


@dataclass(frozen=True)
class VisibleAuditStatus:
    """`audit_status` limited to the tenants one user may see.

    `is_intact` is the last verification's verdict over those tenants' chains only, and
    `first_break` is the first broken link among them: a break in a tenant the user may not
    see is neither shown nor hinted at. Both are None when nothing was verified yet.
    """

    heads: list[HeadStatus]
    verification: AuditVerification | None
    links_checked: int
    is_intact: bool | None
    first_break: dict[str, Any] | None
    # The operation and evidence rows that verification held to their events.
    operations_checked: int = 0
    evidence_checked: int = 0
    # Per tenant, committed events the sealer has not linked yet (ledger.chain.Unsealed).
    unsealed: list[chain.Unsealed] = field(default_factory=list)


def audit_status_for(user) -> VisibleAuditStatus:
    """The chain heads of the tenants `user` may see and the last verification of them.

    Three queries (the user's tenant grants aside), whatever the number of chains.
    """
    tenants = access.tenants_for(user)
    status = audit_status(tenants)
    verification = status["last_verification"]
    visible = (lambda tenant: True) if tenants is None else (lambda tenant: tenant in tenants)
    checked = {}
    if verification is not None:
        checked = {(h["chain"], h["tenant"]): h for h in verification.heads
                   if visible(h["tenant"])}
    heads = [
        HeadStatus(
            chain=head["chain"], tenant=head["tenant"], seq=head["seq"], hash=head["hash"],
            verified_seq=checked.get((head["chain"], head["tenant"]), {}).get("seq"),
            verified_intact=checked.get((head["chain"], head["tenant"]), {}).get("is_intact"),
        )
        for head in sorted(status["heads"], key=lambda h: (h["tenant"], h["chain"]))
    ]
    if verification is None:
        return VisibleAuditStatus(heads=heads, verification=None, links_checked=0,
                                  is_intact=None, first_break=None,
                                  unsealed=status["unsealed"])
    first_break = verification.first_break
    if first_break is not None and not visible(first_break.get("tenant", "")):
        first_break = None
    return VisibleAuditStatus(
        heads=heads, verification=verification,
        links_checked=sum(h.get("links_checked", 0) for h in checked.values()),
        is_intact=all(h.get("is_intact", True) for h in checked.values()),
        first_break=first_break,
        operations_checked=sum(h.get("operations_checked", 0) for h in checked.values()),
        evidence_checked=sum(h.get("evidence_checked", 0) for h in checked.values()),
        unsealed=status["unsealed"],
    )
