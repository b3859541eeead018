"""Versioned facts: what is believed true about a subject, and on whose evidence.

A fact is never updated in place. The first value of (tenant, subject, predicate) is
version 1; a write naming the current version (`expected_version`) supersedes it with the
next version, and the old one stays readable. The same value again records nothing. A
different value that does not name the current version (none, or a stale one) is kept as a
candidate and opens a `FactConflict` for a person: never a silent overwrite.

A version may carry an expiry (`expires_at`, or `ttl` from now): after it the version is
no longer current for anyone acting on it. `read_facts` leaves it out, `require_current`
raises StaleFact naming the expiry, and an action relying on it is not submitted (checked
by PostgreSQL too, against the submitting transaction's now()). An expired version is
contradicted by nothing: the next write supersedes it without naming it, and the same value
written again renews it as a new version.

A person corrects a fact on the desk (`correct_fact`): a new version written as that person
(`reviewer:<username>`) supersedes the current one, and a FactDecision records who, why and
what was corrected, under the tenant's chain.

Concurrent writers are settled by PostgreSQL: superseding is a compare-and-set on the
current row, first values and candidates are inserted with ON CONFLICT DO NOTHING against
partial unique indexes, so the loser of a race sees the winner's row and no IntegrityError
escapes.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import QuerySet
from django.utils import timezone

from ledger import access, conf, leases, runs, tracing
from ledger.canonical import fingerprint, redact, scrub_text
from ledger.errors import InvalidInput, NotFound, StaleFact, StaleVersion
from ledger.inputs import (
    PG_INTEGER_MAX,
    check_aware,
    check_fencing_token,
    check_identifier,
    check_json,
    check_names,
    check_reason,
    check_run_ref,
    check_version,
    check_whole_number,
)
from ledger.models import (
    ConflictState,
    Fact,
    FactConflict,
    FactDecision,
    FactStatus,
    Run,
)
from ledger.models.execution import REVIEWER_SOURCE
from ledger.selectors import facts as fact_reads

# A person's decision's source; PostgreSQL knows it too (fact_fenced, fact_decided).
REVIEWER_SOURCE_PREFIX = REVIEWER_SOURCE


@tracing.state_tool("state_assert_fact", tracing.assert_fact_attributes)
def assert_fact(
    subject: str,
    predicate: str,
    value: Any,
    *,
    source: str,
    observed_at: datetime | None = None,
    expected_version: int | None = None,
    tenant: str = "default",
    run: Run | str | None = None,
    fencing_token: int | None = None,
    expires_at: datetime | None = None,
    ttl: timedelta | None = None,
) -> Fact:
    """Record that `subject` `predicate` is `value`, according to `source`.

    Returns the new current version; the current version itself when it already holds
    this value (nothing new is recorded); or, when the value differs and
    `expected_version` is not the current version, the candidate kept in a new
    `FactConflict` (`fact.is_candidate`, `fact.conflict`). Secret-named keys in `value`
    are redacted before anything is written. For a `run` that has been leased
    (`runs.resume`), the write is refused (StaleFencingToken, nothing written) unless
    `fencing_token` is the current token of its lease; a token given for a run never
    leased is refused too. Raises
    StaleFact when `expected_version` names a version of a key that has no fact yet, and
    InvalidInput (writing nothing) on bad input.

    `expires_at` (an aware datetime ahead of now) or `ttl` (a positive timedelta from now,
    not both): when the version stops being current (see the module's docstring). The
    same value with another expiry is a new version (a renewal), not "nothing new".
    """
    _check_key(subject, predicate, tenant)
    source = check_identifier(scrub_text(source), "source", 500)
    check_run_ref(run)
    check_fencing_token(fencing_token)
    check_version(expected_version)
    _check_observed_at(observed_at)
    expires_at = _expiry(expires_at, ttl)
    check_json(value, what="value")
    value = redact(value)
    run_obj = runs.as_run(run, tenant=tenant) if run is not None else None
    if fencing_token is not None and run_obj is None:
        raise InvalidInput("expected a run when a fencing_token is given, found run=None")
    new = Fact(
        tenant=tenant, subject=subject, predicate=predicate, value=value,
        value_fingerprint=fingerprint(value), source=source,
        observed_at=observed_at or timezone.now(), run=run_obj, fencing_token=fencing_token,
        expires_at=expires_at,
    )
    with leases.refused_as_stale(), transaction.atomic(durable=True):
        if run_obj is not None:
            # A leased run is always fenced: without its current token, or with an older
            # one, StaleFencingToken and nothing written (as for its operations and steps);
            # PostgreSQL checks the token written with the fact too (`fact_fenced`).
            leases.check_run(run_obj.pk, fencing_token)
        return _write(new, expected_version)


# The longest expiry a fact may be given (`ttl`, or `expires_at` from now).
MAX_TTL = timedelta(days=3650)


def _expiry(expires_at: datetime | None, ttl: timedelta | None) -> datetime | None:
    """The expiry `expires_at` or `ttl` give (None: none), checked to be ahead of now."""
    if expires_at is not None and ttl is not None:
        raise InvalidInput(f"expected expires_at or ttl, not both, found expires_at="
                           f"{expires_at!r} and ttl={ttl!r}")
    now = timezone.now()
    if ttl is not None:
        if not isinstance(ttl, timedelta) or not timedelta(0) < ttl <= MAX_TTL:
            raise InvalidInput(f"expected ttl to be a timedelta above 0 and at most {MAX_TTL}, "
                               f"found {ttl!r}")
        return now + ttl
    check_aware(expires_at, "expires_at")
    if expires_at is not None and not now < expires_at <= now + MAX_TTL:
        raise InvalidInput(f"expected expires_at after the ledger's clock "
                           f"({now.isoformat()}) and at most {MAX_TTL.days} days later, "
                           f"found {expires_at.isoformat()}")
    return expires_at


def _check_observed_at(observed_at: datetime | None) -> None:
    """None or an aware datetime no later than the ledger's clock plus the allowed skew
    (`LEDGER_FACT_MAX_FUTURE_SECONDS`): a fact from the future would win every later
    comparison of observation times."""
    check_aware(observed_at, "observed_at")
    if observed_at is None:
        return
    limit = timezone.now() + timedelta(seconds=conf.FACT_MAX_FUTURE_SECONDS)
    if observed_at > limit:
        raise InvalidInput(
            f"expected observed_at at most {conf.FACT_MAX_FUTURE_SECONDS} s after the "
            f"ledger's clock (LEDGER_FACT_MAX_FUTURE_SECONDS), found "
            f"{observed_at.isoformat()}, {_ahead(observed_at - limit)} beyond that")


def _ahead(delta: timedelta) -> str:
    return f"{delta.days} days" if delta.days else f"{int(delta.total_seconds())} s"


def _check_key(subject: Any, predicate: Any, tenant: Any) -> None:
    check_identifier(subject, "subject", 500)
    if predicate is not None:
        check_identifier(predicate, "predicate", 200)
    check_identifier(tenant, "tenant", 100)


def _write(new: Fact, expected_version: int | None) -> Fact:
    current = fact_reads.current_fact(new.tenant, new.subject, new.predicate)
    if current is None:
        if expected_version is not None:
            raise StaleFact(
                f"expected version {expected_version} of {new.subject} {new.predicate} to be "
                "current, found no fact at all for it",
                current=None,
            )
        first = _insert_first(new)
        if first is not None:
            return first
        # A concurrent writer recorded the first value before us: contest it below.
        current = fact_reads.current_fact(new.tenant, new.subject, new.predicate)
    if _same(current, new):
        return current
    if expected_version == current.version or _free(current, new, expected_version):
        successor = _supersede(current, new)
        if successor is not None:
            return successor
        # Someone superseded the same version first: their version is the current one now.
        current = fact_reads.current_fact(new.tenant, new.subject, new.predicate)
        if _same(current, new):
            return current
    return _keep_as_candidate(current, new)


def _same(current: Fact, new: Fact) -> bool:
    """Nothing new: the same value with the same expiry, and the current one unexpired."""
    return (current.value_fingerprint == new.value_fingerprint
            and current.expires_at == new.expires_at and not current.is_expired)


def _free(current: Fact, new: Fact, expected_version: int | None) -> bool:
    """Whether `new` supersedes `current` without naming its version: an expired version is
    contradicted by nothing, and the same value again only renews its expiry. A stale
    `expected_version` still keeps `new` as a candidate."""
    if expected_version is not None:
        return False
    return current.is_expired or current.value_fingerprint == new.value_fingerprint


def _next_id() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT nextval(pg_get_serial_sequence('ledger_fact', 'id'))")
        return cursor.fetchone()[0]


def _insert_first(new: Fact) -> Fact | None:
    """Insert version 1, or None if another writer's version 1 is already there."""
    new.pk = _next_id()
    new.version = 1
    new.status = FactStatus.CURRENT
    Fact.objects.bulk_create([new], ignore_conflicts=True)
    return Fact.objects.filter(pk=new.pk).first()


def _supersede(current: Fact, new: Fact) -> Fact | None:
    """Compare-and-set `current` -> superseded by `new` (its next version), or None if
    someone else superseded it first."""
    new.pk = _next_id()
    won = Fact.objects.filter(pk=current.pk, status=FactStatus.CURRENT).update(
        status=FactStatus.SUPERSEDED, superseded_by_id=new.pk
    )
    if won != 1:
        return None
    new.version = current.version + 1
    new.status = FactStatus.CURRENT
    Fact.objects.bulk_create([new])
    return Fact.objects.get(pk=new.pk)


def _keep_as_candidate(current: Fact, new: Fact) -> Fact:
    """Keep `new` as a candidate against `current` with its open conflict. The same
    candidate (value and source) against the same version is kept once."""
    new.pk = _next_id()
    new.version = None
    new.status = FactStatus.CANDIDATE
    new.contradicts = current
    Fact.objects.bulk_create([new], ignore_conflicts=True)
    candidate = Fact.objects.get(
        contradicts=current, value_fingerprint=new.value_fingerprint, source=new.source,
        status=FactStatus.CANDIDATE,
    )
    if candidate.pk == new.pk:
        FactConflict.objects.create(
            tenant=new.tenant, subject=new.subject, predicate=new.predicate,
            current=current, candidate=candidate,
        )
    return candidate


# --- reads (answered by ledger.selectors.facts) -----------------------------------------


@tracing.state_tool("state_read_facts", tracing.read_facts_attributes)
def read_facts(subject: str, *, tenant: str = "default",
               include_expired: bool = False) -> list[Fact]:
    """The current version of every predicate of `subject`, by predicate. Never candidates
    or superseded versions, and no expired version unless `include_expired` (then
    `fact.is_expired` tells them apart): what an agent acts on is only what is still true."""
    _check_key(subject, None, tenant)
    if not isinstance(include_expired, bool):
        raise InvalidInput(f"expected include_expired to be a bool, found {include_expired!r}")
    return fact_reads.current_facts(subject, tenant=tenant, include_expired=include_expired)


def read_fact(subject: str, predicate: str, *, tenant: str = "default") -> Fact | None:
    """The current version of (subject, predicate), or None."""
    _check_key(subject, predicate, tenant)
    return fact_reads.current_fact(tenant, subject, predicate)


def history(subject: str, predicate: str, *, tenant: str = "default") -> list[Fact]:
    """Every version of (subject, predicate), oldest first, then the candidates."""
    _check_key(subject, predicate, tenant)
    return fact_reads.history(subject, predicate, tenant=tenant)


def open_conflicts(*, tenants=None) -> QuerySet[FactConflict]:
    """Open conflicts of the given tenants (None: every tenant), oldest first, with both
    sides loaded."""
    if tenants is not None:
        tenants = check_names(tenants, "tenants", 100)
    return fact_reads.open_conflicts(tenants=tenants)


def require_current(fact: Fact) -> Fact:
    """`fact` read again, if it is still the current version and unexpired; else StaleFact
    whose `.current` is the current version (or None; the expired version itself when it
    expired). Act on a fact only after this."""
    if not isinstance(fact, Fact) or fact.pk is None:
        raise InvalidInput(f"expected a saved Fact, found {fact!r}")
    fresh = Fact.objects.filter(pk=fact.pk).first()
    if fresh is not None and fresh.is_current and fresh.is_expired:
        raise StaleFact(
            f"expected version {fresh.version} of {fact.subject} {fact.predicate} to be "
            f"current, found it expired at {fresh.expires_at.isoformat()}; read it again "
            "from its source and assert it anew",
            current=fresh,
        )
    if fresh is not None and fresh.is_current:
        return fresh
    current = fact_reads.current_fact(fact.tenant, fact.subject, fact.predicate)
    what = f"version {fact.version}" if fact.version else "a candidate"
    found = (
        "no current version" if current is None else
        f"version {current.version} = {scrub_text(repr(current.value))[:200]} from "
        f"{current.source} observed {current.observed_at.isoformat()}"
    )
    raise StaleFact(
        f"expected {what} of {fact.subject} {fact.predicate} to be current, found {found}",
        current=current,
    )


# --- human decisions ---------------------------------------------------------------------


def resolve_conflict(
    conflict: FactConflict,
    *,
    winner: Fact | str,
    user,
    reason: str,
    expected_version: int | None = None,
) -> Fact:
    """A person decides a conflict: the chosen value becomes a new current version whose
    source is `reviewer:<username>`; both sides stay readable as they were.

    `winner` is `conflict.current` or `conflict.candidate` (or the strings "current" /
    "candidate"). `expected_version` (default: the version the candidate contradicted) is
    the current version the person decided against: if the fact moved on since, StaleFact
    carries the new current version and nothing is written. Needs
    `ledger.resolve_factconflict` and a grant for the conflict's tenant; a conflict decided
    by someone else first raises StaleVersion. Records a FactDecision.
    """
    if not isinstance(conflict, FactConflict) or conflict.pk is None:
        raise InvalidInput(f"expected a saved FactConflict, found {conflict!r}")
    reason = check_reason(reason)
    access.require_perm(user, "ledger.resolve_factconflict", doing="decide fact conflicts")
    access.require_tenant(user, conflict.tenant)
    chosen = _winner(conflict, winner)
    reason = scrub_text(reason)
    username = user.get_username()
    with transaction.atomic(durable=True):
        _lock_open(conflict)
        written = _write_decision(conflict, chosen, username, expected_version)
        FactConflict.objects.filter(pk=conflict.pk).update(
            state=ConflictState.RESOLVED, resolved_at=written.created_at, resolved_by=user,
            resolution_reason=reason, chosen=chosen, resolved_fact=written,
        )
        # Written unsealed: the sealer links it into the tenant's chain (ledger.chain.seal).
        FactDecision.objects.create(
            tenant=conflict.tenant, conflict=conflict, chosen=chosen, written=written,
            user=user, username=username, reason=reason, created_at=timezone.now(),
        )
    conflict.refresh_from_db()
    return written


def _winner(conflict: FactConflict, winner: Fact | str) -> Fact:
    sides = {"current": conflict.current, "candidate": conflict.candidate}
    if isinstance(winner, str) and winner in sides:
        return sides[winner]
    if isinstance(winner, Fact) and winner.pk in (conflict.current_id, conflict.candidate_id):
        return sides["current" if winner.pk == conflict.current_id else "candidate"]
    raise InvalidInput(
        f"expected winner to be the conflict's current fact ({conflict.current_id}) or its "
        f"candidate ({conflict.candidate_id}), found {winner!r}"
    )


def _lock_open(conflict: FactConflict) -> None:
    """Lock the conflict row; StaleVersion if someone decided it first."""
    locked = FactConflict.objects.select_for_update().get(pk=conflict.pk)
    if locked.is_open:
        return
    # Read the decider after the lock: a row joined in the locking query would come from
    # the snapshot taken before waiting, when nobody had decided yet.
    who = locked.resolved_by.get_username() if locked.resolved_by else "someone"
    raise StaleVersion(
        f"expected conflict {conflict.pk} on {conflict.subject} {conflict.predicate} to be "
        f"open, found it resolved by {who} at {locked.resolved_at.isoformat()}: "
        f"{locked.resolution_reason}",
        current=locked,
    )


def _write_decision(conflict, chosen: Fact, username: str, expected_version) -> Fact:
    expected = conflict.current.version if expected_version is None else expected_version
    current = fact_reads.current_fact(conflict.tenant, conflict.subject, conflict.predicate)
    new = Fact(
        tenant=conflict.tenant, subject=conflict.subject, predicate=conflict.predicate,
        value=chosen.value, value_fingerprint=chosen.value_fingerprint,
        source=f"{REVIEWER_SOURCE_PREFIX}{username}", observed_at=timezone.now(),
    )
    successor = _supersede(current, new) if current.version == expected else None
    if successor is None:
        current = fact_reads.current_fact(conflict.tenant, conflict.subject, conflict.predicate)
        raise StaleFact(
            f"expected version {expected} of {conflict.subject} {conflict.predicate} to be "
            f"current to decide conflict {conflict.pk}, found version {current.version} from "
            f"{current.source}; decide again against the current value",
            current=current,
        )
    return successor


def correct_fact(
    fact: Fact,
    *,
    version: int,
    value: Any,
    user,
    reason: str,
    expires_at: datetime | None = None,
) -> Fact:
    """A person corrects version `version` of `fact` (any version of it names the fact: the
    page's; `version` is the one they saw): `value` becomes its next version, written as them
    (source `reviewer:<username>`), superseding the agent's version, with a FactDecision
    recording who, why, and which version was corrected (under the tenant's
    "fact_decisions" chain; the versions are under the record links like every fact).

    No such version of the fact is refused (InvalidInput: a form named it). It must still be
    the current version (expired or not): if it moved on since, StaleFact carries the current
    version and nothing is written. The same value and expiry again is
    refused (InvalidInput): a correction changes something. Needs
    `ledger.resolve_factconflict` and a grant for the fact's tenant (PostgreSQL holds the
    FactDecision to both, from the desk's role). `expires_at`: the corrected version's
    expiry (None: none).
    """
    if not isinstance(fact, Fact) or fact.pk is None or not fact.version:
        raise InvalidInput(f"expected a saved Fact version, found {fact!r}")
    reason = scrub_text(check_reason(reason))
    access.require_perm(user, "ledger.resolve_factconflict", doing="correct facts")
    access.require_tenant(user, fact.tenant)
    version = check_whole_number(version, low=1, high=PG_INTEGER_MAX,
                                 expected=f"version to be a version from 1 to {PG_INTEGER_MAX}")
    expires_at = _expiry(expires_at, None)
    check_json(value, what="value")
    try:
        fact = fact_reads.fact_version(fact.tenant, subject=fact.subject,
                                       predicate=fact.predicate, version=version)
    except NotFound:
        raise InvalidInput(f"expected version {version} of {fact.subject} {fact.predicate}, "
                           "found none") from None
    value = redact(value)
    username = user.get_username()
    new = Fact(
        tenant=fact.tenant, subject=fact.subject, predicate=fact.predicate, value=value,
        value_fingerprint=fingerprint(value), source=f"{REVIEWER_SOURCE_PREFIX}{username}",
        observed_at=timezone.now(), expires_at=expires_at,
    )
    if new.value_fingerprint == fact.value_fingerprint and expires_at == fact.expires_at:
        raise InvalidInput(f"expected a correction of {fact.subject} {fact.predicate} version "
                           f"{fact.version} to change its value or expiry, found both the same")
    with transaction.atomic(durable=True):
        successor = _supersede(fact, new)
        if successor is None:
            current = fact_reads.current_fact(fact.tenant, fact.subject, fact.predicate)
            raise StaleFact(
                f"expected version {fact.version} of {fact.subject} {fact.predicate} to be "
                f"current to correct it, found version {current.version} from "
                f"{current.source}; correct the current value",
                current=current,
            )
        # Written unsealed: the sealer links it into the tenant's chain (ledger.chain.seal).
        FactDecision.objects.create(
            tenant=fact.tenant, conflict=None, chosen=fact, written=successor, user=user,
            username=username, reason=reason, created_at=timezone.now(),
        )
    return successor
