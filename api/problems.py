"""The ledger's errors as RFC 9457 problem details, for every network surface.

A problem names its kind (`type`, a stable URN; `title`), the HTTP status, and in `detail`
the ledger's own message ("expected ..., found ..."). A few errors carry what the caller
needs to go on: the winner's result of an obligation, the current version of an operation,
the current fencing token, the lease holder, the missing steps.
"""

from __future__ import annotations

from typing import Any

from ledger import errors, shapes

# (status, slug, title) per ledger error; the first matching class in this order wins.
KINDS: list[tuple[type[Exception], int, str, str]] = [
    (errors.NotFound, 404, "not-found", "Not found"),
    (errors.PermissionDenied, 403, "permission-denied", "Permission denied"),
    (errors.InvalidInput, 422, "invalid-input", "Invalid input"),
    (errors.InFlight, 409, "idempotency-in-flight", "Idempotency key in flight"),
    (errors.IdempotencyKeyReused, 409, "idempotency-key-reused", "Idempotency key reused"),
    (errors.StaleVersion, 409, "stale-version", "Stale version"),
    (errors.IllegalTransition, 409, "illegal-transition", "Illegal transition"),
    (errors.StaleFencingToken, 409, "stale-fencing-token", "Stale fencing token"),
    (errors.LeaseHeld, 409, "lease-held", "Lease held"),
    (errors.AlreadyCommitted, 409, "already-committed", "Already committed"),
    (errors.StaleFact, 409, "stale-fact", "Stale fact"),
    (errors.DependencyNotMet, 409, "dependency-not-met", "Dependency not met"),
    (errors.ApprovalRequired, 409, "approval-required", "Approval required"),
    (errors.ApprovalDenied, 409, "approval-denied", "Approval denied"),
    (errors.ValidationRefused, 409, "validation-refused", "Refused by the validator"),
    (errors.SecondPersonRequired, 409, "second-person-required", "Second person required"),
    (errors.LedgerError, 409, "refused", "Refused by the ledger"),
]


def retry_after(exc: errors.InFlight) -> int:
    """Whole seconds to wait before asking again about a call in flight (Retry-After)."""
    return max(1, int(-(-exc.retry_after // 1)))


def type_uri(slug: str) -> str:
    return f"urn:agent-ledger:problem:{slug}"


def problem(status: int, slug: str, title: str, detail: str, **extra: Any) -> dict[str, Any]:
    return {"type": type_uri(slug), "title": title, "status": status, "detail": detail,
            **extra}


def from_ledger_error(exc: errors.LedgerError) -> dict[str, Any]:
    """The problem for a ledger refusal, with what the caller needs to go on."""
    status, slug, title = next(
        (status, slug, title) for cls, status, slug, title in KINDS if isinstance(exc, cls)
    )
    extra: dict[str, Any] = {"error": type(exc).__name__}
    if isinstance(exc, errors.AlreadyCommitted):
        extra["result"] = exc.result
    elif isinstance(exc, errors.StaleVersion) and exc.current is not None:
        extra["current_version"] = exc.current.version
        extra["current_state"] = exc.current.state
    elif isinstance(exc, errors.IdempotencyKeyReused) and exc.existing is not None:
        existing = exc.existing
        if hasattr(existing, "operation_id"):
            extra["operation"] = shapes.operation(existing)
    elif isinstance(exc, errors.StaleFencingToken):
        extra["current_token"] = exc.current_token
    elif isinstance(exc, errors.LeaseHeld):
        extra["holder"] = exc.owner
        extra["expires_at"] = shapes.iso(exc.expires_at)
    elif isinstance(exc, errors.DependencyNotMet):
        extra["missing"] = list(exc.missing)
    elif isinstance(exc, errors.ApprovalRequired):
        extra["approvals_needed"], extra["approvals_live"] = exc.needed, exc.have
    elif isinstance(exc, errors.ApprovalDenied | errors.ValidationRefused):
        extra["reason"] = exc.reason
        if isinstance(exc, errors.ValidationRefused) and exc.operation is not None:
            extra["operation"] = shapes.operation(exc.operation)
    elif isinstance(exc, errors.InFlight):
        extra["retry_after"] = retry_after(exc)
    recorded = getattr(exc, "operation_recorded", None)
    if recorded is not None:  # POST operations with submit: the intent stays recorded
        extra["operation"] = recorded
    return problem(status, slug, title, str(exc), **extra)
