"""Request and response bodies of the HTTP API (their JSON schemas are the OpenAPI's).

Request bodies live here; response bodies are the ledger's JSON shapes (`ledger.shapes`,
re-exported below), the ones the MCP tools and the resume view return too. Only shapes:
every rule (lengths, names, JSON limits, states) is the ledger's, checked when the ledger
function is called. The request shapes say as much of those rules as a JSON schema can (a
name is non-empty, without control characters or surrounding whitespace, and no longer
than the ledger takes), so that a request the published schema calls valid is not refused
for a reason it does not state.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from ninja import Schema
from pydantic import BeforeValidator, ConfigDict, Field

from ledger.shapes import (
    ApprovalOut,
    EventOut,
    EvidenceOut,
    FactOut,
    ObligationOut,
    OperationApprovalOut,
    OperationDetailOut,
    OperationOut,
    OperationPage,
    RecordedOut,
    ResumeOut,
    RunOut,
    StepOut,
)

__all__ = [
    "ApprovalOut", "ApprovalRequestIn", "CommitIn", "EventOut", "EvidenceOut", "FactIn",
    "FactOut", "FailedIn", "ObligationIn", "ObligationOut", "OperationApprovalOut",
    "OperationDetailOut", "OperationOut", "OperationPage", "Problem", "RecordedOut",
    "RecordIntentIn",
    "ResumeIn", "ResumeOut", "RunIn", "RunOut", "StepIn", "StepOut", "SubmittedIn",
    "SucceededIn",
]

RetryPolicyName = Literal["never", "if_absent_proven"]

# What `ledger.inputs.check_identifier` takes: no C0/C1 control characters, no line or
# paragraph separators, no whitespace at either end, at least one character.
_NAME_CHAR = r"[^\x00-\x1f\x7f-\x9f\u2028\u2029]"
_NAME_EDGE = r"[^\s\x00-\x1f\x7f-\x9f\u2028\u2029]"
NAME_PATTERN = f"^{_NAME_EDGE}(?:{_NAME_CHAR}*{_NAME_EDGE})?$"


def Name(max_length: int, description: str | None = None) -> Any:
    """A name of at most `max_length` characters, as the ledger takes names."""
    return Annotated[str, Field(min_length=1, max_length=max_length, pattern=NAME_PATTERN,
                                description=description)]


def _no_bool_or_text(value: Any) -> Any:
    if isinstance(value, bool | str):
        raise ValueError(f"expected a number, found {value!r}")
    return value


# `true` is not 1 and "2" is not 2 (pydantic's lax mode takes both); 2.0 is 2, as JSON
# Schema's integer type says.
Number = BeforeValidator(_no_bool_or_text)


# Integer bounds are PostgreSQL's: versions are `integer`, fencing tokens `bigint`.
VersionNumber = Annotated[int, Field(ge=1, le=2**31 - 1), Number]
TokenNumber = Annotated[int, Field(ge=0, le=2**63 - 1), Number]
Seconds = Annotated[float, Field(gt=0, le=86400), Number]


def _version() -> Any:
    return Field(default=None, description="The version you acted on; 409 if it moved on.")


def _token() -> Any:
    return Field(default=None,
                 description="The run lease's fencing token (POST runs/{run_id}/resume).")


class Problem(Schema):
    """RFC 9457 problem details; `detail` carries the ledger's message."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str


class FactRef(Schema):
    subject: str
    predicate: str
    version: int = Field(ge=1, description="The version the action was planned on.")


