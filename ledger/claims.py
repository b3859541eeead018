"""Claims and notes: the desk's coordination between reviewers of one operation.

`claim` says "Ada is looking at this" for CLAIM_TTL; others see it in the queue and on the
operation's page, and their own claim is refused naming Ada until it expires or she
releases it. A claim decides nothing: any reviewer may still resolve the operation (the
version check settles races). While it lasts it pauses automatic reconciliation of the
operation: the reconciler does not claim an `outcome_unknown` operation a person has
claimed (`ledger.reconcile`), and says so once per claim in its log (`paused_by_claims`).
`add_note` appends a person's note to the operation's timeline; notes are append-only,
like the events beside them.

Claiming, releasing and writing notes need `ledger.resolve_operation` and a grant for the
operation's tenant; reading notes needs only what reading the operation needs.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import connection, transaction
from django.utils import timezone

from ledger import access
from ledger.canonical import scrub_text
from ledger.errors import ClaimHeld, InvalidInput
from ledger.inputs import check_user, storable_text
from ledger.models import Claim, Operation, OperationNote

CLAIM_TTL = timedelta(minutes=15)
NOTE_MAX_LENGTH = 4000

# Take the operation's claim if it is free, expired, or already the user's (then renewed);
# zero rows back means someone else holds a live one. One statement: two reviewers
# claiming at once cannot both win.
_TAKE_CLAIM = """
INSERT INTO ledger_claim (operation_id, tenant, claimed_by_id, claimed_by_name,
                          claimed_at, expires_at)
VALUES (%s, %s, %s, %s, %s, %s)
ON CONFLICT (operation_id) DO UPDATE
   SET claimed_by_id = EXCLUDED.claimed_by_id, claimed_by_name = EXCLUDED.claimed_by_name,
       claimed_at = EXCLUDED.claimed_at, expires_at = EXCLUDED.expires_at
 WHERE ledger_claim.claimed_by_id = EXCLUDED.claimed_by_id
    OR ledger_claim.expires_at <= EXCLUDED.claimed_at
RETURNING id
"""


def _check_reviewer(op: Operation, user, doing: str) -> None:
    check_user(user, doing)
    access.require_perm(user, "ledger.resolve_operation", doing=doing)
    access.require_tenant(user, op.tenant)


def claim(op: Operation, *, user, now: datetime | None = None) -> Claim:
    """Claim `op` for `user` until `now` + CLAIM_TTL (re-claiming renews one's own claim).

    Raises ClaimHeld (naming the holder and until when) if another reviewer's claim is
    live, PermissionDenied without `ledger.resolve_operation` or the tenant's grant.
    """
    _check_reviewer(op, user, "claim an operation")
    now = now or timezone.now()
    name = user.get_username()
    with transaction.atomic(durable=True), connection.cursor() as cursor:
        cursor.execute(_TAKE_CLAIM, [op.pk, op.tenant, user.pk, name, now, now + CLAIM_TTL])
        taken = cursor.fetchone()
        held = Claim.objects.get(operation=op)
    if taken is None:
        raise ClaimHeld(
            f"expected operation {op.operation_id} to be unclaimed, or claimed by "
            f"{name}, found it claimed by {held.claimed_by_name} until "
            f"{held.expires_at:%Y-%m-%d %H:%M:%S} UTC",
            holder=held.claimed_by_name, expires_at=held.expires_at,
        )
    return held


def release(op: Operation, *, user, now: datetime | None = None) -> bool:
    """Give up `user`'s claim on `op`; returns whether there was one. An expired claim of
    anyone's is cleared too. Raises ClaimHeld if another reviewer's claim is live."""
    _check_reviewer(op, user, "release a claim")
    now = now or timezone.now()
    with transaction.atomic(durable=True):
        held = Claim.objects.select_for_update().filter(operation=op).first()
        if held is None:
            return False
        if held.claimed_by_id != user.pk and held.expires_at > now:
            raise ClaimHeld(
                f"expected a claim of {user.get_username()} on operation {op.operation_id} "
                f"to release, found {held.claimed_by_name}'s until "
                f"{held.expires_at:%Y-%m-%d %H:%M:%S} UTC",
                holder=held.claimed_by_name, expires_at=held.expires_at,
            )
        held.delete()
        return held.claimed_by_id == user.pk


def live_claim(op: Operation, *, now: datetime | None = None) -> Claim | None:
    """The claim on `op` that has not expired at `now`, or None. One query."""
    now = now or timezone.now()
    return Claim.objects.filter(operation=op, expires_at__gt=now).first()


def paused_by_claims(*, now: datetime | None = None, limit: int = 100) -> list[Claim]:
    """The live claims that keep an `outcome_unknown` operation from the reconciler at
    `now` (whose next attempt has come), oldest claim first, at most `limit`. One query;
    the reconciler logs them."""
    now = now or timezone.now()
    return list(
        Claim.objects.filter(expires_at__gt=now, operation__state="outcome_unknown")
        .exclude(operation__next_attempt_at__gt=now)
        .select_related("operation").order_by("claimed_at", "id")[:limit]
    )


def add_note(op: Operation, *, user, text: str, now: datetime | None = None) -> OperationNote:
    """Append `user`'s note to `op`'s timeline. The text is made storable (cut at
    NOTE_MAX_LENGTH characters) and credentials in it are redacted; an empty note is
    refused (InvalidInput). Notes are never edited or deleted (the database refuses)."""
    _check_reviewer(op, user, "write a note")
    if not isinstance(text, str) or not text.strip():
        raise InvalidInput(f"expected a non-empty note, found {text!r}")
    text = scrub_text(storable_text(text.strip(), "note", NOTE_MAX_LENGTH))
    with transaction.atomic(durable=True):
        return OperationNote.objects.create(
            operation=op, tenant=op.tenant, author=user, author_name=user.get_username(),
            text=text, created_at=now or timezone.now(),
        )
