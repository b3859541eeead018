"""The JSON shapes of the ledger's nouns: what every front end that speaks JSON returns.

One pydantic model per noun describes its JSON, and one function beside it turns a row into
that JSON (times in ISO 8601, `iso`): the HTTP API declares its responses with the models,
so its OpenAPI document is generated from them, and the MCP tools, the hand-off view of
`runs.resume` and the desk's audit export return the functions' output. Each function is
derived from its model (`_shape`, `_shaped`): a key is written once, in the model; the
function reads the row's attribute of that name and converts it by the field's type (a
`Time` through `iso`, a nested shape through its function), and only a field read another
way is named beside the model, once. tests/api/test_shapes.py holds every function to its
model and to the OpenAPI document. A shape changes here, in one place, or not at all:
clients are built on it.

Functions read only what their row has loaded (a relation used is named in the
docstring, for the caller to `select_related`); they never query on their own."""

from __future__ import annotations

import functools
import inspect
import linecache
from collections.abc import Callable, Iterable
from datetime import datetime
from types import NoneType, UnionType
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

from ledger import states

if TYPE_CHECKING:
    from ledger.models import (
        Evidence,
        Fact,
        FactConflict,
        Obligation,
        Operation,
        OperationEvent,
        Run,
        Step,
    )
    from ledger.selectors.approvals import ApprovalStatus, Gate


def iso(value: datetime | None) -> str | None:
    """A time as ISO 8601 with its offset; None stays None."""
    return value.isoformat() if value is not None else None


# --- how a shape's function is derived from its model -------------------------------------


class _Mark:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


# A time field: the row holds a datetime, the shape sends `iso(...)` of it. Pydantic keeps
# the mark as metadata and the schema says string, as before.
_ISO = _Mark("ISO")
Time = Annotated[str, _ISO]
TimeOrNone = Annotated[str | None, _ISO]

# A field's source: the caller passes the value, as a keyword of the field's name.
GIVEN: Any = _Mark("GIVEN")

_SHAPES: dict[type[BaseModel], Callable[..., dict[str, Any]]] = {}


def _shaped(model: type[BaseModel], *, like: Callable[..., dict[str, Any]] | None = None,
            **sources: Any) -> Callable[[Callable[..., Any]], Callable[..., dict[str, Any]]]:
    """Make the decorated function (a signature and a docstring, no body) `model`'s shape:
    `_shape(model, like=like, declared=function, **sources)`."""
    return lambda declared: _shape(model, like=like, declared=declared, **sources)


