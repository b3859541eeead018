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

A "not found" counts only once the reader has shown it can see (`check_absence`): the same
reconciler, in the same look-up, must find a positive control, an effect the ledger knows
is there (the latest succeeded operation of the same name on the same target and
provider account, or the reconciler's `canary`). A reader that cannot is blind (evidence
`verifier_blind`, naming the control): the operation stays outcome_unknown, then
manual_review after `max_failures` such readings, never safe_to_retry. With no control
yet on the target, absence counts only when the reconciler declares why its "not found"
is trustworthy (`trusted_absence`).
The unknown-outcome policy of the operation's kind tunes this (`unknown_outcome_policy`):
whether a proven absence may become safe_to_retry without a person at all, the readings
before manual_review, and how long NotYet may last. Admins set it per tenant and operation
pattern on the desk (`ledger.outcome_policies`, audited); a matching desk row wins over
LEDGER_UNKNOWN_OUTCOME_POLICIES, the default in code. The verdict's row lock reads it, in
the same statement: the policy in force when the verdict is stored.

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

import fnmatch
import importlib
import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Value
from django.db.models.functions import MD5
from django.utils import timezone

from ledger import claims, conf, durations, leases, rows, transitions
from ledger.canonical import canonical_json, redact, scrub_text
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
from ledger.models.approval_gate import pattern_matches_sql
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
# An absence the reader could not back with a positive control (check_absence).
VERIFIER_BLIND = "verifier_blind"
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


class Effects:
    """What a reconciler's listing of a target showed (`Reconciler.list_effects`), for
    `ledger.coverage`: `items`, each a dict with the effect's `external_id` and, when the
    service shows them, its `idempotency_key` and `at` (when it happened, ISO 8601), plus
    what else was observed (`item`); `complete`: False when the listing hit its bound, so
    more effects may exist than it shows; `query`: what was asked."""

    def __init__(self, items: list[dict[str, Any]], *, complete: bool = True,
                 query: dict[str, Any] | None = None):
        self.items = items
        self.complete = complete
        self.query = {} if query is None else query


class Reconciler:
    """Base class: subclass, implement `lookup` (and `search`), and `register` it.

    Class attributes tune the engine per reconciler: `grace_period` (how long NotYet may
    last, from `unknown_since`), `backoff_initial`/`backoff_max` (the exponential delay
    between attempts), `lease_ttl` (how long one look-up may take before another worker may
    take the operation over), `max_failures` (None: `LEDGER_RECONCILE_MAX_FAILURES`).
    `service_has_keys` (default True): the service records idempotency keys, so a match
    under another key than the operation's is not its effect (Found carrying another
    `idempotency_key` is taken as Ambiguous), nor is a fingerprint match that carries no
    key at all (a look-alike made another way: Found from `search` without
    `idempotency_key` is Ambiguous too); False for a service without keys.

    Positive controls (`check_absence`): `trusted_absence` says, in words a reviewer reads,
    why this reader's "not found" is proof while no control exists yet on a target (say
    "GET /by-key/<key> answers 404 only for keys it never saw"); "" (the default): it is
    not, and the first operation on a target is never proven absent. `canary`: a control
    of your own, always present at the service, instead of the latest succeeded operation:
    a dict (`idempotency_key`, `external_id`, `intent`, optional `target`) or a function
    of the operation returning one (or None). `read_control(control, method)` reads it.
    """

    name = ""
    service_has_keys = True
    trusted_absence = ""
    canary: dict[str, Any] | Callable[[Operation], dict[str, Any] | None] | None = None
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

    def list_effects(self, scope: Operation, since: datetime,
                     until: datetime) -> Effects | None:
        """The effects at `scope`'s target, read as its account, in [since, until]
        (`ledger.coverage`); None when this reconciler cannot list a target's effects.
        `scope` is an unsaved Operation carrying only tenant, operation, target, account."""
        return None

    def read_control(self, control: Operation, method: str) -> Verdict | None:
        """Read the positive control `control` as `method` ("lookup" or "search") has just
        read the operation: the same reader, credentials and account. It shows the reader
        can see when it answers Found with the control's external id. Override it only to
        read the control through the very request that read the operation."""
        return getattr(self, method)(control)

    def absence_trusted_because(self, method: str) -> str:
        """Why an absence `method` read is proof while no control exists ("": it is not)."""
        return self.trusted_absence

    def canary_for(self, op: Operation) -> dict[str, Any] | None:
        """The configured control for `op` (`canary`), or None."""
        return self.canary(op) if callable(self.canary) else self.canary

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
        outcome = _outcome(op, cls, method, verdict)
        if outcome.verdict == PROVEN_ABSENT:
            outcome = check_absence(reconciler, op, method, outcome)
        return outcome
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
        # A look-alike: the content matches, but on a service whose items carry keys this
        # one carries none (made by hand, by another tool). A re-read only counts effects.
        keyless = (not found_key and cls.service_has_keys and matched_by == "fingerprint"
                   and method != "reread")
        if (op.external_id and op.external_id != external_id) or other_key or keyless:
            # Both ids, side by side, for the person who decides.
            ids = {"found": {"external_id": external_id, "idempotency_key": found_key or ""},
                   "operation": {"external_id": op.external_id,
                                 "idempotency_key": op.idempotency_key}}
            common["observed"] = {**common["observed"], "ids": redact(ids)}
            detail = (f"found {external_id}, but the receipt already names {op.external_id}"
                      if op.external_id and op.external_id != external_id else
                      f"found {external_id} by {matched_by}, but under idempotency key "
                      f"{found_key}, not this operation's {op.idempotency_key}: done another "
                      "way? a person decides" if found_key else
                      f"found {external_id} by fingerprint, but it carries no idempotency "
                      f"key, where this service's items carry one (this operation's is "
                      f"{op.idempotency_key}): a look-alike made another way? a person "
                      "decides")
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