class RecordIntentIn(Schema):
    # Its own pattern is left to the ledger, whose refusal shows a name that would do.
    operation: Annotated[str, Field(
        min_length=1, max_length=200, description="What the call does, e.g. articles.create.")]
    target: Name(2000, "Where it goes, e.g. a URL (credentials are redacted).")
    account: Name(200, "Which account at the provider the call acts as (a Stripe account, "
                  "a mailbox, the provider's tenant): a non-secret label; reconcilers read "
                  "as it.") | None = None
    intent: dict[str, Any] = Field(description="The request you are about to send.")
    idempotency_key: Name(200) | None = None
    tenant: Name(100, "Default: the key's only tenant.") | None = None
    run: Name(100, "A run_id of the key's tenants.") | None = None
    step: Name(100, "A step_id of the run; without an idempotency_key the key derives "
               "from the run and step.") | None = None
    call: Name(200, "Tells apart several calls of one operation in one step (with run "
               "and step, without a key).") | None = None
    retry_policy: RetryPolicyName = "if_absent_proven"
    redact: list[str] = Field(default_factory=list, description="Dotted paths to redact.")
    fingerprint_fields: list[str] | None = None
    keep: list[str] | None = Field(
        default=None, description="Dotted paths: only these fields of the intent are stored "
        "and fingerprinted; the rest never reach the ledger's database.")
    submit: bool = Field(default=False, description="Also mark it submitted in the same "
                         "request when it is planned or safe_to_retry (a lifecycle in two "
                         "round trips): `submitted_now` says whether this request did; a "
                         "refusal of the submission (approval, fencing, dependencies) is "
                         "its problem, with the recorded `operation`.")
    fencing_token: TokenNumber | None = Field(
        default=None, description="With submit: the run lease's token.")
    in_flight_seconds: Seconds | None = Field(
        default=None,
        description="With submit: how long the request may still land after a timeout.")
    relies_on: list[FactRef] = Field(
        default_factory=list, description="The fact versions the action was planned on: "
        "once one is superseded, submitting it is refused (409 stale-fact).")


class SubmittedIn(Schema):
    expected_version: VersionNumber | None = _version()
    fencing_token: TokenNumber | None = _token()
    in_flight_seconds: Seconds | None = Field(
        default=None, description="How long the request may still land after a timeout.")


class SucceededIn(Schema):
    external_id: Name(500) | None = None
    evidence: Any = None
    result: Any = Field(default=None, description="The call's return value, stored "
                        "(redacted) and returned to a later call of the same key.")
    result_unstorable: str = Field(default="", max_length=300, description="Why the "
                                   "caller could not send the result (it is not stored).")
    expected_version: VersionNumber | None = _version()
    fencing_token: TokenNumber | None = _token()


class FailedIn(Schema):
    error_code: Name(200)
    detail: str = ""
    expected_version: VersionNumber | None = _version()
    fencing_token: TokenNumber | None = _token()


class ApprovalRequestIn(Schema):
    note: str = Field(default="", description="What the reviewer should know (context, "
                      "why it is needed); secrets are masked.")


class FactIn(Schema):
    subject: Name(500)
    predicate: Name(200)
    value: Any
    source: Name(400, "Stored after the key's name.") | None = None
    observed_at: datetime | None = None
    expected_version: VersionNumber | None = _version()
    tenant: Name(100) | None = None
    run: Name(100) | None = None
    fencing_token: TokenNumber | None = _token()
    expires_at: datetime | None = Field(
        default=None, description="When the fact stops being current (ISO 8601 with a time "
        "zone); not with ttl_seconds.")
    ttl_seconds: Annotated[float, Field(gt=0, le=315360000), Number] | None = Field(
        default=None, description="Seconds from now until the fact stops being current; "
        "not with expires_at.")


class RunIn(Schema):
    objective: str = Field(min_length=1, pattern=r"\S")
    tenant: Name(100) | None = None
    run_id: Name(100) | None = None


class StepIn(Schema):
    step_id: Name(100)
    depends_on: list[Name(100)] = Field(default_factory=list)
    fencing_token: TokenNumber | None = _token()


class ResumeIn(Schema):
    ttl_seconds: Seconds | None = Field(
        default=None, description="How long the lease lasts without a renewal.")
    worker: Name(100, "Which worker of the key takes the lease: it is held as "
                 "<key name>/<worker>.") | None = None


class ObligationIn(Schema):
    run: Name(100)
    kind: Name(200)
    key: Name(200)
    deadline: datetime | None = None
    fencing_token: TokenNumber | None = _token()
    tenant: Name(100, "The run's tenant, when the key's tenants share its id.") | None = None


class CommitIn(Schema):
    result: Any = None
    fencing_token: TokenNumber | None = _token()