def _shape(model: type[BaseModel], *, like: Callable[..., dict[str, Any]] | None = None,
           declared: Callable[..., Any] | None = None,
           **sources: Any) -> Callable[..., dict[str, Any]]:
    """The function that turns a row into `model`'s dict: a key per field, in the model's
    order, each the row's attribute of the field's name.

    `sources` names only the exceptions, each once: a dotted path of the row's attributes
    (`recorded_at="created_at"`, `tenant="run.tenant"`), GIVEN (the caller passes the value
    as a keyword of the field's name), or a function of the row, whose value is taken as it
    is. What a name or a path reads, or the caller gives, is converted by the field's type:
    a `Time` goes through `iso`; a shape, a list of shapes, or a shape or None through that
    shape's function (derived before this one). `like`: the shape this model extends, whose
    exceptions hold here too. A source that names no field is refused, here.

    `declared`: a function with the shape's name, signature and docstring and no body (see
    `_shaped`), which the shape becomes: its first parameter is the row, each keyword-only
    one a field GIVEN (with its default), and it is called without a layer between.

    Compiled once, at import, into one dict display, the code the function would be if
    written by hand: a row costs what it cost by hand, and no pydantic model is built per
    row. The code is the function's `code` (its lines show in tracebacks).
    """
    if like is not None:
        sources = {**like.sources, **sources}
    fields = model.model_fields
    name, row, given = f"{model.__name__}_shape", "row", []
    if declared is not None:
        name = declared.__name__
        parameters = inspect.signature(declared).parameters.values()
        rows = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
        if len(rows) != 1 or len(rows) + sum(p.kind is p.KEYWORD_ONLY for p in parameters) \
                != len(parameters):
            raise TypeError(f"expected {name} to take its row and keyword-only fields, found "
                            f"({', '.join(map(str, parameters))})")
        row = rows[0]
        given = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY]
        sources = {**sources, **dict.fromkeys(given, GIVEN)}
    if unknown := sorted(set(sources) - set(fields)):
        raise TypeError(f"expected sources for fields of {model.__name__}, found {unknown} "
                        f"(its fields: {', '.join(fields)})")
    namespace: dict[str, Any] = {"iso": iso}
    items: list[str] = []
    for field_name, field in fields.items():
        source = sources.get(field_name, field_name)
        if source is GIVEN:
            value = _converted(field_name, field, field_name, namespace)
        elif isinstance(source, str):
            if not all(part.isidentifier() for part in source.split(".")):
                raise TypeError(f"expected a dotted attribute path for {model.__name__}."
                                f"{field_name}, found {source!r}")
            value = _converted(f"{row}.{source}", field, field_name, namespace)
        elif callable(source):
            namespace[f"_get_{field_name}"] = source
            value = f"_get_{field_name}({row})"
        else:
            raise TypeError(f"expected a path, GIVEN or a function of the row for "
                            f"{model.__name__}.{field_name}, found {source!r}")
        items.append(f"        {field_name!r}: {value},\n")
    given = [field_name for field_name in fields if sources.get(field_name) is GIVEN]
    signature = ([] if len(given) == len(fields) else [row]) + (["*", *given] if given else [])
    filename = f"<ledger.shapes: {name}>"
    code = f"def {name}({', '.join(signature)}):\n    return {{\n{''.join(items)}    }}\n"
    exec(compile(code, filename, "exec"), namespace)  # noqa: S102 (our own code, from the model)
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    function = namespace[name]
    if declared is not None:
        functools.update_wrapper(function, declared)
        function.__kwdefaults__ = declared.__kwdefaults__
    function.model, function.sources, function.code = model, sources, code
    _SHAPES[model] = function
    return function


def _converted(expression: str, field: FieldInfo, name: str, namespace: dict[str, Any]) -> str:
    """`expression`, the value of field `name`, as the field's type sends it."""
    if _ISO in field.metadata:
        return f"iso({expression})"
    annotation, shape = field.annotation, f"_shape_{name}"
    args = get_args(annotation)
    if annotation in _SHAPES:
        namespace[shape] = _SHAPES[annotation]
        return f"{shape}({expression})"
    if get_origin(annotation) is list and args[0] in _SHAPES:
        namespace[shape] = _SHAPES[args[0]]
        return f"[{shape}(_item) for _item in {expression}]"
    if get_origin(annotation) in (Union, UnionType) and NoneType in args:
        rest = [arg for arg in args if arg is not NoneType]
        if len(rest) == 1 and rest[0] in _SHAPES:
            namespace[shape] = _SHAPES[rest[0]]
            return f"None if (_value := {expression}) is None else {shape}(_value)"
    if any(isinstance(arg, type) and issubclass(arg, BaseModel) for arg in (annotation, *args)):
        raise TypeError(f"expected the shape of {annotation} (the type of {name}) derived "
                        f"before its model's, found none")
    return expression


def _run_id(row: Any) -> str | None:
    """The public id of the row's run, if it has one (reads `row.run`)."""
    return row.run.run_id if row.run_id else None


def _step_id(row: Any) -> str | None:
    """The public id of the row's step, if it has one (reads `row.step`)."""
    return row.step.step_id if row.step_id else None


# --- operations --------------------------------------------------------------------------


