"""Every error the ledger raises. Each message says what was expected and what was found."""

from __future__ import annotations


class LedgerError(Exception):
    """Base class of every error raised by the ledger API."""


class InvalidInput(LedgerError, ValueError):
    """An argument was refused before anything was written."""


class IllegalTransition(LedgerError):
    """The state table does not allow this change from the operation's state."""

    def __init__(self, message: str, *, from_state: str = "", to_state: str = ""):
        super().__init__(message)
        self.from_state = from_state
        self.to_state = to_state


class StaleVersion(LedgerError):
    """Someone else changed the row since it was read (compare-and-set lost)."""

    def __init__(self, message: str, *, current=None, last_event=None):
        super().__init__(message)
        self.current = current
        self.last_event = last_event


class IdempotencyKeyReused(LedgerError):
    """The idempotency key already names an operation with another intent."""

    def __init__(self, message: str, *, existing=None):
        super().__init__(message)
        self.existing = existing


class LeaseHeld(LedgerError):
    """Another owner holds a live lease on the resource."""

    def __init__(self, message: str, *, owner: str = "", expires_at=None):
        super().__init__(message)
        self.owner = owner
        self.expires_at = expires_at


class StaleFencingToken(LedgerError):
    """A newer fencing token exists for the resource; the write was refused."""

    def __init__(self, message: str, *, current_token: int | None = None):
        super().__init__(message)
        self.current_token = current_token


class StaleFact(LedgerError):
    """The fact was superseded; `.current` is the current version (or None)."""

    def __init__(self, message: str, *, current=None):
        super().__init__(message)
        self.current = current


class AlreadyCommitted(LedgerError):
    """The obligation was committed before; `.result` is the winner's result."""

    def __init__(self, message: str, *, result=None, obligation=None):
        super().__init__(message)
        self.result = result
        self.obligation = obligation


class DependencyNotMet(LedgerError):
    """A step cannot start until every step it depends on is committed."""

    def __init__(self, message: str, *, missing=()):
        super().__init__(message)
        self.missing = tuple(missing)


class PermissionDenied(LedgerError):
    """The acting user lacks the permission or the tenant grant for this action."""


class RefusedByRole(PermissionDenied):
    """PostgreSQL refused the statement on role grounds (SQLSTATE 42501: a role trigger of
    migration 0030, a missing grant, an append-only rule): the session's role may not do
    this. The message is PostgreSQL's (the triggers say what they expected and found);
    `sqlstate` is "42501". `ledger.db_roles` raises it, as a subclass that is also Django's
    DatabaseError, so that code handling database errors keeps seeing one."""

    sqlstate = "42501"


class NotFound(LedgerError, LookupError):
    """No such object among the tenants the caller may see (an invisible object is
    reported exactly like a missing one: the desk and the API answer 404)."""


class OutcomeUnknown(LedgerError):
    """An action's earlier call was sent, but its effect is not proven yet (the operation
    waits for the reconciler or a person); `.operation` is the receipt. Do not send again."""

    def __init__(self, message: str, *, operation=None):
        super().__init__(message)
        self.operation = operation


# Seconds a caller finding a key in flight is told to wait before asking again.
IN_FLIGHT_RETRY_AFTER = 1.0


class InFlight(OutcomeUnknown):
    """An action's key is being sent right now by another caller (the operation is
    `submitted`, its sender still at work): wait and call again for its outcome; do not
    send. A subclass of OutcomeUnknown, so code that handles that keeps working; `.operation`
    is the receipt, `.retry_after` the seconds to wait before asking again."""

    def __init__(self, message: str, *, operation=None,
                 retry_after: float = IN_FLIGHT_RETRY_AFTER):
        super().__init__(message, operation=operation)
        self.retry_after = retry_after

    @classmethod
    def of(cls, op) -> InFlight:
        """The refusal of a call of `op`'s key, found `submitted`: every caller (a decorated
        action in process, the HTTP API, the MCP tools) is told it in these words."""
        since = f" since {op.submitted_at.isoformat()}" if op.submitted_at else ""
        return cls(
            f"expected operation {op.operation_id} ({op.operation}, key {op.idempotency_key}) "
            f"planned or safe_to_retry to send it, found it submitted{since}: another caller "
            "is sending it now (or stopped before reporting; the sweep then hands it to "
            f"reconciliation); it is not sent again, ask again in {IN_FLIGHT_RETRY_AFTER:g} s "
            "for its outcome",
            operation=op,
        )


class Rejected(LedgerError):
    """The external system refused this action's key before; `.operation.error_code` is the
    recorded code. Sending the same intent again would be refused again."""

    def __init__(self, message: str, *, operation=None):
        super().__init__(message)
        self.operation = operation


class UnstorableResult(LedgerError):
    """The action succeeded (recorded as such) but its return value could not be stored as
    the operation's result (not JSON, or too large); `.value` is the value itself, so
    nothing is lost (None on a later call: it was never stored)."""

    def __init__(self, message: str, *, operation=None, value=None):
        super().__init__(message)
        self.operation = operation
        self.value = value


class ApprovalRequired(LedgerError):
    """The operation may not be submitted yet: an approval policy (or the agent's own
    request) asks for more live approvals of its current intent than it has. `.needed` and
    `.have` count people; wait (`ledger.approvals.wait`) or ask (`approvals.request`)."""

    def __init__(self, message: str, *, operation=None, needed: int = 0, have: int = 0):
        super().__init__(message)
        self.operation = operation
        self.needed = needed
        self.have = have


class ValidationRefused(LedgerError):
    """The operation kind's validator refused the intent before it was sent
    (`ledger.validation`): the operation is recorded abandoned with the reason
    (`.reason`, `.operation`), and nothing was sent. Sending it as it is would be refused
    again."""

    def __init__(self, message: str, *, reason: str = "", operation=None):
        super().__init__(message)
        self.reason = reason
        self.operation = operation


class ApprovalDenied(LedgerError):
    """A person denied the operation's approval: it is abandoned and must not be sent.
    `.reason` is theirs."""

    def __init__(self, message: str, *, reason: str = "", operation=None):
        super().__init__(message)
        self.reason = reason
        self.operation = operation


class SecondPersonRequired(LedgerError):
    """This person already approved this intent, or proposed this resolution: the next
    step must be someone else's (two-person rule)."""


class ClaimHeld(LedgerError):
    """Another reviewer holds a live claim on the operation (`ledger.claims`)."""

    def __init__(self, message: str, *, holder: str = "", expires_at=None):
        super().__init__(message)
        self.holder = holder
        self.expires_at = expires_at
