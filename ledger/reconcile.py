"""Reconciliation: settle unknown outcomes by reading the external system, never by writing.

A `Reconciler` registered for an operation name answers, for one operation, what the
external system shows: `lookup` (by idempotency key or external id) first, `search` (a
bounded search matched on the fingerprint) only when lookup returns None. Its verdict moves
the operation:

    Found        -> succeeded (external_id stored)
    ProvenAbsent -> safe_to_retry if the retry policy allows it, else manual_review; but
                    observed before the attempt's `in_flight_until`, outcome_unknown again
                    with the evidence, next attempt once the window has passed
    Ambiguous    -> manual_review
    NotYet       -> outcome_unknown again, next attempt after a backoff, until the grace
                    period (from `unknown_since`) ends; then manual_review
    no reconciler, or `max_failures` exceptions in a row -> manual_review

The operations table is the queue. A worker claims one operation with `SELECT ... FOR
UPDATE SKIP LOCKED`, moves it to `reconciling` under the lease `reconcile:<operation_id>`,
calls the reconciler outside any transaction, then writes the verdict, its `Evidence` row,
the transition and the lease release in one transaction fenced by that lease: a worker whose
lease was taken over is refused (StaleFencingToken) and writes nothing. An operation left in
`reconciling` by a dead worker is claimable again once its lease has expired.

A retried operation is read once more after it succeeded (`reread_due`): once the
in-flight windows of its attempts have passed (`Operation.reread_due_at`, set as the retry
is sent), the reconciler's `reread` counts its effects. One: the evidence says so and the
re-read is done. Several (the request of an earlier attempt landed late, beside the retry):
the operation is flagged `duplicate`, with that evidence and an event, and waits on the
review desk until a person acknowledges it (`receipts.acknowledge`). A re-read that cannot
count (NotYet, errors) is tried again after a backoff, `max_failures` times at most.

Nothing here ever sends, retries or writes to the external system.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from ledger import claims, conf, durations, leases, rows, transitions
from ledger.canonical import redact, scrub_text
from ledger.errors import InvalidInput, LeaseHeld, StaleFencingToken, StaleVersion
from ledger.inputs import (
    check_duration,
    check_identifier,
    check_json,
    check_operation_name,
    check_whole_number,
    describe_exception,
    storable,
)
from ledger.models import Evidence, Lease, Operation
from ledger.models.coordination import RUN_LEASE_WITH_PARAMS
from ledger.models.operations import Conflict
from ledger.prepared import prepared_cursor
from ledger.states import RetryPolicy, State

logger = logging.getLogger("ledger.reconcile")

# Evidence.verdict values; the review desk relies on these exact strings.
FOUND = "found"
PROVEN_ABSENT = "proven_absent"
AMBIGUOUS = "ambiguous"
NOT_YET = "not_yet"
ERROR = "error"
NO_RECONCILER = "no_reconciler"
MATCHED_BY = ("idempotency_key", "external_id", "fingerprint", "")


# --- verdicts ----------------------------------------------------------------------------


class Verdict:
    """What a reconciler saw. `observed` is stored (redacted) as evidence.

    Optional keywords: `query` (what was asked, stored with the evidence; by default the
    ledger describes the lookup or search it called) and `matched_by` (one of
    "idempotency_key", "external_id", "fingerprint" or "").
    """

    verdict = ""

    def __init__(self, observed=None, *, query=None, matched_by: str = ""):
        self.observed = {} if observed is None else observed
        self.query = {} if query is None else query
        self.matched_by = matched_by

    def __repr__(self):
        return f"{type(self).__name__}(observed={self.observed!r})"


class Found(Verdict):
    """The effect exists in the external system, with this id.

    `idempotency_key`: the key the found effect carries, when the service reports it. A key
    other than the operation's means the effect was made another way (by hand, by another
    agent): the engine takes it as Ambiguous, both ids in the evidence, unless the
    reconciler says its service has no keys (`Reconciler.service_has_keys = False`).
    """

    verdict = FOUND

    def __init__(self, external_id: str, observed=None, *, query=None, matched_by: str = "",
                 idempotency_key: str | None = None):
        super().__init__(observed, query=query, matched_by=matched_by)
        self.external_id = external_id
        self.idempotency_key = idempotency_key

    def __repr__(self):
        return f"Found({self.external_id!r}, observed={self.observed!r})"


class ProvenAbsent(Verdict):
    """The external system shows, consistently, that the effect never happened."""

    verdict = PROVEN_ABSENT


class Ambiguous(Verdict):
    """The reads cannot decide (several matches, a truncated search...): a person must."""

    verdict = AMBIGUOUS

    def __init__(self, observed=None, reason: str = "", *, query=None, matched_by: str = ""):
        super().__init__(observed, query=query, matched_by=matched_by)
        self.reason = reason


class NotYet(Verdict):
    """Nothing seen, but the read may not reflect recent writes yet (eventual consistency)."""

    verdict = NOT_YET


# --- reconcilers and their registry ------------------------------------------------------


class Reconciler:
    """Base class: subclass, implement `lookup` (and `search`), and `register` it.

    Class attributes tune the engine per reconciler: `grace_period` (how long NotYet may
    last, from `unknown_since`), `backoff_initial`/`backoff_max` (the exponential delay
    between attempts), `lease_ttl` (how long one look-up may take before another worker may
    take the operation over), `max_failures` (None: `LEDGER_RECONCILE_MAX_FAILURES`).
    `service_has_keys` (default True): the service records idempotency keys, so a match
    under another key than the operation's is not its effect (Found carrying another
    `idempotency_key` is taken as Ambiguous); False for a service without keys.
    """

    name = ""
    service_has_keys = True
    grace_period = timedelta(minutes=5)
    backoff_initial = timedelta(seconds=10)
    backoff_max = timedelta(minutes=2)
    lease_ttl = timedelta(minutes=2)
    max_failures: int | None = None

    def lookup(self, op: Operation) -> Verdict | None:
        """A direct read by idempotency key or external id; None when it cannot decide."""
        return None

    def search(self, op: Operation) -> Verdict:
        """A bounded search matched on the fingerprint; called only when lookup gave None."""
        return Ambiguous(reason="lookup could not decide and this reconciler has no search")

    def reread(self, op: Operation) -> Verdict:
        """Count the effects of `op`, a retried operation that succeeded (`reread_due`).

        Found: exactly one. Ambiguous whose `observed["matches"]` lists several: a copy of
        an earlier attempt landed beside the retry, and the operation is flagged duplicate.
        By default the fingerprint `search`, which sees the effect of every attempt whatever
        id it was given; override it when a read by idempotency key counts better (a
        service that records the key without enforcing it).
        """
        return self.search(op)

    @classmethod
    def label(cls) -> str:
        return cls.name or f"{cls.__module__}.{cls.__qualname__}"


_registry: dict[str, type[Reconciler]] = {}
_registry_lock = threading.Lock()
_discovered = False


def register(operation_name: str) -> Callable[[type[Reconciler]], type[Reconciler]]:
    """Class decorator: `cls` reconciles operations named `operation_name`.

    Registering another class for a name that already has one raises InvalidInput
    (re-registering the same class, e.g. on a module reload, is allowed).
    """
    check_operation_name(operation_name)

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, Reconciler)):
            raise InvalidInput(f"expected a subclass of reconcile.Reconciler, found {cls!r}")
        with _registry_lock:
            existing = _registry.get(operation_name)
            if existing is not None and existing.label() != cls.label():
                raise InvalidInput(
                    f"expected one reconciler for {operation_name!r}, found {existing.label()} "
                    f"already registered when registering {cls.label()}"
                )
            _registry[operation_name] = cls
        return cls

    return decorate


def unregister(operation_name: str) -> None:
    """Forget the reconciler of `operation_name` (tests, plug-in reloads)."""
    with _registry_lock:
        _registry.pop(operation_name, None)


def reconciler_for(operation_name: str) -> type[Reconciler] | None:
    autodiscover()
    return _registry.get(operation_name)


def autodiscover() -> None:
    """Import `LEDGER_RECONCILER_MODULES` once, so their registrations exist."""
    global _discovered
    if _discovered:
        return
    for module in conf.RECONCILER_MODULES:
        importlib.import_module(module)
    _discovered = True


# --- one look-up: what the reconciler said ------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """The result of consulting a reconciler, ready to be stored as Evidence."""

    verdict: str
    reconciler: str
    query: dict[str, Any]
    observed: dict[str, Any]
    matched_by: str = ""
    detail: str = ""
    external_id: str = ""


@dataclass(frozen=True)
class Claim:
    """An operation a worker holds in `reconciling` under lease `resource` with `token`."""

    operation: Operation
    worker: str
    token: int
    resource: str
    version: int
    taken_over_from: str = ""


def consult(op: Operation) -> Outcome:
    """Ask the registered reconciler about `op`: lookup, then search if lookup gave None.

    Never inside a transaction, never raises for the reconciler's sake: an exception or a
    malformed answer (not a verdict, or one the database could not store: a NUL, an
    unpaired surrogate, a huge number, a structure too deep) becomes an "error" outcome
    that carries the error, as far as it can be stored.
    """
    cls = reconciler_for(op.operation)
    if cls is None:
        return Outcome(
            verdict=NO_RECONCILER, reconciler="", query={}, observed={},
            detail=f"no reconciler is registered for operation {op.operation!r}",
        )
    method = "lookup"
    try:
        reconciler = cls()
        verdict = reconciler.lookup(op)
        if verdict is None:
            method = "search"
            verdict = reconciler.search(op)
        return _outcome(op, cls, method, verdict)
    except Exception as exc:  # a reconciler's failure is evidence, not a crash of the loop
        return error_outcome(op, cls, method, exc, doing="raised")


def error_outcome(op: Operation, cls: type[Reconciler] | None, method: str,
                  exc: BaseException, *, doing: str) -> Outcome:
    """An "error" outcome describing `exc`, storable whatever its message holds."""
    message = scrub_text(describe_exception(exc, 2000))
    return Outcome(
        verdict=ERROR, reconciler=storable(cls.label(), 200) if cls else "",
        query=_default_query(op, method),
        observed={"error": storable(type(exc).__name__, 200), "message": message},
        detail=f"{method} {doing} {message}",
    )


def _default_query(op: Operation, method: str) -> dict[str, Any]:
    if method == "reread":
        return {"method": "reread", "idempotency_key": op.idempotency_key,
                "external_id": op.external_id, "fingerprint": op.intent_fingerprint}
    if method == "lookup":
        return {"method": "lookup", "idempotency_key": op.idempotency_key,
                "external_id": op.external_id}
    return {"method": "search", "fingerprint": op.intent_fingerprint}


def _outcome(op: Operation, cls: type[Reconciler], method: str, verdict: Any) -> Outcome:
    if not isinstance(verdict, Verdict) or not verdict.verdict:
        raise InvalidInput(
            f"expected {method} to return Found, ProvenAbsent, Ambiguous or NotYet"
            f"{' (or None)' if method == 'lookup' else ''}, found {verdict!r}"
        )
    for name in ("observed", "query"):
        value = getattr(verdict, name)
        if not isinstance(value, dict):
            raise InvalidInput(f"expected {name} to be a dict, found {type(value).__name__}")
        check_json(value, what=name)
    if verdict.matched_by not in MATCHED_BY:
        raise InvalidInput(f"expected matched_by one of {MATCHED_BY}, found {verdict.matched_by!r}")
    query = {**_default_query(op, method), **verdict.query}
    common = {"reconciler": cls.label(), "query": redact(query),
              "observed": redact(verdict.observed)}
    if isinstance(verdict, Found):
        external_id = scrub_text(verdict.external_id)
        if not isinstance(external_id, str) or not external_id.strip() or len(external_id) > 500:
            raise InvalidInput(
                f"expected Found to carry a non-empty external id of at most 500 characters, "
                f"found {external_id!r}"
            )
        check_identifier(external_id, "the external id Found carries", 500)
        matched_by = verdict.matched_by or (
            "fingerprint" if method == "search"
            else "external_id" if op.external_id else "idempotency_key"
        )
        found_key = verdict.idempotency_key
        if found_key is not None and not isinstance(found_key, str):
            raise InvalidInput(f"expected Found's idempotency_key to be a string or None, "
                               f"found {type(found_key).__name__}")
        other_key = (bool(found_key) and cls.service_has_keys
                     and found_key != op.idempotency_key)
        if (op.external_id and op.external_id != external_id) or other_key:
            # Both ids, side by side, for the person who decides.
            ids = {"found": {"external_id": external_id, "idempotency_key": found_key or ""},
                   "operation": {"external_id": op.external_id,
                                 "idempotency_key": op.idempotency_key}}
            common["observed"] = {**common["observed"], "ids": redact(ids)}
            detail = (f"found {external_id}, but the receipt already names {op.external_id}"
                      if op.external_id and op.external_id != external_id else
                      f"found {external_id} by {matched_by}, but under idempotency key "
                      f"{found_key}, not this operation's {op.idempotency_key}: done another "
                      "way? a person decides")
            return Outcome(verdict=AMBIGUOUS, matched_by=matched_by, **common,
                           detail=scrub_text(storable(detail, 2000)))
        return Outcome(verdict=FOUND, matched_by=matched_by, external_id=external_id,
                       detail=f"{method} found {external_id}", **common)
    detail = {
        PROVEN_ABSENT: f"{method} proved the effect absent",
        NOT_YET: f"{method} saw nothing yet, inside the service's consistency window",
        AMBIGUOUS: f"{method} could not decide"
        + (f": {verdict.reason}" if getattr(verdict, "reason", "") else ""),
    }[verdict.verdict]
    # The reason is the reconciler's prose: recorded, only made storable.
    return Outcome(verdict=verdict.verdict, matched_by=verdict.matched_by,
                   detail=scrub_text(storable(str(detail), 2000)), **common)


# --- claiming ------------------------------------------------------------------------------


def claim_next(
    *, worker: str, lease_ttl: timedelta | None = None, exclude: Iterable[int] = ()
) -> Claim | None:
    """Claim the next operation due for reconciliation, or None when there is none.

    Due: `reconciling` whose lease has expired (its worker died; these first), or
    `outcome_unknown` whose `next_attempt_at` has come and that no reviewer holds a live
    claim on (`ledger.claims`: the claim pauses it; the oldest due first). Rows locked
    by another claimer are skipped, so many workers never claim the same operation. The
    claim moves it to `reconciling` (a take-over keeps it there) under a new, larger token
    of `reconcile:<operation_id>`.
    """
    _check_worker(worker)
    autodiscover()
    skip = set(exclude)
    while True:
        try:
            return _claim(worker, lease_ttl, skip)
        except LeaseHeld as exc:  # a live lease on a row we could lock: leave it alone
            skip.add(exc.operation_pk)


# Due: reconciling whose lease has expired (its worker died; few rows, each looked up in
# the lease's unique index), then outcome_unknown whose next attempt has come (in claim
# order straight from the partial index operation_due_idx, so a claim reads one row rather
# than sorting every due one). One statement, written out once and prepared: every worker
# runs it before every operation, and compiling it through the ORM cost more CPU than the
# rest of a claim. The second look runs only when the first found nothing (its one-time
# filter), so a claim locks one row at most. An operation a reviewer has claimed
# (ledger.claims, a live ledger_claim row, looked up in its unique index) is not due while
# the claim lasts: the person decides, the reconciler does not move it under them. One
# already in `reconciling` when claimed is finished as before.
_CLAIM = f"""
    WITH orphaned AS MATERIALIZED (
        SELECT {rows.OPERATION_COLUMNS} FROM ledger_operation
         WHERE state = '{State.RECONCILING}'
           AND NOT EXISTS (SELECT 1 FROM ledger_lease
                            WHERE resource = 'reconcile:' || ledger_operation.operation_id
                              AND expires_at > statement_timestamp())
           AND NOT (id = ANY(%(skip)s::bigint[]))
         ORDER BY id
         LIMIT 1
           FOR UPDATE OF ledger_operation SKIP LOCKED
    ), due AS MATERIALIZED (
        SELECT {rows.OPERATION_COLUMNS} FROM ledger_operation
         WHERE NOT EXISTS (SELECT 1 FROM orphaned)
           AND state = '{State.OUTCOME_UNKNOWN}'
           AND (next_attempt_at IS NULL OR next_attempt_at <= %(now)s)
           AND NOT (id = ANY(%(skip)s::bigint[]))
           AND NOT EXISTS (SELECT 1 FROM ledger_claim c
                            WHERE c.operation_id = ledger_operation.id
                              AND c.expires_at > %(now)s)
         ORDER BY next_attempt_at ASC NULLS FIRST, id
         LIMIT 1
           FOR UPDATE OF ledger_operation SKIP LOCKED
    )
    SELECT * FROM orphaned UNION ALL SELECT * FROM due