# --- positive controls: a "not found" counts only from a reader that can see ---------------

# How much of a control's reading the evidence keeps, in characters of canonical JSON.
MAX_CONTROL_CHARS = 4000


@dataclass(frozen=True)
class Control:
    """An effect the ledger knows is at the service, read to show the reader can see.

    `kind`: "operation" (the latest succeeded operation of the same name on the same
    target and account, with an external id) or "canary" (the reconciler's `canary`; `operation` is
    then built for the reading, never stored).
    """

    operation: Operation
    kind: str

    def describe(self) -> dict[str, Any]:
        control = self.operation
        shown = {"kind": self.kind, "idempotency_key": control.idempotency_key,
                 "external_id": control.external_id}
        if self.kind == "operation":
            shown.update(operation_id=control.operation_id,
                         succeeded_at=control.completed_at.isoformat()
                         if control.completed_at else None)
        return shown

    def in_words(self) -> str:
        control = self.operation
        if self.kind == "canary":
            return (f"the canary (idempotency key {control.idempotency_key or '-'}, external "
                    f"id {control.external_id or '-'})")
        when = control.completed_at.isoformat() if control.completed_at else "unknown"
        return (f"{control.operation_id}, which succeeded at {when} as "
                f"{control.external_id}")


def latest_control(op: Operation) -> Operation | None:
    """The latest succeeded operation of `op`'s tenant, name, target and provider account
    with an external id, other than `op` (one probe of operation_control_idx); None when
    there is none yet. An effect made as another account proves nothing about a reader of
    this one (a reader with the other account's credentials would find it). A purged one
    is gone: the one before it takes its place."""
    return (
        Operation.objects.alias(target_hash=MD5("target"))
        .filter(tenant=op.tenant, operation=op.operation, target_hash=MD5(Value(op.target)),
                target=op.target, account=op.account, state=State.SUCCEEDED,
                completed_at__isnull=False)
        .exclude(external_id="").exclude(pk=op.pk)
        .order_by("-completed_at", "-id")
        .first()
    )


