"""Agent Ledger's Python client: the ledger's agent API over HTTP, never importing Django.

    from ledger_client import Ledger
    ledger = Ledger("https://ledger.example", key="alk_...")  # or LEDGER_URL, LEDGER_AGENT_KEY

    @ledger.action("articles.create", target="https://cms.example/api/articles",
                   key=lambda article: article["slug"], external_id=lambda r: r["id"])
    def create_article(article: dict) -> dict: ...
"""

from ledger_client.client import Ledger, step_key
from ledger_client.errors import (
    AlreadyCommitted,
    ApprovalDenied,
    ApprovalRequired,
    ConfigurationError,
    DependencyNotMet,
    HTTPError,
    IdempotencyKeyReused,
    IllegalTransition,
    InFlight,
    InternalError,
    InvalidInput,
    InvalidInputProblem,
    InvalidRequest,
    LeaseHeld,
    LedgerError,
    LedgerUnavailable,
    MalformedBody,
    NotFound,
    OutcomeNotRecorded,
    OutcomeUnknown,
    PermissionDenied,
    ProblemError,
    Refused,
    Rejected,
    SecondPersonRequired,
    ServerError,
    StaleFact,
    StaleFencingToken,
    StaleVersion,
    Unauthenticated,
    UnexpectedResponse,
    UnstorableResult,
    ValidationRefused,
)
from ledger_client.receipt import Receipt
from ledger_client.tools import tool_message

__all__ = [
    "AlreadyCommitted", "ApprovalDenied", "ApprovalRequired", "ConfigurationError",
    "DependencyNotMet", "HTTPError", "IdempotencyKeyReused", "IllegalTransition", "InFlight",
    "InternalError", "InvalidInput", "InvalidInputProblem", "InvalidRequest", "LeaseHeld",
    "Ledger", "LedgerError", "LedgerUnavailable", "MalformedBody", "NotFound",
    "OutcomeNotRecorded", "OutcomeUnknown", "PermissionDenied", "ProblemError", "Receipt",
    "Refused", "Rejected", "SecondPersonRequired", "ServerError", "StaleFact",
    "StaleFencingToken", "StaleVersion", "Unauthenticated", "UnexpectedResponse",
    "UnstorableResult", "ValidationRefused", "step_key", "tool_message",
]
