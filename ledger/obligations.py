"""Obligations: what a run has promised to do exactly once, named by an idempotency key.

Keys are unique per tenant: `open` is idempotent on the key within the run's tenant, and
`commit` / `cancel` find a key within `tenant` (needed when the key names obligations of
several tenants). `commit` is one compare-and-set (`UPDATE ... WHERE state =
'open'`), so among any number of concurrent committers exactly one wins; every other gets
`AlreadyCommitted` carrying the winner's result. A settled obligation never changes: a
trigger refuses any UPDATE of it, and every DELETE. On a leased run, `open`, `commit` and
`cancel` carry the lease's current fencing token (`ledger.leases.check_run`), which
PostgreSQL checks too: the INSERT writes it (`obligation_opened_fenced`), the settling
UPDATE writes it (`obligation_fenced`), and an obligation is only ever inserted open.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from django.db.models.functions import Now

from ledger import leases, runs, tracing
from ledger.canonical import redact, scrub_text
from ledger.errors import AlreadyCommitted, IdempotencyKeyReused, IllegalTransition, InvalidInput
from ledger.inputs import (
    check_aware,
    check_fencing_token,
    check_identifier,
    check_json,
    check_names,
    check_optional_identifier,
    check_run_ref,
    storable_text,
)
from ledger.models import Obligation, ObligationState, Run
from ledger.selectors import runs as run_reads


@tracing.state_tool("state_open_obligation", tracing.open_obligation_attributes)
def open(  # the contract's name; it shadows the builtin only inside this module
    run: Run | str,
    kind: str,
    key: str,
    *,
    deadline: datetime | None = None,
    fencing_token: int | None = None,
) -> Obligation:
    """Open the obligation `key` of `run`; returns it, or the existing one with that key
    whatever its state (the deadline of an existing obligation is left as it was).

    The same key naming another run or kind raises IdempotencyKeyReused. Once the run is
    leased, StaleFencingToken unless `fencing_token` is the lease's current token (none, or
    an older one, is refused); a run never leased takes obligations without a token. The
    token is written with the row as `opened_token`, which PostgreSQL checks
    (obligation_opened_fenced; for a call without a token it is the only check).
    """
    check_run_ref(run)
    check_identifier(kind, "kind", 200)
    check_identifier(key, "key", 200)
    check_aware(deadline, "deadline")
    check_fencing_token(fencing_token)
    run = runs.as_run(run)
    with leases.refused_as_stale(), transaction.atomic(durable=True):
        if fencing_token is not None:
            leases.check_run(run.pk, fencing_token)
        # Without a token, the INSERT below is the check (a round trip less on a run never
        # leased): obligation_opened_fenced refuses it on a leased run, even when the key
        # exists (its BEFORE INSERT runs before ON CONFLICT), as StaleFencingToken.
        # ON CONFLICT DO NOTHING: a concurrent opener of the same key reads the winner's row.
        # The token is written with it: PostgreSQL checks it too (obligation_opened_fenced).
        Obligation.objects.bulk_create(
            [Obligation(run=run, tenant=run.tenant, kind=kind, key=key, deadline=deadline,
                        opened_token=fencing_token)],
            ignore_conflicts=True,
        )
        obligation = Obligation.objects.select_related("run").get(tenant=run.tenant, key=key)
    if obligation.run_id != run.pk or obligation.kind != kind:
        raise IdempotencyKeyReused(
            f"expected obligation key {key!r} to name {kind} of run {run.run_id}, found it "
            f"naming {obligation.kind} of run {obligation.run.run_id} ({obligation.state})",
            existing=obligation,
        )
    return obligation


@tracing.state_tool("state_commit", tracing.obligation_attributes)
def commit(key: str, result: Any, *, fencing_token: int | None = None,
           tenant: str | None = None) -> Obligation:
    """Commit the open obligation `key` with `result`, exactly once.

    Whoever commits first wins; every later or concurrent call, even with the same result,
    raises AlreadyCommitted whose `.result` is the winner's. A cancelled obligation raises
    IllegalTransition; an unknown key InvalidInput. Secret-named keys in `result` are
    redacted before it is stored. Once the run is leased, StaleFencingToken unless
    `fencing_token` is the lease's current token (so for `cancel`).
    """
    check_identifier(key, "key", 200)
    check_optional_identifier(tenant, "tenant", 100)
    check_json(result, what="result")
    check_fencing_token(fencing_token)
    result = redact(result)
    with leases.refused_as_stale(), transaction.atomic(durable=True):
        named = _named(key, tenant, doing="commit")
        leases.check_run(named.run_id, fencing_token)
        won = Obligation.objects.filter(pk=named.pk, state=ObligationState.OPEN).update(
            state=ObligationState.COMMITTED, result=result, committed_at=Now(),
            fencing_token=fencing_token,
        )
        obligation = Obligation.objects.filter(pk=named.pk).first()
    if won == 1:
        return obligation
    raise _not_open(key, obligation, doing="commit")


def cancel(key: str, *, reason: str, fencing_token: int | None = None,
           tenant: str | None = None) -> Obligation:
    """Cancel the open obligation `key`: it will not be done. Cancelling a cancelled one
    returns it unchanged; a committed one raises AlreadyCommitted (with its result)."""
    check_identifier(key, "key", 200)
    check_optional_identifier(tenant, "tenant", 100)
    reason = storable_text(reason, "reason", 2000)
    if not reason.strip():
        raise InvalidInput(f"expected a non-empty reason to cancel, found {reason!r}")
    check_fencing_token(fencing_token)
    with leases.refused_as_stale(), transaction.atomic(durable=True):
        named = _named(key, tenant, doing="cancel")
        leases.check_run(named.run_id, fencing_token)
        won = Obligation.objects.filter(pk=named.pk, state=ObligationState.OPEN).update(
            state=ObligationState.CANCELLED, cancelled_at=Now(),
            cancel_reason=scrub_text(reason.strip()), fencing_token=fencing_token,
        )
        obligation = Obligation.objects.filter(pk=named.pk).first()
    if won == 1 or (obligation is not None and obligation.state == ObligationState.CANCELLED):
        return obligation
    raise _not_open(key, obligation, doing="cancel")


def overdue(*, tenants=None, now: datetime | None = None) -> QuerySet[Obligation]:
    """Open obligations past their deadline, of the given tenants (None: every tenant),
    most overdue first."""
    if tenants is not None:
        tenants = check_names(tenants, "tenants", 100)
    return run_reads.overdue_obligations(tenants=tenants, now=now)


def _named(key: str, tenant: str | None, *, doing: str) -> Obligation:
    """The obligation `key` of `tenant` (None: of the one tenant that has that key), its pk
    and run only; InvalidInput when there is none, or several without a tenant."""
    named = Obligation.objects.filter(key=key).only("pk", "run_id", "tenant")
    found = list(named.filter(tenant=tenant)[:1] if tenant is not None else named[:2])
    if not found:
        raise _not_open(key, None, doing=doing)
    if len(found) > 1:
        raise InvalidInput(
            f"expected obligation key {key!r} to name one obligation, found obligations of "
            "several tenants; name the tenant (tenant=...)")
    return found[0]


def _not_open(key: str, obligation: Obligation | None, *, doing: str) -> Exception:
    if obligation is None:
        return InvalidInput(
            f"expected an open obligation with key {key!r} to {doing}, found none; "
            "obligations.open it first"
        )
    if obligation.state == ObligationState.COMMITTED:
        return AlreadyCommitted(
            f"expected obligation {key!r} to be open to {doing} it, found it committed at "
            f"{obligation.committed_at.isoformat()} with result "
            f"{scrub_text(repr(obligation.result))[:200]}",
            result=obligation.result,
            obligation=obligation,
        )
    return IllegalTransition(
        f"expected obligation {key!r} to be open to {doing} it, found it {obligation.state}",
        from_state=obligation.state,
        to_state=ObligationState.COMMITTED if doing == "commit" else ObligationState.CANCELLED,
    )
