"""The HTTP API at /api/v1/ (django-ninja): `Authorization: Bearer <agent key>`, JSON in
and out, every error an RFC 9457 `application/problem+json`.

Each endpoint parses its body, calls one function of `api.service` (the layer the MCP tools
share) and returns what it returns. Sessions never authenticate here, so CSRF does not
apply; the desk's login-required middleware lets these URLs through (`api.urls`).
"""

from __future__ import annotations

import logging
import re

from django.db import OperationalError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from ninja import NinjaAPI, Path, Query, Schema, Status
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.openapi.docs import Swagger
from ninja.security import HttpBearer
from pydantic import Field

from api import gate, problems, service
from api.schemas import (
    NAME_PATTERN,
    ApprovalRequestIn,
    CommitIn,
    FactIn,
    FactOut,
    FailedIn,
    Name,
    ObligationIn,
    ObligationOut,
    OperationApprovalOut,
    OperationDetailOut,
    OperationOut,
    OperationPage,
    Problem,
    RecordedOut,
    RecordIntentIn,
    ResumeIn,
    ResumeOut,
    RunIn,
    RunOut,
    StepIn,
    StepOut,
    SubmittedIn,
    SucceededIn,
)
from ledger import tracing
from ledger.errors import InFlight, InvalidInput, LedgerError

logger = logging.getLogger("ledger.api")
PROBLEM = "application/problem+json"
# The header of an answer served from a stored receipt (as the Agentic Commerce Protocol).
REPLAYED = "Idempotent-Replayed"
# The client's id of a submitting request, repeated on a retry after a lost answer.
REQUEST_ID = "Request-Id"
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._~:-]{16,200}")
# Every error an endpoint answers (all problem+json): malformed body, no or bad key, tenant
# not granted, not found, wrong method, refused by the ledger, body too large, not JSON,
# invalid input.
ERRORS = {frozenset({400, 401, 403, 404, 405, 409, 413, 415, 422}): Problem}


def _path(max_length: int):
    """A path parameter that names something: a name, as the ledger takes names."""
    return Path(..., min_length=1, max_length=max_length, pattern=NAME_PATTERN)


def _tenant_query():
    """`?tenant=`: the tenant of the run or obligation the path names, for a key granted
    several tenants that use the same id (ids are unique per tenant)."""
    return Query(None, min_length=1, max_length=100, pattern=NAME_PATTERN,
                 description="The tenant of the id, when the key's tenants share it.")


class AgentKeyAuth(HttpBearer):
    """The agent key in `Authorization: Bearer alk_...`; `request.auth` is the AgentKey."""

    openapi_description = "An agent key (manage.py agent_key create NAME --tenant T)."

    def authenticate(self, request: HttpRequest, token: str):
        # A path naming an operation: the key and that operation in one statement.
        match = request.resolver_match
        key = service.authenticate(
            token, operation_id=match.kwargs.get("operation_id") if match else None)
        if key is not None:
            gate.check(request)  # the body's size, type and shape, before ninja parses it
        return key


class ProblemAPI(NinjaAPI):
    def get_openapi_schema(self, **kwargs):
        """Error responses are documented as application/problem+json, as they are sent."""
        schema = super().get_openapi_schema(**kwargs)
        for path in schema["paths"].values():
            for operation in path.values():
                for status, response in operation.get("responses", {}).items():
                    content = response.get("content", {})
                    if str(status)[0] in "45" and "application/json" in content:
                        content[PROBLEM] = content.pop("application/json")
        return schema


api = ProblemAPI(
    title="Agent Ledger",
    version="1",
    description="The system of record for what agents did to the outside world. Every "
    "error is application/problem+json whose `detail` says what was expected and found.",
    auth=AgentKeyAuth(),
    urls_namespace="api-v1",
    docs=Swagger(),
    docs_url="/docs",
    openapi_url="/openapi.json",
)


def problem_response(body: dict, headers: dict | None = None) -> JsonResponse:
    response = JsonResponse(body, status=body["status"], content_type=PROBLEM)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


@api.exception_handler(LedgerError)
def ledger_error(request, exc):
    headers = None
    if isinstance(exc, InFlight):  # another caller is sending this key: ask again soon
        headers = {"Retry-After": str(problems.retry_after(exc))}
    return problem_response(problems.from_ledger_error(exc), headers=headers)


@api.exception_handler(gate.Refused)
def refused_by_gate(request, exc):
    return problem_response(exc.problem)


@api.exception_handler(ValidationError)
def validation_error(request, exc):
    errors = [{"loc": _where(e.get("loc", ())), "msg": e.get("msg", "")}
              for e in exc.errors[:50]]
    found = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in errors[:10])
    return problem_response(problems.problem(
        422, "invalid-request", "Invalid request",
        f"expected a request matching the API's schema, found {found}",
        errors=errors,
    ))


def _where(loc) -> list[str]:
    """["body", "body", "intent"] -> ["body", "intent"]: the parameter's name is noise."""
    parts = [str(part) for part in loc]
    if len(parts) > 2 and parts[1] in ("body", "filters"):
        del parts[1]
    return parts