def positive_control(reconciler: Reconciler, op: Operation) -> Control | None:
    """The control an absence of `op` must be backed by: the reconciler's canary if it has
    one, else the latest succeeded operation on the target; None when there is none."""
    spec = reconciler.canary_for(op)
    if spec is not None:
        return Control(_canary_operation(op, spec), "canary")
    control = latest_control(op)
    return Control(control, "operation") if control is not None else None


def _canary_operation(op: Operation, spec: Any) -> Operation:
    if not isinstance(spec, dict) or not (spec.get("idempotency_key") or spec.get("external_id")):
        raise InvalidInput(f"expected a canary to be a dict naming an idempotency_key or an "
                           f"external_id (and the intent to match on), found {spec!r}")
    unknown = set(spec) - {"idempotency_key", "external_id", "intent", "target"}
    if unknown:
        raise InvalidInput(f"expected a canary to name only idempotency_key, external_id, "
                           f"intent and target, found {sorted(unknown)}")
    return Operation(
        operation_id="canary", tenant=op.tenant, operation=op.operation,
        target=str(spec.get("target") or op.target), account=op.account,
        intent=dict(spec.get("intent") or {}),
        intent_fingerprint="", idempotency_key=str(spec.get("idempotency_key") or ""),
        external_id=str(spec.get("external_id") or ""), state=State.SUCCEEDED,
        retry_policy=op.retry_policy, created_at=op.created_at, state_changed_at=op.created_at,
        submitted_at=op.submitted_at, completed_at=None,
    )


def check_absence(reconciler: Reconciler, op: Operation, method: str,
                  outcome: Outcome) -> Outcome:
    """Back `outcome`, an absence `method` read for `op`, with a positive control.

    The engine calls it for every reconciler (kits, the gateway's read tools, classes of
    your own), right after the absence was read: `reconciler.read_control` reads the
    control (`positive_control`) with the same reader. Found with the control's external
    id: the absence stands, the control on its evidence. Anything else (not found, an
    error, another id): `verifier_blind`, the control and its reading on the evidence. No
    control yet: the absence stands only if the reconciler declares why it is trustworthy
    (`trusted_absence`, shown on the evidence); else `verifier_blind` too. Never raises for
    the reconciler's sake; a failure of the ledger's own database propagates.
    """
    control = positive_control(reconciler, op)
    if control is None:
        declared = scrub_text(storable(str(reconciler.absence_trusted_because(method) or ""),
                                       500))
        if declared.strip():
            return replace(
                outcome,
                observed={**outcome.observed,
                          "positive_control": {"status": "declared", "trusted_absence": declared}},
                detail=scrub_text(storable(
                    f"{outcome.detail}; no operation on this target has succeeded yet to serve "
                    f"as a control, and the reconciler declares its absence trustworthy: "
                    f"{declared}", 2000)),
            )
        return _blind(outcome, {"status": "none"}, (
            f"{method} found nothing, but that is not proof: no operation on this target has "
            "succeeded yet to show that this reader can see, and the reconciler declares no "
            "trusted absence; a person decides unless a later reading can be checked"))
    try:
        read = reconciler.read_control(control.operation, method)
        seen = (isinstance(read, Found) and (not control.operation.external_id
                                             or str(read.external_id)
                                             == control.operation.external_id))
        reading = _control_reading(read)
    except Exception as exc:  # noqa: BLE001 - a reading that fails shows nothing
        seen = False
        reading = {"error": storable(type(exc).__name__, 200),
                   "message": scrub_text(describe_exception(exc, 1000))}
    shown = {"control": redact(control.describe()), "reading": reading}
    if seen:
        return replace(
            outcome,
            observed={**outcome.observed, "positive_control": {"status": "seen", **shown}},
            detail=scrub_text(storable(
                f"{outcome.detail}; the same reader found the control "
                f"{control.in_words()}", 2000)),
        )
    what = (reading.get("verdict") or f"an error ({reading.get('message', '')})")
    return _blind(outcome, {"status": "not_seen", **shown}, (
        f"{method} found nothing, but that is not proof: the same reader could not find "
        f"{control.in_words()}, which the ledger knows is there (it read: {what}); the "
        "reader may be blind (a wrong URL, account or credentials, a missing read scope, an "
        "outage answering empty)"))