class OperationOut(BaseModel):
    operation_id: str
    tenant: str
    operation: str
    target: str
    account: str = Field(default="", description="The provider account the call acts as "
                         "(a non-secret label), or empty.")
    state: str
    version: int
    attempt: int
    idempotency_key: str
    intent_fingerprint: str
    external_id: str
    intent: dict[str, Any]
    retry_policy: str
    error_code: str
    error_detail: str
    conflict: str
    authentication_recorded: bool
    run_id: str | None
    step_id: str | None
    created_at: Time
    state_changed_at: Time
    submitted_at: TimeOrNone
    in_flight_until: TimeOrNone = None
    completed_at: TimeOrNone
    result: Any = None
    result_unstorable: str = ""
    trace_id: str = Field(default="", description="The OpenTelemetry trace it was recorded "
                          "in (from the request's traceparent), or empty.")
    span_id: str = ""


@_shaped(OperationOut, run_id=_run_id, step_id=_step_id)
def operation(op: Operation) -> dict[str, Any]:
    """An operation's receipt (OperationOut). Reads `op.run` and `op.step` when set."""


class RecordedOut(OperationOut):
    submitted_now: bool = Field(description="Whether this request marked it submitted "
                                "(with submit: send now; otherwise do not send).")
    request_repeated: bool = Field(False, description=(
        "True when this answers a repeat of an earlier request (the same Request-Id header) "
        "whose answer was lost: the submission is that request's, nothing was sent since."))


@_shaped(RecordedOut, like=operation)
def recorded(op: Operation, *, submitted_now: bool,
             request_repeated: bool = False) -> dict[str, Any]:
    """An operation as a request that recorded (and maybe submitted) it (RecordedOut)."""


class EventOut(BaseModel):
    version: int
    from_state: str
    to_state: str
    actor_kind: str
    actor_id: str
    reason: str
    evidence: Any = None
    fencing_token: int | None
    created_at: Time


@_shaped(EventOut)
def event(event: OperationEvent) -> dict[str, Any]:
    """One transition of an operation's timeline (EventOut)."""


class EvidenceOut(BaseModel):
    reconciler: str
    query: Any
    observed: Any
    verdict: str
    matched_by: str
    detail: str
    created_at: Time


@_shaped(EvidenceOut)
def evidence(evidence: Evidence) -> dict[str, Any]:
    """One reconciler verdict with what it saw (EvidenceOut)."""


class ApprovalOut(BaseModel):
    status: Literal["not_required", "awaiting", "approved", "denied"] = Field(
        description="approved: send (the operation's intent is the approved one); denied: "
        "do not send (denied_reason says why); awaiting: poll again.")
    needed: int = Field(description="People who must approve (0: nothing asks).")
    live: int = Field(description="Live approvals of the current fingerprint.")
    policies: str = Field(description="The approval policies asking, if any.")
    denied_reason: str | None
    intent_fingerprint: str
    requested: bool
    note: str
    requested_at: TimeOrNone


@_shaped(ApprovalOut)
def approval(status: ApprovalStatus) -> dict[str, Any]:
    """Where an operation stands with approvals (ApprovalOut), from
    `selectors.approval_status`."""


class OperationApprovalOut(OperationOut):
    approval: ApprovalOut


_operation_approval = _shape(OperationApprovalOut, like=operation, approval=GIVEN)


def operation_approval(op: Operation, *, approval_status: ApprovalStatus) -> dict[str, Any]:
    """The receipt with its approval status (OperationApprovalOut)."""
    return _operation_approval(op, approval=approval_status)


class OperationDetailOut(OperationOut):
    approval: ApprovalOut
    events: list[EventOut]
    evidence: list[EvidenceOut]


_operation_detail = _shape(OperationDetailOut, like=operation, approval=GIVEN, events=GIVEN,
                           evidence=GIVEN)


def operation_detail(op: Operation, *, events: Iterable[OperationEvent],
                     evidence_rows: Iterable[Evidence],
                     approval_status: ApprovalStatus) -> dict[str, Any]:
    """The receipt with its approval status, events (oldest first) and evidence
    (OperationDetailOut)."""
    return _operation_detail(op, approval=approval_status, events=events,
                             evidence=evidence_rows)