@api.exception_handler(AuthenticationError)
def unauthenticated(request, exc):
    return problem_response(
        problems.problem(
            401, "unauthenticated", "Unauthenticated",
            "expected an Authorization: Bearer header with a live agent key, found "
            + ("none" if "authorization" not in request.headers else
               "a key that is malformed, unknown or revoked"),
        ),
        headers={"WWW-Authenticate": 'Bearer realm="agent-ledger"'},
    )


@api.exception_handler(HttpError)
def http_error(request, exc):
    if exc.status_code == 400:  # ninja's "Cannot parse request body (...)"
        return problem_response(problems.problem(
            400, "malformed-body", "Malformed body",
            f"expected a JSON object as the request body, found one that does not parse: "
            f"{exc.message}"))
    return problem_response(problems.problem(
        exc.status_code, "http-error", "HTTP error", str(exc.message)))


@api.exception_handler(Http404)
def not_found(request, exc):
    return problem_response(problems.problem(
        404, "not-found", "Not found", f"expected an API route, found none at {request.path}"))


@api.exception_handler(RecursionError)
def too_deep(request, exc):
    return problem_response(problems.problem(
        400, "malformed-body", "Malformed body",
        "expected a JSON body nested at most a few hundred levels deep, found deeper"))


@api.exception_handler(OperationalError)
def database_unavailable(request, exc):
    # The database did not answer: no connection free in the pool within its timeout, the
    # server down, or its answer lost (a failover). A write whose answer was lost may have
    # committed: the caller tries again with the same key and version, which finds it (the
    # clients treat a 5xx as "the ledger is unavailable", never as a refusal).
    logger.warning("database unavailable on %s %s: %s", request.method, request.path,
                   type(exc.__cause__ or exc).__name__)
    response = problem_response(problems.problem(
        503, "database-unavailable", "Database unavailable",
        "expected the ledger's database to answer, found no connection within the pool's "
        "timeout, the server down or its answer lost; try again shortly with the same "
        "idempotency key and expected version, which find what this request wrote, if "
        "anything"))
    response["Retry-After"] = "1"
    return response


@api.exception_handler(Exception)
def unexpected(request, exc):
    logger.exception("unexpected error on %s %s", request.method, request.path)
    return problem_response(problems.problem(
        500, "internal-error", "Internal error",
        "expected to answer the request, found an internal error; it has been logged"))


# --- operations --------------------------------------------------------------------------


@api.post("/operations", response={201: RecordedOut, 200: RecordedOut, **ERRORS},
          summary="Record an intent before the external call (and submit it: submit=true)")
def record_intent(request, response: HttpResponse, body: RecordIntentIn):
    """201 with a new planned operation; 200 with the existing one when the idempotency key
    and intent were recorded before (whatever its state: if it is not `planned`, do not
    send again), marked `Idempotent-Replayed: true` when it is answered from the stored
    receipt (not recorded, not submitted by this request); 409 when the key names an
    operation with another intent; with `submit: true`, 409 `idempotency-in-flight` (with
    Retry-After and the `operation`) while another caller is sending the key (submitted).

    With `submit: true` the operation is also marked submitted when it is planned or
    safe_to_retry, in the same request: `submitted_now` true means send now, false means
    do not (its state says why). A refusal of the submission is its problem (409), with
    the recorded operation as `operation`. A W3C `traceparent` header links a new
    operation to the caller's trace (`trace_id`, `span_id`).

    A `Request-Id` header (16 to 200 of `A-Z a-z 0-9 . _ ~ : -`, random per call) names the
    request: sent again after its answer was lost, a submission it made is answered again
    (`submitted_now` true, `request_repeated` true) instead of 409 in flight, so a lost
    answer never leaves a call its client did not make looking sent."""
    trace = tracing.from_traceparent(request.headers.get("traceparent"))
    request_id = request.headers.get(REQUEST_ID)
    if request_id is not None and not REQUEST_ID_PATTERN.fullmatch(request_id):
        raise InvalidInput(f"expected the {REQUEST_ID} header to be 16 to 200 of "
                           f"A-Z a-z 0-9 . _ ~ : -, found {request_id[:60]!r}")
    data, created = service.record_intent(request.auth, **body.dict(), trace=trace,
                                          request_id=request_id)
    data.setdefault("submitted_now", False)
    if not created and not data["submitted_now"]:
        response[REPLAYED] = "true"
    return Status(201 if created else 200, data)


@api.post("/operations/{operation_id}/submitted", response={200: OperationOut, **ERRORS},
          summary="planned (or safe_to_retry) -> submitted, just before sending")
def mark_submitted(request, operation_id: str = _path(40), *, body: SubmittedIn):
    return service.mark(request.auth, operation_id, "submitted", **body.dict())


@api.post("/operations/{operation_id}/succeeded", response={200: OperationOut, **ERRORS},
          summary="submitted -> succeeded: the external system confirmed it")