"""


def _claim(worker: str, lease_ttl: timedelta | None, skip: set[int]) -> Claim | None:
    with transaction.atomic(durable=True):
        excluded = sorted(skip)
        with prepared_cursor() as cursor:
            cursor.execute(_CLAIM, {"skip": excluded, "now": timezone.now()})
            row = cursor.fetchone()
        if row is None:
            return None
        op = rows.operation_from_row(row)
        resource = f"reconcile:{op.operation_id}"
        previous_owner = ""
        if op.state == State.RECONCILING:
            previous_owner = (
                Lease.objects.filter(resource=resource).values_list("owner", flat=True).first()
                or ""
            )
        cls = _registry.get(op.operation) or Reconciler
        try:
            token = leases.acquire(resource, worker, lease_ttl or cls.lease_ttl)
        except LeaseHeld as exc:
            exc.operation_pk = op.pk
            raise
        if op.state == State.OUTCOME_UNKNOWN:
            transitions.by_reconciler(
                op, State.RECONCILING, worker=worker, token=token, resource=resource,
                reason=f"claimed by {worker} (attempt {op.reconcile_attempts + 1})",
            )
    return Claim(operation=op, worker=worker, token=token, resource=resource,
                 version=op.version, taken_over_from=previous_owner)


def _check_worker(worker: Any) -> None:
    check_identifier(worker, "worker", 200)


# --- settling: verdict, evidence and transition in one fenced transaction ------------------


def settle(claim: Claim, outcome: Outcome) -> Operation:
    """Store `outcome` as Evidence and move the claimed operation, fenced by the claim's lease.

    One transaction: the Evidence row, the release of the lease (StaleFencingToken if
    another worker took the operation over; the transaction then rolls back and nothing at
    all is written), and the fenced transition and its event. Returns the updated operation.
    """
    op = claim.operation
    cls = _registry.get(op.operation) or Reconciler
    now = timezone.now()
    to_state, reason, changes = _decide(op, outcome, cls, now)
    if claim.taken_over_from and claim.taken_over_from != claim.worker:
        reason += f"; taken over from {claim.taken_over_from} after its lease expired"
    with transaction.atomic(durable=True):
        # Lock the row before the lease, in the order claims take them (no deadlock).
        with prepared_cursor() as cursor:
            cursor.execute("SELECT 1 FROM ledger_operation WHERE id = %s FOR UPDATE", [op.pk])
        evidence_row = Evidence.objects.create(
            operation=op, reconciler=outcome.reconciler[:200], query=outcome.query,
            observed=outcome.observed, verdict=outcome.verdict, matched_by=outcome.matched_by,
            detail=outcome.detail, created_at=now,
        )
        leases.release(claim.resource, claim.worker, claim.token)
        # Last: the transition links the tenant's audit chain, whose head stays locked to
        # the commit, and every writer of the tenant waits for it.
        transitions.by_reconciler(
            op, to_state, worker=claim.worker, token=claim.token, resource=claim.resource,
            reason=reason, expected_version=claim.version, changes=changes,
            evidence={"verdict": outcome.verdict, "reconciler": outcome.reconciler,
                      "matched_by": outcome.matched_by},
            evidence_row=evidence_row,  # the event seals it: verify_audit checks the row
        )
    return op


def _decide(
    op: Operation, outcome: Outcome, cls: type[Reconciler], now: datetime
) -> tuple[str, str, dict[str, Any]]:
    attempts = op.reconcile_attempts + 1
    changes: dict[str, Any] = {"reconcile_attempts": attempts, "next_attempt_at": None}
    conflict = conflict_for(outcome.verdict, outcome.observed)
    if conflict or op.conflict == Conflict.AMBIGUOUS:
        changes["conflict"] = conflict  # a later, clearer verdict ends the ambiguity
    verdict = outcome.verdict
    if verdict == FOUND:
        changes.update(external_id=outcome.external_id, reconcile_failures=0)
        return State.SUCCEEDED, f"found {outcome.external_id} ({outcome.matched_by})", changes
    if verdict == PROVEN_ABSENT:
        changes["reconcile_failures"] = 0
        if op.in_flight_until is not None and now < op.in_flight_until:
            # The request may still land: an absence read now proves nothing yet.
            changes["next_attempt_at"] = op.in_flight_until
            return (State.OUTCOME_UNKNOWN,
                    f"absent, but attempt {op.attempt} may still be in flight until "
                    f"{op.in_flight_until.isoformat()}: not proof; next attempt then",
                    changes)
        if op.retry_policy == RetryPolicy.IF_ABSENT_PROVEN:
            return State.SAFE_TO_RETRY, "proven absent: safe to retry", changes
        return (State.MANUAL_REVIEW,
                "proven absent, but the retry policy is 'never': a person decides", changes)
    if verdict in (AMBIGUOUS, NO_RECONCILER):
        return State.MANUAL_REVIEW, outcome.detail, changes
    if verdict == NOT_YET:
        unknown_since = op.unknown_since or op.state_changed_at
        grace_end = unknown_since + cls.grace_period
        if now >= grace_end:
            return (State.MANUAL_REVIEW,
                    f"still not visible after the grace period of {cls.grace_period} "
                    f"(unknown since {unknown_since.isoformat()})", changes)
        changes["next_attempt_at"] = min(now + _backoff(cls, attempts), grace_end)
        return (State.OUTCOME_UNKNOWN,
                f"not visible yet; next attempt at {changes['next_attempt_at'].isoformat()}",
                changes)
    # ERROR
    failures = op.reconcile_failures + 1
    limit = cls.max_failures or conf.RECONCILE_MAX_FAILURES
    changes["reconcile_failures"] = failures
    if failures >= limit:
        return (State.MANUAL_REVIEW,
                f"reconciler failed {failures} times (limit {limit}): {outcome.detail}"[:2000],
                changes)
    changes["next_attempt_at"] = now + _backoff(cls, attempts)
    return (State.OUTCOME_UNKNOWN,
            f"reconciler failed ({failures} of {limit}): {outcome.detail}"[:2000], changes)


def conflict_for(verdict: str, observed: Any) -> str:
    """The `Operation.conflict` a verdict leaves: ambiguous with several matches, or ""."""
    matches = observed.get("matches") if isinstance(observed, dict) else None
    if verdict == AMBIGUOUS and isinstance(matches, list) and len(matches) > 1:
        return Conflict.AMBIGUOUS
    return ""


def _backoff(cls: type[Reconciler], attempts: int) -> timedelta:
    return min(cls.backoff_initial * (2 ** min(attempts - 1, 30)), cls.backoff_max)


# --- the loop --------------------------------------------------------------------------------


def run_once(
    *,
    worker: str,
    limit: int = 100,
    lease_ttl: timedelta | None = None,
    stale_after: timedelta | None = None,
    on_verdict: Callable[[Operation, Outcome], None] | None = None,
) -> int:
    """One pass: sweep stale submissions, then reconcile up to `limit` due operations.

    Returns how many operations it finished (moved to succeeded, safe_to_retry or
    manual_review); NotYet and retried errors go back to outcome_unknown and do not count.
    Each operation is consulted at most once per pass; then the re-reads that are due
    (`reread_due`, not counted here). A verdict refused because another
    worker took the operation over is logged and dropped. `on_verdict(op, outcome)` is
    called after each stored verdict (the `reconcile` command prints them).

    Failures stay with their operation: a reconciler that raises, or answers what cannot
    be stored, or a verdict whose storing fails, is recorded as a reconciler failure of
    that operation (Evidence says what went wrong; after the configured number of failures
    it goes to manual_review), and the pass goes on with the next one. Only a failure of
    the ledger's own database (claiming, or storing even the failure) ends the pass; the
    operation then waits in `reconciling` until its lease expires, no longer.
    """
    _check_worker(worker)
    check_whole_number(limit, low=1, expected="limit to be a positive integer")
    autodiscover()
    if stale_after is None:
        stale_after = timedelta(seconds=conf.STALE_SUBMISSION_SECONDS)
    sweep_stale_submissions(older_than=stale_after)
    finished = 0
    seen: set[int] = set()
    for _ in range(limit):
        claim = claim_next(worker=worker, lease_ttl=lease_ttl, exclude=seen)
        if claim is None:
            break
        seen.add(claim.operation.pk)
        try:
            outcome = consult(claim.operation)
        except Exception as exc:  # noqa: BLE001 - consult's own guard failed: still this op's
            outcome = error_outcome(claim.operation, reconciler_for(claim.operation.operation),
                                    "lookup", exc, doing="failed:")
        try:
            op = _settle_isolated(claim, outcome)
        except (StaleFencingToken, StaleVersion) as exc:
            logger.warning("worker %s lost operation %s; its %s verdict was discarded: %s",
                           worker, claim.operation.operation_id, outcome.verdict, exc)
            continue
        if on_verdict is not None:
            on_verdict(op, outcome)
        if op.state != State.OUTCOME_UNKNOWN:
            finished += 1
    reread_due(worker=worker, limit=limit, lease_ttl=lease_ttl, on_verdict=on_verdict)
    _log_paused(worker)
    return finished


# (operation pk, claimed_at) of the claims this process has already logged as pausing.
_paused_logged: set[tuple[int, datetime]] = set()


def _log_paused(worker: str) -> None:
    """Say once per claim that a reviewer's claim pauses an operation that is due (the
    claim query skips it: ledger.claims)."""
    live = set()
    for held in claims.paused_by_claims():
        key = (held.operation_id, held.claimed_at)
        live.add(key)
        if key not in _paused_logged:
            logger.info("worker %s leaves operation %s alone: claimed by %s until %s UTC, "
                        "automatic reconciliation is paused while the claim lasts",
                        worker, held.operation.operation_id, held.claimed_by_name,
                        f"{held.expires_at:%Y-%m-%d %H:%M:%S}")
    _paused_logged.intersection_update(live)
    _paused_logged.update(live)


def _settle_isolated(claim: Claim, outcome: Outcome) -> Operation:
    """`settle`; when storing the verdict fails for anything but a lost claim, the failure
    is settled instead, as a reconciler failure of this operation (the verdict's
    transaction rolled back, so the claim still stands)."""
    try:
        return settle(claim, outcome)
    except (StaleFencingToken, StaleVersion):
        raise
    except Exception as exc:  # noqa: BLE001 - recorded below, as this operation's failure
        logger.warning("the %s verdict on operation %s could not be stored: %s",
                       outcome.verdict, claim.operation.operation_id,
                       describe_exception(exc, 500))
        failure = Outcome(
            verdict=ERROR, reconciler=storable(outcome.reconciler, 200),
            query=_default_query(claim.operation, "lookup"),
            observed={"error": storable(type(exc).__name__, 200),
                      "message": scrub_text(describe_exception(exc, 2000)),
                      "verdict": storable(outcome.verdict, 40)},
            detail=f"its {storable(outcome.verdict, 40)} verdict could not be stored: "
                   f"{scrub_text(describe_exception(exc, 2000))}",
        )
        return settle(claim, failure)


# --- crashed senders -------------------------------------------------------------------------


# Submitted before the cutoff, and no live lease on the run (or no run). Every pass of
# every worker runs it first, so it is written out once and prepared, as the claims are.
_STALE = f"""
    SELECT {rows.operation_columns("o")}, r.run_id, {RUN_LEASE_WITH_PARAMS}, l.owner, l.expires_at
      FROM ledger_operation o
      LEFT JOIN ledger_run r ON r.id = o.run_id
      LEFT JOIN ledger_lease l ON l.resource = {RUN_LEASE_WITH_PARAMS}
     WHERE o.state = '{State.SUBMITTED}' AND o.submitted_at < %s
       AND (o.run_id IS NULL OR l.id IS NULL OR l.expires_at <= statement_timestamp())
     ORDER BY o.submitted_at, o.id
     LIMIT %s
       FOR UPDATE OF o SKIP LOCKED
