"""Leases with fencing tokens.

A lease is a time-limited claim on a resource (`run:<tenant>:<run_id>`, ...). Every acquisition
hands out a token strictly greater than any token the resource had before, so a write that
carries a token can be refused once someone newer took over (`check`). A run's lease
`run:<tenant>:<run_id>` (`Run.lease_resource`) fences every agent write to the run once it
exists (`check_run`: a write without a token is refused too). Times come from the database
clock (`now()`), never from the caller's.

Each change is one call of a PostgreSQL function (atomic alone, or part of the caller's
transaction, with no savepoint around it), prepared: reconcilers take and release a lease
per operation. The functions (`ledger_lease_acquire`, `ledger_lease_renew`,
`ledger_lease_release`, migration 0042) are the only way any application role changes a
lease: they hand out the tokens and refuse a take-over of a live lease, so a login that
calls SQL itself can neither rewind a token nor take a lease still held (the trigger
`lease_change_check` refuses its UPDATE).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, connection

from ledger.errors import InvalidInput, LeaseHeld, StaleFencingToken
from ledger.inputs import check_fencing_token, check_identifier, check_positive_duration
from ledger.models.coordination import RUN_LEASE_WITH_PARAMS, run_lease_name
from ledger.models.triggers import FENCE_HINT
from ledger.prepared import prepared_cursor


def _check_ttl(ttl: timedelta) -> None:
    check_positive_duration(ttl, "ttl")


def _check_names(resource: str, owner: str | None = None, token: Any = ...) -> None:
    check_identifier(resource, "resource", 200)
    if owner is not None:
        check_identifier(owner, "owner", 200)
    if token is not ...:
        if token is None:
            raise InvalidInput("expected a fencing_token (a positive integer), found None")
        check_fencing_token(token)


def acquire(resource: str, owner: str, ttl: timedelta) -> int:
    """Take the lease on `resource` for `ttl`; returns a fencing token larger than any before.

    Succeeds when the resource is free, expired, or already held by `owner` (a re-acquire
    still gets a new, larger token). Raises LeaseHeld when another owner's lease is live.
    """
    _check_names(resource, owner)
    _check_ttl(ttl)
    with prepared_cursor() as cursor:
        cursor.execute("SELECT * FROM ledger_lease_acquire(%s, %s, %s)", [resource, owner, ttl])
        acquired, token, holder, expires_at = cursor.fetchone()
    if acquired:
        return token
    raise LeaseHeld(
        f"expected {resource} to be free or expired for {owner}, found it held by {holder} "
        f"(token {token}) until {expires_at.isoformat()}",
        owner=holder,
        expires_at=expires_at,
    )


def renew(resource: str, owner: str, token: int, ttl: timedelta):
    """Extend `owner`'s lease by `ttl` from now; returns the new expiry.

    Raises StaleFencingToken if `token` is no longer the current token of the resource.
    """
    _check_names(resource, owner, token)
    _check_ttl(ttl)
    with prepared_cursor() as cursor:
        cursor.execute("SELECT ledger_lease_renew(%s, %s, %s, %s)",
                       [resource, owner, token, ttl])
        expires_at = cursor.fetchone()[0]
    if expires_at is None:
        _raise_stale(resource, token, owner=owner)
    return expires_at


def release(resource: str, owner: str, token: int) -> None:
    """End the lease now. The row stays, so the next token is still larger."""
    _check_names(resource, owner, token)
    with prepared_cursor() as cursor:
        cursor.execute("SELECT ledger_lease_release(%s, %s, %s)", [resource, owner, token])
        released = cursor.fetchone()[0]
    if not released:
        _raise_stale(resource, token, owner=owner)


def check(resource: str, token: int) -> None:
    """Raise StaleFencingToken unless `token` is the resource's current token.

    Inside a transaction the lease row is share-locked until commit, so no newer token can
    be handed out before the caller's write commits.
    """
    _check_names(resource, None, token)
    with prepared_cursor() as cursor:
        cursor.execute(
            "SELECT token FROM ledger_lease WHERE resource = %s FOR SHARE", [resource]
        )
        row = cursor.fetchone()
    if row is None or row[0] != token:
        _raise_stale(resource, token, current=row[0] if row else None)


def check_run(run_pk: int, token: int | None) -> None:
    """The fence of every agent write to a run's operations, obligations, steps, facts and
    episodes.

    Once the run's lease `run:<tenant>:<run_id>` exists (taken by `runs.resume` or `acquire`, held,
    expired or released), the write must carry its current token: none, or an older one,
    raises StaleFencingToken. A run that was never leased is not fenced, unless a token is
    given (then there is no lease it could be current for). Inside a transaction the lease
    row is share-locked until commit, so no newer token can be handed out before the
    caller's write commits. PostgreSQL holds the same fence on its own: the write carries
    the token (the event's, the step's, the obligation's or the fact's `fencing_token`).
    """
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT l.token
              FROM ledger_lease l
              JOIN ledger_run r ON l.resource = {RUN_LEASE_WITH_PARAMS}
             WHERE r.id = %s
               FOR SHARE OF l
            """,
            [run_pk],
        )
        row = cursor.fetchone()
        if (row is None and token is None) or (row is not None and row[0] == token):
            return
        cursor.execute("SELECT tenant, run_id FROM ledger_run WHERE id = %s", [run_pk])
        tenant, run_id = cursor.fetchone()
    _raise_stale(run_lease_name(tenant, run_id), token, current=row[0] if row else None)


@contextmanager
def refused_as_stale() -> Iterator[None]:
    """PostgreSQL's own fence of a leased run's steps, obligations, facts and episodes (the
    triggers `step_fenced`, `step_added_fenced`, `obligation_fenced`,
    `obligation_opened_fenced`, `fact_fenced`, `episode_fenced`) refusing a write, as
    StaleFencingToken with the current token: what `check_run` raises before it, should a
    write reach the database without passing it."""
    try:
        yield
    except IntegrityError as exc:
        diag = getattr(exc.__cause__, "diag", None)
        if diag is None or diag.message_hint != FENCE_HINT:
            raise
        current = int(diag.message_detail) if diag.message_detail else None
        raise StaleFencingToken(diag.message_primary, current_token=current) from exc


def current_token(resource: str) -> int | None:
    _check_names(resource)
    with connection.cursor() as cursor:
        cursor.execute("SELECT token FROM ledger_lease WHERE resource = %s", [resource])
        row = cursor.fetchone()
    return row[0] if row else None


def _raise_stale(resource: str, token: int | None, *, owner: str | None = None,
                 current=...) -> None:
    if current is ...:
        current = current_token(resource)
    if token is None:
        raise StaleFencingToken(
            f"expected the current fencing token ({current}) of {resource} on a write to "
            f"its run, found none: once a run is leased every change to its operations, "
            "obligations, steps, facts and episodes carries the holder's token "
            "(runs.resume(...).token)",
            current_token=current,
        )
    who = f" held by {owner}" if owner else ""
    found = "no lease at all" if current is None else f"current token {current}"
    raise StaleFencingToken(
        f"expected fencing token {token}{who} to be current for {resource}, found {found}",
        current_token=current,
    )
