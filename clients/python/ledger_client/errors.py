"""The client's errors: one class per problem type of the ledger's API, and the client's own.

Every error is a `LedgerError`. A problem answered by the ledger (RFC 9457,
`application/problem+json`) becomes the class of its `type`, carrying `status`, `detail`
(the ledger's "expected ..., found ..."), the whole `problem`, and `operation` (a
`Receipt`) when the problem names one. Not reaching the ledger, or an answer that is not
the API's, is `LedgerUnavailable`.
"""

from __future__ import annotations

from typing import Any

PROBLEM_PREFIX = "urn:agent-ledger:problem:"


class LedgerError(Exception):
    """Every error of this client."""

    def __init__(self, message: str, *, operation: Any = None):
        super().__init__(message)
        self.operation = operation

    @property
    def tool_message(self) -> str:
        """What a model should read about this error as a tool's answer (see
        `ledger_client.tool_message`)."""
        from ledger_client.tools import tool_message

        return tool_message(self)


# --- what the decorator raises from the operation's state -------------------------------


class OutcomeUnknown(LedgerError):
    """The key was sent before and its effect is not proven (submitted, outcome_unknown,
    reconciling, manual_review): the function was not called. `.operation` is its
    receipt."""


class Rejected(LedgerError):
    """The key was rejected by the external system, or abandoned by a person: the function
    was not called (or it raised one of `rejections`, re-raised as itself)."""


class UnstorableResult(LedgerError):
    """The call succeeded but its return value could not be stored (not JSON, or above the
    ledger's size limit); `.value` holds it on the call that made it."""

    def __init__(self, message: str, *, operation: Any = None, value: Any = None):
        super().__init__(message, operation=operation)
        self.value = value


class InvalidInput(LedgerError, ValueError):
    """Refused before anything was sent: arguments that are not JSON, a malformed
    declaration, a key function that returned nothing usable. Also the ledger's
    `invalid-input` problem (its `detail` names the path)."""


class ConfigurationError(LedgerError, ValueError):
    """No ledger URL or agent key (give them, or set LEDGER_URL / LEDGER_AGENT_KEY)."""


# --- not reaching the ledger ------------------------------------------------------------


class LedgerUnavailable(LedgerError):
    """The ledger could not be reached, or did not answer as its API does. Raised before a
    call: the function was NOT called. `.cause` is the underlying error, if any."""

    def __init__(self, message: str, *, operation: Any = None, cause: BaseException | None = None):
        super().__init__(message, operation=operation)
        self.cause = cause


class ServerError(LedgerUnavailable):
    """The ledger answered 5xx (its `internal-error` problem, or a proxy's page)."""

    def __init__(self, message: str, *, status: int, problem: dict | None = None,
                 operation: Any = None):
        super().__init__(message, operation=operation)
        self.status = status
        self.problem = problem or {}


class UnexpectedResponse(LedgerUnavailable):
    """An answer that is not the API's: not JSON, or not the shape the API documents."""


class OutcomeNotRecorded(LedgerUnavailable):
    """The function WAS called, and the ledger could not record how it went within the
    client's retry budget. It is never called again for this key: the operation stays
    `submitted`, and the ledger's sweep turns it into outcome_unknown for reconciliation,
    as for a crashed sender. `.value` is the function's return value (if it returned),
    `.operation` the receipt as last known."""

    def __init__(self, message: str, *, operation: Any = None, value: Any = None,
                 cause: BaseException | None = None):
        super().__init__(message, operation=operation, cause=cause)
        self.value = value


# --- the API's problem types --------------------------------------------------------------


class ProblemError(LedgerError):
    """A problem the ledger answered. `status`, `detail`, `problem` (the whole body)."""

    slug = ""

    def __init__(self, message: str, *, status: int, problem: dict, operation: Any = None):
        super().__init__(message, operation=operation)
        self.status = status
        self.problem = problem
        self.detail = problem.get("detail", "")


class Unauthenticated(ProblemError):
    """401: no key, or a key that is malformed, unknown or revoked."""
    slug = "unauthenticated"


