"""Reads of facts and fact conflicts: current versions, history, the conflicts desk.

The agent API's reads (`facts.read_facts`, `facts.read_fact`, `facts.require_current`) are
answered from here; the desk's reads take the acting principal and only return rows of
tenants it may see.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Exists, OuterRef, QuerySet

from ledger import access
from ledger.errors import NotFound
from ledger.models import Fact, FactConflict, FactDecision, Run
from ledger.selectors.base import fetch_one, visible
from ledger.selectors.pagination import Page, keyset_page

# --- facts -------------------------------------------------------------------------------


def current_fact(tenant: str, subject: str, predicate: str) -> Fact | None:
    """The current version of (subject, predicate) in `tenant`, or None."""
    return (
        Fact.objects.current()
        .filter(tenant=tenant, subject=subject, predicate=predicate)
        .first()
    )


def current_facts(subject: str, *, tenant: str = "default",
                  include_expired: bool = False) -> list[Fact]:
    """The current version of every predicate of `subject`, by predicate. Never candidates
    or superseded versions; expired versions only with `include_expired`."""
    rows = Fact.objects.current().filter(tenant=tenant, subject=subject)
    if not include_expired:
        rows = rows.unexpired()
    return list(rows.select_related("run").order_by("predicate"))


def history(subject: str, predicate: str, *, tenant: str = "default") -> list[Fact]:
    """Every version of (subject, predicate), oldest first, then the candidates."""
    facts = Fact.objects.filter(tenant=tenant, subject=subject, predicate=predicate)
    return sorted(facts.select_related("run"),
                  key=lambda f: (f.version is None, f.version or 0, f.pk))


def facts_of_run(run: Run) -> list[Fact]:
    """The current version of every (subject, predicate) the run ever wrote, whoever wrote
    that version: what the run's successor must know."""
    touched = Fact.objects.filter(
        run=run, tenant=OuterRef("tenant"), subject=OuterRef("subject"),
        predicate=OuterRef("predicate"),
    )
    return list(
        Fact.objects.current().filter(tenant=run.tenant).filter(Exists(touched))
        .select_related("run").order_by("subject", "predicate")
    )


@dataclass
class FactDetail:
    """A fact version, every version and candidate of its (subject, predicate), the people's
    decisions on them (conflicts decided, corrections), and whether `user` may correct it."""

    fact: Fact
    history: list[Fact]
    decisions: list
    can_correct: bool

    @property
    def current(self) -> Fact | None:
        return next((f for f in self.history if f.is_current), None)


def access_fact(user, fact_id: int) -> Fact:
    """The fact version `fact_id` if `user` may see its tenant; errors.NotFound otherwise."""
    return fetch_one(visible(user, Fact).select_related("run"), f"fact {fact_id!r}",
                     pk=fact_id)


def fact_detail(user, fact_id: int) -> FactDetail:
    """Everything the fact page shows; errors.NotFound for another tenant's fact.
    `can_correct`: the key has a current version and `user` holds
    `ledger.resolve_factconflict` (`facts.correct_fact` checks it again, with the grant)."""
    fact = access_fact(user, fact_id)
    versions = history(fact.subject, fact.predicate, tenant=fact.tenant)
    decisions = list(
        FactDecision.objects.filter(written__in=[f.pk for f in versions if f.version])
        .select_related("written", "chosen").order_by("created_at", "id"))
    can_correct = (any(f.is_current for f in versions)
                   and user.has_perm("ledger.resolve_factconflict"))
    return FactDetail(fact=fact, history=versions, decisions=decisions,
                      can_correct=can_correct)


# --- conflicts ---------------------------------------------------------------------------


def open_conflicts(*, tenants=None) -> QuerySet[FactConflict]:
    """Open conflicts of the given tenants (None: every tenant), oldest first, with both
    sides loaded."""
    return (
        FactConflict.objects.open().for_tenants(tenants)
        .select_related("current", "candidate", "current__run", "candidate__run")
        .order_by("created_at", "id")
    )


def conflicts_for(user) -> QuerySet[FactConflict]:
    """Fact conflicts, open or decided, of the tenants `user` may see."""
    return visible(user, FactConflict)


def access_conflict(user, conflict_id: int) -> FactConflict:
    """The conflict `conflict_id` (both sides loaded) if `user` may see its tenant;
    errors.NotFound otherwise. One query."""
    return fetch_one(conflicts_for(user).select_related("current", "candidate"),
                     f"fact conflict {conflict_id!r}", pk=conflict_id)


def visible_conflicts(user, *, tenant: str = "") -> QuerySet[FactConflict]:
    """Open fact conflicts of the tenants `user` may see (one tenant if `tenant`), oldest
    first, with both sides and their runs loaded."""
    qs = open_conflicts(tenants=access.tenants_for(user))
    return qs.filter(tenant=tenant) if tenant else qs


def conflict_page(user, *, tenant: str = "", cursor: str = "", per_page: int = 50) -> Page:
    """One keyset page of open fact conflicts, oldest first: one query whatever `per_page`."""
    return Page(**keyset_page(visible_conflicts(user, tenant=tenant), "created_at",
                              cursor=cursor, per_page=per_page, descending=False))


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
    """Everything the conflict page shows, in two queries; errors.NotFound for another
    tenant's. `can_decide`: open, and `user` holds `ledger.resolve_factconflict`
    (`facts.resolve_conflict` checks the same again)."""
    conflict = fetch_one(
        conflicts_for(user).select_related("current", "candidate", "current__run",
                                           "candidate__run", "resolved_by", "resolved_fact"),
        f"fact conflict {conflict_id!r}", pk=conflict_id,
    )
    live = (
        Fact.objects.current()
        .filter(tenant=conflict.tenant, subject=conflict.subject, predicate=conflict.predicate)
        .select_related("run").first()
    )
    can_decide = conflict.is_open and user.has_perm("ledger.resolve_factconflict")
    return ConflictDetail(conflict=conflict, live=live, can_decide=can_decide)


def fact_version(tenant: str, *, subject, predicate, version) -> Fact:
    """Version `version` of the fact (`subject`, `predicate`) of `tenant` (what a receipt
    relies on: `record_intent(relies_on=)`), or errors.NotFound. One query."""
    fact = Fact.objects.filter(tenant=tenant, subject=subject, predicate=predicate,
                               version=version).first()
    if fact is None:
        raise NotFound(f"expected version {version} of fact {subject} {predicate} in tenant "
                       f"{tenant}, found none"[:500])
    return fact