def _blind(outcome: Outcome, control: dict[str, Any], why: str) -> Outcome:
    return replace(
        outcome, verdict=VERIFIER_BLIND,
        observed={**outcome.observed, "positive_control": control},
        detail=scrub_text(storable(why, 2000)),
    )


def _control_reading(read: Any) -> dict[str, Any]:
    """What reading the control gave, bounded, as evidence can store it."""
    if not isinstance(read, Verdict):
        return {"verdict": f"not a verdict: {storable(repr(read), 200)}"}
    reading: dict[str, Any] = {"verdict": read.verdict or type(read).__name__}
    if isinstance(read, Found):
        reading["external_id"] = storable(scrub_text(str(read.external_id)), 500)
    for name in ("query", "observed"):
        value = getattr(read, name)
        try:
            check_json(value, what=name)
            text = canonical_json(value)
        except (InvalidInput, TypeError, ValueError) as exc:
            reading[name] = {"unstorable": storable(str(exc), 300)}
            continue
        reading[name] = (redact(value) if len(text) <= MAX_CONTROL_CHARS
                         else {"excerpt": scrub_text(text[:1000]), "characters": len(text)})
    return reading


# --- the policy per operation name for unknown outcomes ------------------------------------


@dataclass(frozen=True)
class UnknownOutcomePolicy:
    """What an unproven outcome of an operation name may become (`unknown_outcome_policy`).

    `automatic_retry`: whether a proven absence may become safe_to_retry without a person
    (False, say for payments: it goes to manual_review, the evidence kept); `attempts`:
    failed or blind readings before manual_review (None: the reconciler's `max_failures`,
    else LEDGER_RECONCILE_MAX_FAILURES); `window`: how long NotYet may last, from
    `unknown_since` (None: the reconciler's `grace_period`). `pattern`: the desk row's or
    the setting's pattern it came from, `source` which ("desk", "setting"; both "" for the
    defaults).
    """

    pattern: str = ""
    automatic_retry: bool = True
    attempts: int | None = None
    window: timedelta | None = None
    source: str = ""


def unknown_outcome_policy(operation: str, *, desk: dict[str, Any] | str | None = None
                           ) -> UnknownOutcomePolicy:
    """The policy of `operation`: `desk`, the desk's row matching it (as `_LOCK_AND_POLICY`
    reads it), when there is one; else LEDGER_UNKNOWN_OUTCOME_POLICIES: its exact name, else
    the matching pattern with the most literal characters; the defaults when none matches."""
    if isinstance(desk, str):  # a raw cursor's jsonb, not decoded
        desk = json.loads(desk)
    if desk is not None:
        return _policy_from(desk["pattern"], desk, source="desk")
    best: tuple[tuple[bool, int], str, dict[str, Any]] | None = None
    for pattern, spec in conf.UNKNOWN_OUTCOME_POLICIES.items():
        if not fnmatch.fnmatchcase(operation, pattern):
            continue
        rank = (pattern == operation, len(pattern.replace("*", "").replace("?", "")))
        if best is None or rank > best[0]:
            best = (rank, pattern, spec)
    if best is None:
        return UnknownOutcomePolicy()
    _, pattern, spec = best
    return _policy_from(pattern, spec, source="setting")


def _policy_from(pattern: str, spec: dict[str, Any], *, source: str) -> UnknownOutcomePolicy:
    window = spec.get("window_seconds")
    automatic = spec.get("automatic_retry")
    return UnknownOutcomePolicy(
        pattern=pattern, automatic_retry=True if automatic is None else automatic,
        attempts=spec.get("attempts"), source=source,
        window=timedelta(seconds=float(window)) if window is not None else None,
    )