"""


def sweep_stale_submissions(*, older_than: timedelta, limit: int = 500) -> int:
    """`submitted` operations older than `older_than` whose sender is gone -> outcome_unknown.

    Gone: no live lease `run:<tenant>:<run_id>` (an operation without a run counts as gone once
    old). Each gets an event saying why. Returns how many it moved. Never sends anything.
    """
    check_duration(older_than, "older_than")
    cutoff = timezone.now() - older_than
    moved = 0
    with transaction.atomic(durable=True):
        with prepared_cursor() as cursor:
            cursor.execute(_STALE, [cutoff, limit])
            stale = cursor.fetchall()
        for row in stale:
            op = rows.operation_from_row(row)
            op.run_name, op.lease_name, op.lease_owner, op.lease_expired_at = row[-4:]
            reason = _why_gone(op, older_than)
            transitions.by_sweep(
                op, reason=reason,
                evidence={"submitted_at": op.submitted_at.isoformat(), "run": op.run_name,
                          "lease_owner": op.lease_owner,
                          "lease_expired_at": op.lease_expired_at.isoformat()
                          if op.lease_expired_at else None,
                          "older_than_seconds": older_than.total_seconds()},
            )
            moved += 1
    return moved


def _why_gone(op: Operation, older_than: timedelta) -> str:
    age = (f"submitted at {op.submitted_at.isoformat()}, more than "
           f"{durations.in_words(older_than)} ago")
    if op.run_name is None:
        return f"sender gone: {age}, and no run holds a lease for it"
    if op.lease_owner is None:
        return f"sender gone: {age}, and {op.lease_name} was never leased"
    return (f"sender gone: {age}, and the lease {op.lease_name} of {op.lease_owner} "
            f"expired at {op.lease_expired_at.isoformat()}")


# --- re-reads of retried successes -----------------------------------------------------------

# Succeeded operations whose re-read is due, in due order, straight from the partial index
# operation_reread_due_idx (a handful of rows: retried successes waiting on their windows).
_CLAIM_REREAD = f"""
    SELECT {rows.OPERATION_COLUMNS} FROM ledger_operation
     WHERE state = '{State.SUCCEEDED}' AND reread_due_at IS NOT NULL AND reread_due_at <= %s
       AND NOT (id = ANY(%s::bigint[]))
     ORDER BY reread_due_at, id
     LIMIT 1
       FOR UPDATE OF ledger_operation SKIP LOCKED