class OperationPage(BaseModel):
    items: list[OperationOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page.")


_operation_page = _shape(OperationPage, items=GIVEN, next_cursor=GIVEN)


def operation_page(items: Iterable[Operation], next_cursor: str) -> dict[str, Any]:
    """A page of operations (OperationPage); an empty cursor is the last page (None)."""
    return _operation_page(items=items, next_cursor=next_cursor or None)


# --- facts -------------------------------------------------------------------------------


class FactOut(BaseModel):
    tenant: str
    subject: str
    predicate: str
    value: Any
    version: int | None
    status: str
    source: str
    observed_at: Time
    run_id: str | None
    is_candidate: bool
    conflict_id: int | None
    # When the version stops being current (None: never), and whether it has: an expired
    # version is no longer something to act on (an action relying on it is not submitted).
    expires_at: TimeOrNone = None
    expired: bool = False


def _conflict_id(fact: Fact) -> int | None:
    """The conflict a candidate opened (`fact.conflict`, set by `facts.assert_fact`)."""
    conflict = getattr(fact, "conflict", None) if fact.is_candidate else None
    return conflict.pk if conflict is not None else None


@_shaped(FactOut, run_id=_run_id, conflict_id=_conflict_id, expired="is_expired")
def fact(fact: Fact) -> dict[str, Any]:
    """A fact as written (FactOut): a candidate carries the conflict it opened
    (`fact.conflict`, set by `facts.assert_fact`). Reads `fact.run` when set."""


# --- runs, steps and obligations ---------------------------------------------------------


class RunOut(BaseModel):
    run_id: str
    tenant: str
    objective: str


@_shaped(RunOut)
def run(run: Run) -> dict[str, Any]:
    """A run as started (RunOut)."""


class StepOut(BaseModel):
    run_id: str
    step_id: str
    state: str
    depends_on: list[str]


_step = _shape(StepOut, run_id=GIVEN, depends_on=GIVEN)


def step(step: Step, *, run: Run, depends_on: Iterable[str]) -> dict[str, Any]:
    """A step as added (StepOut), with the step ids it depends on."""
    return _step(step, run_id=run.run_id, depends_on=sorted(depends_on))


class ObligationOut(BaseModel):
    key: str
    kind: str
    run_id: str
    tenant: str
    state: str
    deadline: TimeOrNone
    result: Any = None
    committed_at: TimeOrNone


_obligation = _shape(ObligationOut, run_id=GIVEN)


def obligation(obligation: Obligation, *, run: Run | None = None) -> dict[str, Any]:
    """An obligation (ObligationOut); reads `obligation.run` unless `run` is given."""
    return _obligation(obligation, run_id=(run or obligation.run).run_id)


# --- the hand-off view of a run (runs.resume, runs.hand_off) -----------------------------


class HandOffStep(BaseModel):
    step_id: str
    state: str
    depends_on: list[str]
    started_at: TimeOrNone
    committed_at: TimeOrNone


@_shaped(HandOffStep, depends_on=lambda step: sorted(d.step_id for d in step.depends_on.all()))
def hand_off_step(step: Step) -> dict[str, Any]:
    """Reads `step.depends_on` (prefetch it)."""


class NextMove(BaseModel):
    to: str
    by: str


class HandOffApproval(BaseModel):
    needed: int
    live: int
    policies: str
    denied_reason: str | None


# From the operation's approval gate (`selectors.approvals.Gate`).
_shape(HandOffApproval, live="have", policies="patterns", denied_reason="denial")


class HandOffReliedFact(BaseModel):
    subject: str
    predicate: str
    version: int | None
    current: bool = Field(description="Whether this version is still the current one; "
                          "an operation relying on a superseded version is not sent.")


_shape(HandOffReliedFact, current="is_current")


class HandOffOperation(BaseModel):
    operation_id: str
    operation: str
    target: str
    state: str
    version: int
    attempt: int
    idempotency_key: str
    step_id: str | None
    external_id: str
    next_moves: list[NextMove]
    approval: HandOffApproval | None
    relied_on: list[HandOffReliedFact] = Field(
        description="The fact versions the operation was planned on (relies_on).")


_hand_off_operation = _shape(HandOffOperation, step_id=_step_id, approval=GIVEN,
                             relied_on=GIVEN, next_moves=lambda op: states.next_moves(op.state))


def hand_off_operation(op: Operation, *, gate: Gate | None = None,
                       relied_on: tuple[Fact, ...] = ()) -> dict[str, Any]:
    """An open operation as a worker taking over needs it: its receipt, its next legal
    moves and who makes each (`states.next_moves`), for a planned one the approvals it
    waits for (`gate`, its approval gate; None for the others, past the gate), and the fact
    versions it relied on (`relied_on`, as stored now). Reads `op.step` when set."""
    return _hand_off_operation(op, approval=gate, relied_on=relied_on)


class HandOffObligation(BaseModel):
    key: str
    kind: str
    deadline: TimeOrNone
    created_at: Time


@_shaped(HandOffObligation)
def hand_off_obligation(obligation: Obligation) -> dict[str, Any]:
    """An obligation of the run still open (HandOffObligation)."""


class HandOffFact(BaseModel):
    subject: str
    predicate: str
    value: Any
    version: int | None
    source: str
    observed_at: Time
    recorded_at: Time
    run_id: str | None
    # Kept in the hand-off once expired, marked: the successor learns what the run knew
    # and that it must be read again from its source before anything relies on it.
    expires_at: TimeOrNone = None
    expired: bool = False


@_shaped(HandOffFact, recorded_at="created_at", run_id=_run_id, expired="is_expired")
def hand_off_fact(fact: Fact) -> dict[str, Any]:
    """A current fact the run wrote, with provenance, expired or not (`expired`). Reads
    `fact.run` when set."""


class HandOffConflict(BaseModel):
    subject: str
    predicate: str
    current_version: int | None
    candidate: Any
    candidate_source: str


@_shaped(HandOffConflict, current_version="current.version", candidate="candidate.value",
         candidate_source="candidate.source")
def hand_off_conflict(conflict: FactConflict) -> dict[str, Any]:
    """Reads `conflict.current` and `conflict.candidate` (select them)."""


class ResumeOut(BaseModel):
    run_id: str
    tenant: str
    objective: str
    token: int | None
    holder: str | None
    steps: list[HandOffStep]
    open_operations: list[HandOffOperation]
    pending_obligations: list[HandOffObligation]
    facts: list[HandOffFact]
    open_conflicts: list[HandOffConflict]
    blocked_by_stale_facts: list[HandOffOperation] = Field(
        description="Open operations not yet sent that rely on a fact version since "
        "superseded or expired: re-read the facts and plan again.")


def _hand_off_operations(view, operations: Iterable[Operation]) -> list[dict[str, Any]]:
    """`operations` of the view, each with its approval gate and the facts it relied on."""
    return [_hand_off_operation(op, approval=view.approvals.get(op.pk),
                                relied_on=view.relied_on.get(op.pk, ())) for op in operations]


@_shaped(ResumeOut, run_id="run.run_id", tenant="run.tenant",
         open_operations=lambda view: _hand_off_operations(view, view.open_operations),
         blocked_by_stale_facts=lambda view: _hand_off_operations(
             view, view.blocked_by_stale_facts))
def hand_off(view) -> dict[str, Any]:
    """The hand-off view of a run (ResumeOut), from a `runs.Resume` (which offers it as
    `as_dict()`): what a worker taking the run over must know."""


# --- the audit log -----------------------------------------------------------------------


class AuditEventOut(BaseModel):
    """One transition as the audit log exports it (the CSV's columns, in order)."""

    time: Time
    operation_id: str
    tenant: str
    operation: str
    version: int
    from_state: str
    to_state: str
    actor_kind: str
    actor_id: str
    reason: str


AUDIT_COLUMNS: tuple[str, ...] = tuple(AuditEventOut.model_fields)


@_shaped(AuditEventOut, time="created_at", operation_id="operation.operation_id",
         operation="operation.operation")
def audit_event(event: OperationEvent) -> dict[str, Any]:
    """One row of the audit export (AuditEventOut). Reads `event.operation` (select it)."""