class PermissionDenied(ProblemError):
    """403: the key is not granted that tenant."""
    slug = "permission-denied"


class NotFound(ProblemError):
    """404: no such operation, run, obligation or route among the key's tenants."""
    slug = "not-found"


class InvalidRequest(ProblemError, InvalidInput):
    """422: the body does not match the API's schema (`problem["errors"]`)."""
    slug = "invalid-request"


class MalformedBody(ProblemError, InvalidInput):
    """400: the body is not JSON the server can read."""
    slug = "malformed-body"


class InvalidInputProblem(ProblemError, InvalidInput):
    """422: the ledger refused a value (its detail names the path)."""
    slug = "invalid-input"


class HTTPError(ProblemError):
    """Another HTTP refusal (wrong method, payload too large, ...)."""
    slug = "http-error"


class Refused(ProblemError):
    """409: refused by the ledger (a refusal without a more precise type)."""
    slug = "refused"


class IdempotencyKeyReused(Refused):
    """The key names an operation recorded with another intent (`.operation`)."""
    slug = "idempotency-key-reused"


class StaleVersion(Refused):
    """The operation moved on (`current_version`, `current_state`)."""
    slug = "stale-version"

    @property
    def current_state(self) -> str | None:
        return self.problem.get("current_state")

    @property
    def current_version(self) -> int | None:
        return self.problem.get("current_version")


class IllegalTransition(Refused):
    slug = "illegal-transition"


class StaleFencingToken(Refused):
    """A newer lease of the run exists (`current_token`): this worker was replaced."""
    slug = "stale-fencing-token"

    @property
    def current_token(self) -> int | None:
        return self.problem.get("current_token")


class LeaseHeld(Refused):
    """Another worker holds the run's lease (`holder`, `expires_at`)."""
    slug = "lease-held"


class AlreadyCommitted(Refused):
    """The obligation was committed before; `.result` is the winner's."""
    slug = "already-committed"

    @property
    def result(self) -> Any:
        return self.problem.get("result")


class StaleFact(Refused):
    slug = "stale-fact"


class DependencyNotMet(Refused):
    """A step this one depends on is not committed (`missing`)."""
    slug = "dependency-not-met"


class ApprovalRequired(Refused):
    """An approval policy asks for people's approval first (`approvals_needed`,
    `approvals_live`); the intent is recorded (`.operation`) and nothing was sent."""
    slug = "approval-required"


class ApprovalDenied(Refused):
    """A person denied the operation; `.reason` says why. Nothing was sent."""
    slug = "approval-denied"

    @property
    def reason(self) -> str | None:
        return self.problem.get("reason")


class ValidationRefused(Refused):
    """The operation kind's validator refused the intent before it was sent; `.reason`
    says why. The operation is recorded abandoned; nothing was sent."""
    slug = "validation-refused"

    @property
    def reason(self) -> str | None:
        return self.problem.get("reason")


class InFlight(OutcomeUnknown, Refused):
    """409 `idempotency-in-flight`: another caller is sending this key right now (the
    operation is submitted): the function was not called. Ask again after `retry_after`
    seconds for its outcome. A subclass of OutcomeUnknown, so code catching that keeps
    working; `.operation` is the receipt."""
    slug = "idempotency-in-flight"

    @property
    def retry_after(self) -> float:
        value = self.problem.get("retry_after")
        return float(value) if isinstance(value, int | float) else 1.0


class SecondPersonRequired(Refused):
    slug = "second-person-required"


class InternalError(ServerError):
    """500: the ledger failed to answer (it logged why)."""
    slug = "internal-error"


PROBLEM_TYPES: dict[str, type[LedgerError]] = {
    cls.slug: cls for cls in (
        Unauthenticated, PermissionDenied, NotFound, InvalidRequest, MalformedBody,
        InvalidInputProblem, HTTPError, Refused, IdempotencyKeyReused, StaleVersion,
        IllegalTransition, StaleFencingToken, LeaseHeld, AlreadyCommitted, StaleFact,
        DependencyNotMet, ApprovalRequired, ApprovalDenied, SecondPersonRequired,
        InFlight, InternalError, ValidationRefused,
    )
}