"""


def claim_reread(
    *, worker: str, lease_ttl: timedelta | None = None, exclude: Iterable[int] = ()
) -> Claim | None:
    """Claim the next succeeded operation whose re-read is due, or None.

    Due: `reread_due_at` has passed. The claim is the lease `reconcile:<operation_id>`
    (a live one of another worker: skipped), not a transition: the operation stays
    succeeded. Rows locked by another claimer are skipped.
    """
    _check_worker(worker)
    autodiscover()
    skip = set(exclude)
    while True:
        with transaction.atomic(durable=True):
            with prepared_cursor() as cursor:
                cursor.execute(_CLAIM_REREAD, [timezone.now(), sorted(skip)])
                row = cursor.fetchone()
            if row is None:
                return None
            op = rows.operation_from_row(row)
            cls = _registry.get(op.operation) or Reconciler
            resource = f"reconcile:{op.operation_id}"
            try:
                token = leases.acquire(resource, worker, lease_ttl or cls.lease_ttl)
            except LeaseHeld:
                skip.add(op.pk)
                continue
        return Claim(operation=op, worker=worker, token=token, resource=resource,
                     version=op.version)


def consult_reread(op: Operation) -> Outcome:
    """Ask the registered reconciler to count the effects of `op` (`Reconciler.reread`).

    Never inside a transaction, never raises for the reconciler's sake, as `consult`.
    """
    cls = reconciler_for(op.operation)
    if cls is None:
        return Outcome(
            verdict=NO_RECONCILER, reconciler="", query={}, observed={},
            detail=f"no reconciler is registered for operation {op.operation!r}",
        )
    try:
        return _outcome(op, cls, "reread", cls().reread(op))
    except Exception as exc:  # a reconciler's failure is evidence, not a crash of the loop
        message = scrub_text(f"{type(exc).__name__}: {exc}")[:2000]
        return Outcome(
            verdict=ERROR, reconciler=cls.label(), query={"method": "reread"},
            observed={"error": type(exc).__name__, "message": message},
            detail=f"reread raised {message}",
        )


def effects_found(outcome: Outcome) -> int | None:
    """How many effects a re-read's outcome shows: 1 for Found, the number of matches of
    an Ambiguous that lists several, 0 for ProvenAbsent; None when it cannot tell."""
    if outcome.verdict == FOUND:
        return 1
    if outcome.verdict == PROVEN_ABSENT:
        return 0
    matches = outcome.observed.get("matches") if isinstance(outcome.observed, dict) else None
    if outcome.verdict == AMBIGUOUS and isinstance(matches, list) and len(matches) > 1:
        return len(matches)
    return None


def settle_reread(claim: Claim, outcome: Outcome) -> Operation:
    """Store a re-read's `outcome` as Evidence and act on it, fenced by the claim's lease.

    Several effects: flag the operation `duplicate` (an event by the reconciler; already
    flagged, as a twin of another operation, it keeps the flag) and the re-read is done.
    One, none, or an answer that cannot count them (Ambiguous without several matches, no
    reconciler): the evidence says what was seen and the re-read is done. NotYet or an
    error: again after a backoff, until `max_failures` in a row. One transaction: the
    Evidence, the lease release (StaleFencingToken if another worker took it over: nothing
    is written), the flag or the schedule. Returns the updated operation.
    """
    op = claim.operation
    cls = _registry.get(op.operation) or Reconciler
    now = timezone.now()
    effects = effects_found(outcome)
    with transaction.atomic(durable=True):
        current = Operation.objects.select_for_update().get(pk=op.pk)
        finding = _reread_finding(effects, outcome)
        evidence_row = Evidence.objects.create(
            operation=current, reconciler=outcome.reconciler[:200], query=outcome.query,
            observed=outcome.observed, verdict=outcome.verdict, matched_by=outcome.matched_by,
            detail=scrub_text(f"re-read after attempt {current.attempt}: {finding}")[:2000],
            created_at=now,
        )
        leases.release(claim.resource, claim.worker, claim.token)
        conflict, due, failures = current.conflict, None, 0
        if effects is not None and effects > 1:
            conflict = Conflict.DUPLICATE
            reason = (f"re-read after attempt {current.attempt}: {effects} effects found, "
                      "expected one; an earlier attempt's request landed beside the retry")
        elif outcome.verdict in (NOT_YET, ERROR):
            failures = current.reconcile_failures + 1
            limit = cls.max_failures or conf.RECONCILE_MAX_FAILURES
            if failures < limit:
                due = now + _backoff(cls, failures)
                reason = f"re-read after attempt {current.attempt}: again later ({finding})"
            else:
                logger.warning("re-read of %s gave up after %s failures: %s",
                               current.operation_id, failures, outcome.detail)
                failures = 0
                reason = f"re-read after attempt {current.attempt} gave up: {finding}"
        else:
            reason = f"re-read after attempt {current.attempt}: {finding}"
        # Every re-read is an event (the flag, or the schedule alone), which seals its
        # evidence: verify_audit accounts for each row.
        return transitions.reread_by_reconciler(
            current, conflict, worker=claim.worker, token=claim.token,
            resource=claim.resource, reason=scrub_text(reason)[:2000], reread_due_at=due,
            reconcile_failures=failures, evidence_row=evidence_row,
            evidence={"verdict": outcome.verdict, "reconciler": outcome.reconciler,
                      "effects": effects},
        )


def _reread_finding(effects: int | None, outcome: Outcome) -> str:
    if effects is None:
        return f"could not count the effects ({outcome.verdict}): {outcome.detail}"
    if effects == 1:
        return f"one effect, as recorded ({outcome.detail})"
    if effects == 0:
        return f"no effect visible although the operation succeeded ({outcome.detail})"
    return f"{effects} effects, expected one: flagged duplicate ({outcome.detail})"


def reread_due(
    *,
    worker: str,
    limit: int = 100,
    lease_ttl: timedelta | None = None,
    on_verdict: Callable[[Operation, Outcome], None] | None = None,
) -> int:
    """Re-read up to `limit` retried successes whose windows have passed; returns how many
    it flagged duplicate. Each at most once per pass; a finding refused because another
    worker took the operation over is logged and dropped."""
    _check_worker(worker)
    check_whole_number(limit, low=1, expected="limit to be a positive integer")
    flagged = 0
    seen: set[int] = set()
    for _ in range(limit):
        claim = claim_reread(worker=worker, lease_ttl=lease_ttl, exclude=seen)
        if claim is None:
            break
        seen.add(claim.operation.pk)
        outcome = consult_reread(claim.operation)
        before = claim.operation.conflict
        try:
            op = settle_reread(claim, outcome)
        except (StaleFencingToken, StaleVersion) as exc:
            logger.warning("worker %s lost the re-read of %s; its %s finding was discarded: %s",
                           worker, claim.operation.operation_id, outcome.verdict, exc)
            continue
        if on_verdict is not None:
            finding = _reread_finding(effects_found(outcome), outcome)
            on_verdict(op, replace(outcome, detail=f"re-read: {finding}"))
        if op.conflict == Conflict.DUPLICATE and before != Conflict.DUPLICATE:
            flagged += 1
    return flagged