def mark_succeeded(request, operation_id: str = _path(40), *, body: SucceededIn):
    values = body.dict()
    if "result" not in body.model_fields_set:
        del values["result"]  # left out: no result recorded (null is a result)
    return service.mark(request.auth, operation_id, "succeeded", **values)


@api.post("/operations/{operation_id}/rejected", response={200: OperationOut, **ERRORS},
          summary="submitted -> rejected: the external system refused and did nothing")
def mark_rejected(request, operation_id: str = _path(40), *, body: FailedIn):
    return service.mark(request.auth, operation_id, "rejected", **body.dict())


@api.post("/operations/{operation_id}/outcome-unknown",
          response={200: OperationOut, **ERRORS},
          summary="submitted -> outcome_unknown: sent, but whether it took effect is unknown")
def mark_outcome_unknown(request, operation_id: str = _path(40), *, body: FailedIn):
    return service.mark(request.auth, operation_id, "outcome_unknown", **body.dict())


@api.post("/operations/{operation_id}/approval-request",
          response={200: OperationApprovalOut, **ERRORS},
          summary="Ask a person to approve a planned operation before it is sent")
def request_approval(request, operation_id: str = _path(40), *, body: ApprovalRequestIn):
    """The operation with its approval status. Poll GET operations/{id} until
    `approval.status` is `approved` (then send: submitted) or `denied` (do not). Asking
    again puts it back on the desk's list with the new note; 409 if it is not planned."""
    return service.request_approval(request.auth, operation_id, **body.dict())


@api.get("/operations/{operation_id}", response={200: OperationDetailOut, **ERRORS},
         summary="The receipt with its events and evidence")
def get_operation(request, operation_id: str = _path(40)):
    return service.get_operation(request.auth, operation_id)


class OperationFilters(Schema):
    state: Name(200) | None = None
    operation: Name(200) | None = None
    tenant: Name(100) | None = None
    cursor: Name(40) | None = None
    idempotency_key: Name(200) | None = None
    account: Name(200) | None = None
    limit: int = Field(default=50, ge=1, le=service.MAX_PAGE)


@api.get("/operations", response={200: OperationPage, **ERRORS},
         summary="Operations of the key's tenants, newest first, keyset-paged")
def list_operations(request, filters: Query[OperationFilters]):
    return service.list_operations(request.auth, **filters.dict())


# --- facts -------------------------------------------------------------------------------


@api.get("/facts", response={200: list[FactOut], **ERRORS},
         summary="The current version of every predicate of a subject")
def read_facts(request, subject: str = Query(..., min_length=1, max_length=500,
                                             pattern=NAME_PATTERN),
               tenant: str | None = Query(None, min_length=1, max_length=100,
                                          pattern=NAME_PATTERN),
               include_expired: bool = Query(
                   False, description="Also the current versions whose expiry has passed, "
                   "marked expired: true (left out by default: not to be acted on)")):
    return service.read_facts(request.auth, subject, tenant=tenant,
                              include_expired=include_expired)


@api.post("/facts", response={200: FactOut, **ERRORS},
          summary="Assert a fact; without the current version a different value is kept as "
          "a candidate for a person (is_candidate), never a silent overwrite")
def assert_fact(request, body: FactIn):
    return service.assert_fact(request.auth, **body.dict())


# --- runs and obligations ----------------------------------------------------------------


@api.post("/runs", response={200: RunOut, **ERRORS}, summary="Start a run (idempotent on run_id)")
def start_run(request, body: RunIn):
    return service.start_run(request.auth, **body.dict())


@api.post("/runs/{run_id}/steps", response={200: StepOut, **ERRORS},
          summary="Add a step (idempotent), depending on steps already added")
def add_step(request, run_id: str = _path(100), *, body: StepIn,
             tenant: str | None = _tenant_query()):
    """Once the run is leased, only with its lease's current `fencing_token`: none, or an
    older one, is 409 stale-fencing-token and adds nothing."""
    return service.add_step(request.auth, run_id, tenant=tenant, **body.dict())


@api.post("/runs/{run_id}/resume", response={200: ResumeOut, **ERRORS},
          summary="Take the run's lease; `token` fences every later write")
def resume(request, run_id: str = _path(100), *, body: ResumeIn,
           tenant: str | None = _tenant_query()):
    return service.resume(request.auth, run_id, tenant=tenant, **body.dict())


@api.post("/obligations", response={200: ObligationOut, **ERRORS},
          summary="Open an obligation of a run (idempotent on key)")
def open_obligation(request, body: ObligationIn):
    values = body.dict()
    values["obligation_key"] = values.pop("key")
    return service.open_obligation(request.auth, **values)


@api.post("/obligations/{key}/commit", response={200: ObligationOut, **ERRORS},
          summary="Commit an obligation exactly once; 409 carries the winner's result")
def commit_obligation(request, key: str = _path(200), *, body: CommitIn,
                      tenant: str | None = _tenant_query()):
    return service.commit_obligation(request.auth, key, tenant=tenant, **body.dict())