def effective_unknown_outcome_policy(operation: str, tenant: str) -> UnknownOutcomePolicy:
    """The policy the reconciler applies to `operation` of `tenant` now (one query)."""
    with prepared_cursor() as cursor:
        cursor.execute(f"SELECT {_DESK_POLICY_SQL}",
                       {"operation": operation, "tenant": tenant})
        row = cursor.fetchone()
    return unknown_outcome_policy(operation, desk=row[0] if row else None)


# The desk's policy of an operation (`operation`, `tenant`: SQL expressions), as a JSON
# object, or NULL: the matching row of the tenant, its exact name first, then the pattern
# with the most literal characters (as the setting's patterns rank).
def _desk_policy_sql(operation: str, tenant: str) -> str:
    return f"""(
    SELECT jsonb_build_object('pattern', p.pattern, 'automatic_retry', p.automatic_retry,
                              'attempts', p.attempts,
                              'window_seconds', extract(epoch FROM p.not_yet_window))
      FROM ledger_unknownoutcomepolicy p
     WHERE p.tenant = {tenant} AND {pattern_matches_sql(operation)}
     ORDER BY p.pattern = {operation} DESC,
              length(replace(replace(p.pattern, '*', ''), '?', '')) DESC, p.id
     LIMIT 1)"""


_DESK_POLICY_SQL = _desk_policy_sql("%(operation)s", "%(tenant)s")
# The verdict's row lock, which reads the desk's policy of the operation in the same
# statement (no statement of its own: a verdict stays four).
_LOCK_AND_POLICY = f"""
    SELECT {_desk_policy_sql("o.operation", "o.tenant")}
      FROM ledger_operation o WHERE o.id = %(id)s FOR UPDATE OF o
"""


_POLICY_SOURCES = {"desk": "set on the desk", "setting": "LEDGER_UNKNOWN_OUTCOME_POLICIES",
                   "": "the defaults"}


def _attempts(cls: type[Reconciler], policy: UnknownOutcomePolicy) -> int:
    return policy.attempts or cls.max_failures or conf.RECONCILE_MAX_FAILURES


# --- claiming ------------------------------------------------------------------------------


def claim_next(
    *, worker: str, lease_ttl: timedelta | None = None, exclude: Iterable[int] = ()
) -> Claim | None:
    """Claim the next operation due for reconciliation, or None when there is none.

    Due: `reconciling` whose lease has expired (its worker died) or is this worker's own
    (a claim it did not settle: its connection was lost; these first), or
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
# the lease's unique index) or is this worker's own (a claim it never settled: the verdict's
# transaction, or the claim's own answer, was lost with its connection, say in a failover;
# it takes it back at its next pass instead of waiting out its own lease), then
# outcome_unknown whose next attempt has come (in claim order straight from the partial
# index operation_due_idx, so a claim reads one row rather than sorting every due one). One
# statement, written out once and prepared: every worker runs it before every operation,
# and compiling it through the ORM cost more CPU than the rest of a claim. The second look
# runs only when the first found nothing (its one-time filter), so a claim locks one row at
# most. An operation a reviewer has claimed (ledger.claims, a live ledger_claim row, looked
# up in its unique index) is not due while the claim lasts: the person decides, the
# reconciler does not move it under them. One already in `reconciling` when claimed is
# finished as before.
_CLAIM = f"""
    WITH orphaned AS MATERIALIZED (
        SELECT {rows.OPERATION_COLUMNS} FROM ledger_operation
         WHERE state = '{State.RECONCILING}'
           AND NOT EXISTS (SELECT 1 FROM ledger_lease
                            WHERE resource = 'reconcile:' || ledger_operation.operation_id
                              AND expires_at > statement_timestamp()
                              AND owner <> %(worker)s)
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
            cursor.execute(_CLAIM, {"skip": excluded, "now": timezone.now(),
                                    "worker": worker})
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
    with transaction.atomic(durable=True):
        # Lock the row before the lease, in the order claims take them (no deadlock); the
        # same statement reads the desk's unknown-outcome policy of the operation.
        with prepared_cursor() as cursor:
            cursor.execute(_LOCK_AND_POLICY, {"id": op.pk})
            desk = cursor.fetchone()[0]
        to_state, reason, changes = _decide(op, outcome, cls, now, desk)
        if claim.taken_over_from and claim.taken_over_from != claim.worker:
            reason += f"; taken over from {claim.taken_over_from} after its lease expired"
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
    op: Operation, outcome: Outcome, cls: type[Reconciler], now: datetime,
    desk: dict[str, Any] | str | None = None,
) -> tuple[str, str, dict[str, Any]]:
    attempts = op.reconcile_attempts + 1
    policy = unknown_outcome_policy(op.operation, desk=desk)
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
        if op.retry_policy == RetryPolicy.IF_ABSENT_PROVEN and not policy.automatic_retry:
            return (State.MANUAL_REVIEW,
                    f"proven absent, but the unknown-outcome policy for {policy.pattern!r} "
                    f"sends no retry without a person ({_POLICY_SOURCES[policy.source]}): "
                    "a person decides", changes)
        if op.retry_policy == RetryPolicy.IF_ABSENT_PROVEN:
            return State.SAFE_TO_RETRY, "proven absent: safe to retry", changes
        return (State.MANUAL_REVIEW,
                "proven absent, but the retry policy is 'never': a person decides", changes)
    if verdict in (AMBIGUOUS, NO_RECONCILER):
        return State.MANUAL_REVIEW, outcome.detail, changes
    if verdict == VERIFIER_BLIND:
        return _unproven(op, outcome, cls, now, attempts, changes, _attempts(cls, policy))
    if verdict == NOT_YET:
        unknown_since = op.unknown_since or op.state_changed_at
        grace = policy.window or cls.grace_period
        grace_end = unknown_since + grace
        if now >= grace_end:
            return (State.MANUAL_REVIEW,
                    f"still not visible after the grace period of {grace} "
                    f"(unknown since {unknown_since.isoformat()})", changes)
        changes["next_attempt_at"] = min(now + _backoff(cls, attempts), grace_end)
        return (State.OUTCOME_UNKNOWN,
                f"not visible yet; next attempt at {changes['next_attempt_at'].isoformat()}",
                changes)
    # ERROR
    failures = op.reconcile_failures + 1
    limit = _attempts(cls, policy)
    changes["reconcile_failures"] = failures
    if failures >= limit:
        return (State.MANUAL_REVIEW,
                f"reconciler failed {failures} times (limit {limit}): {outcome.detail}"[:2000],
                changes)
    changes["next_attempt_at"] = now + _backoff(cls, attempts)
    return (State.OUTCOME_UNKNOWN,
            f"reconciler failed ({failures} of {limit}): {outcome.detail}"[:2000], changes)


def _unproven(op: Operation, outcome: Outcome, cls: type[Reconciler], now: datetime,
              attempts: int, changes: dict[str, Any],
              limit: int) -> tuple[str, str, dict[str, Any]]:
    """A blind reading: never safe_to_retry. Inside the in-flight window it proves nothing
    anyway (next attempt then, not counted); after it, counted as a failure of the reader,
    outcome_unknown with backoff until `max_failures`, then manual_review."""
    if op.in_flight_until is not None and now < op.in_flight_until:
        changes["next_attempt_at"] = op.in_flight_until
        return (State.OUTCOME_UNKNOWN,
                f"unproven, and attempt {op.attempt} may still be in flight until "
                f"{op.in_flight_until.isoformat()}: {outcome.detail}"[:2000], changes)
    failures = op.reconcile_failures + 1
    changes["reconcile_failures"] = failures
    if failures >= limit:
        return (State.MANUAL_REVIEW,
                f"unproven after {failures} readings (limit {limit}): {outcome.detail}"[:2000],
                changes)
    changes["next_attempt_at"] = now + _backoff(cls, attempts)
    return (State.OUTCOME_UNKNOWN,
            f"unproven ({failures} of {limit}), read again at "
            f"{changes['next_attempt_at'].isoformat()}: {outcome.detail}"[:2000], changes)


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
