"""The JSON shapes of the ledger's nouns: what every front end that speaks JSON returns.

One function per noun turns a row into plain JSON-ready data (times in ISO 8601, `iso`),
and one pydantic model beside it describes that data: the HTTP API declares its responses
with these models, so its OpenAPI document is generated from them, and the MCP tools, the
hand-off view of `runs.resume` and the desk's audit export return the same functions'
output. tests/api/test_shapes.py holds every function to its model and to the OpenAPI
document. A shape changes here, in one place, or not at all: clients are built on it.

Functions read only what their row has loaded (a relation used is named in the
docstring, for the caller to `select_related`); they never query on their own.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

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
    created_at: str
    state_changed_at: str
    submitted_at: str | None
    in_flight_until: str | None = None
    completed_at: str | None
    result: Any = None
    result_unstorable: str = ""
    trace_id: str = Field(default="", description="The OpenTelemetry trace it was recorded "
                          "in (from the request's traceparent), or empty.")
    span_id: str = ""


def operation(op: Operation) -> dict[str, Any]:
    """An operation's receipt (OperationOut). Reads `op.run` and `op.step` when set."""
    return {
        "operation_id": op.operation_id,
        "tenant": op.tenant,
        "operation": op.operation,
        "target": op.target,
        "account": op.account,
        "state": op.state,
        "version": op.version,
        "attempt": op.attempt,
        "idempotency_key": op.idempotency_key,
        "intent_fingerprint": op.intent_fingerprint,
        "external_id": op.external_id,
        "intent": op.intent,
        "retry_policy": op.retry_policy,
        "error_code": op.error_code,
        "error_detail": op.error_detail,
        "conflict": op.conflict,
        "authentication_recorded": op.authentication_recorded,
        "run_id": op.run.run_id if op.run_id else None,
        "step_id": op.step.step_id if op.step_id else None,
        "created_at": iso(op.created_at),
        "state_changed_at": iso(op.state_changed_at),
        "submitted_at": iso(op.submitted_at),
        "in_flight_until": iso(op.in_flight_until),
        "completed_at": iso(op.completed_at),
        "result": op.result,
        "result_unstorable": op.result_unstorable,
        "trace_id": op.trace_id,
        "span_id": op.span_id,
    }


class RecordedOut(OperationOut):
    submitted_now: bool = Field(description="Whether this request marked it submitted "
                                "(with submit: send now; otherwise do not send).")
    request_repeated: bool = Field(False, description=(
        "True when this answers a repeat of an earlier request (the same Request-Id header) "
        "whose answer was lost: the submission is that request's, nothing was sent since."))


def recorded(op: Operation, *, submitted_now: bool,
             request_repeated: bool = False) -> dict[str, Any]:
    """An operation as a request that recorded (and maybe submitted) it (RecordedOut)."""
    return {**operation(op), "submitted_now": submitted_now,
            "request_repeated": request_repeated}


class EventOut(BaseModel):
    version: int
    from_state: str
    to_state: str
    actor_kind: str
    actor_id: str
    reason: str
    evidence: Any = None
    fencing_token: int | None
    created_at: str


def event(event: OperationEvent) -> dict[str, Any]:
    """One transition of an operation's timeline (EventOut)."""
    return {
        "version": event.version,
        "from_state": event.from_state,
        "to_state": event.to_state,
        "actor_kind": event.actor_kind,
        "actor_id": event.actor_id,
        "reason": event.reason,
        "evidence": event.evidence,
        "fencing_token": event.fencing_token,
        "created_at": iso(event.created_at),
    }


class EvidenceOut(BaseModel):
    reconciler: str
    query: Any
    observed: Any
    verdict: str
    matched_by: str
    detail: str
    created_at: str


def evidence(evidence: Evidence) -> dict[str, Any]:
    """One reconciler verdict with what it saw (EvidenceOut)."""
    return {
        "reconciler": evidence.reconciler,
        "query": evidence.query,
        "observed": evidence.observed,
        "verdict": evidence.verdict,
        "matched_by": evidence.matched_by,
        "detail": evidence.detail,
        "created_at": iso(evidence.created_at),
    }


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
    requested_at: str | None


def approval(status: ApprovalStatus) -> dict[str, Any]:
    """Where an operation stands with approvals (ApprovalOut), from
    `selectors.approval_status`."""
    return {
        "status": status.status, "needed": status.needed, "live": status.live,
        "policies": status.policies, "denied_reason": status.denied_reason,
        "intent_fingerprint": status.intent_fingerprint,
        "requested": status.requested,
        "note": status.note,
        "requested_at": iso(status.requested_at),
    }


class OperationApprovalOut(OperationOut):
    approval: ApprovalOut


class OperationDetailOut(OperationOut):
    events: list[EventOut]
    evidence: list[EvidenceOut]
    approval: ApprovalOut


def operation_detail(op: Operation, *, events: Iterable[OperationEvent],
                     evidence_rows: Iterable[Evidence],
                     approval_status: ApprovalStatus) -> dict[str, Any]:
    """The receipt with its approval status, events (oldest first) and evidence
    (OperationDetailOut)."""
    data = operation(op)
    data["approval"] = approval(approval_status)
    data["events"] = [event(e) for e in events]
    data["evidence"] = [evidence(e) for e in evidence_rows]
    return data


class OperationPage(BaseModel):
    items: list[OperationOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page.")


def operation_page(items: Iterable[Operation], next_cursor: str) -> dict[str, Any]:
    """A page of operations (OperationPage); an empty cursor is the last page (None)."""
    return {"items": [operation(op) for op in items], "next_cursor": next_cursor or None}


# --- facts -------------------------------------------------------------------------------


class FactOut(BaseModel):
    tenant: str
    subject: str
    predicate: str
    value: Any
    version: int | None
    status: str
    source: str
    observed_at: str
    run_id: str | None
    is_candidate: bool
    conflict_id: int | None
    # When the version stops being current (None: never), and whether it has: an expired
    # version is no longer something to act on (an action relying on it is not submitted).
    expires_at: str | None = None
    expired: bool = False


def fact(fact: Fact) -> dict[str, Any]:
    """A fact as written (FactOut): a candidate carries the conflict it opened
    (`fact.conflict`, set by `facts.assert_fact`). Reads `fact.run` when set."""
    conflict = getattr(fact, "conflict", None) if fact.is_candidate else None
    return {
        "tenant": fact.tenant,
        "subject": fact.subject,
        "predicate": fact.predicate,
        "value": fact.value,
        "version": fact.version,
        "status": fact.status,
        "source": fact.source,
        "observed_at": iso(fact.observed_at),
        "run_id": fact.run.run_id if fact.run_id else None,
        "is_candidate": fact.is_candidate,
        "conflict_id": conflict.pk if conflict is not None else None,
        "expires_at": iso(fact.expires_at) if fact.expires_at else None,
        "expired": fact.is_expired,
    }


# --- runs, steps and obligations ---------------------------------------------------------


class RunOut(BaseModel):
    run_id: str
    tenant: str
    objective: str


def run(run: Run) -> dict[str, Any]:
    return {"run_id": run.run_id, "tenant": run.tenant, "objective": run.objective}


class StepOut(BaseModel):
    run_id: str
    step_id: str
    state: str
    depends_on: list[str]


def step(step: Step, *, run: Run, depends_on: Iterable[str]) -> dict[str, Any]:
    """A step as added (StepOut), with the step ids it depends on."""
    return {"run_id": run.run_id, "step_id": step.step_id, "state": step.state,
            "depends_on": sorted(depends_on)}


class ObligationOut(BaseModel):
    key: str
    kind: str
    run_id: str
    tenant: str
    state: str
    deadline: str | None
    result: Any = None
    committed_at: str | None


def obligation(obligation: Obligation, *, run: Run | None = None) -> dict[str, Any]:
    """An obligation (ObligationOut); reads `obligation.run` unless `run` is given."""
    run = run or obligation.run
    return {
        "key": obligation.key,
        "kind": obligation.kind,
        "run_id": run.run_id,
        "tenant": obligation.tenant,
        "state": obligation.state,
        "deadline": iso(obligation.deadline),
        "result": obligation.result,
        "committed_at": iso(obligation.committed_at),
    }


# --- the hand-off view of a run (runs.resume, runs.hand_off) -----------------------------


class HandOffStep(BaseModel):
    step_id: str
    state: str
    depends_on: list[str]
    started_at: str | None
    committed_at: str | None


def hand_off_step(step: Step) -> dict[str, Any]:
    """Reads `step.depends_on` (prefetch it)."""
    return {
        "step_id": step.step_id,
        "state": step.state,
        "depends_on": sorted(d.step_id for d in step.depends_on.all()),
        "started_at": iso(step.started_at),
        "committed_at": iso(step.committed_at),
    }


class NextMove(BaseModel):
    to: str
    by: str


class HandOffApproval(BaseModel):
    needed: int
    live: int
    policies: str
    denied_reason: str | None


class HandOffReliedFact(BaseModel):
    subject: str
    predicate: str
    version: int | None
    current: bool = Field(description="Whether this version is still the current one; "
                          "an operation relying on a superseded version is not sent.")


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


def hand_off_operation(op: Operation, *, gate: Gate | None = None,
                       relied_on: tuple[Fact, ...] = ()) -> dict[str, Any]:
    """An open operation as a worker taking over needs it: its receipt, its next legal
    moves and who makes each (`states.next_moves`), for a planned one the approvals it
    waits for (`gate`, its approval gate; None for the others, past the gate), and the fact
    versions it relied on (`relied_on`, as stored now). Reads `op.step` when set."""
    from ledger.models import FactStatus

    return {
        "operation_id": op.operation_id,
        "operation": op.operation,
        "target": op.target,
        "state": op.state,
        "version": op.version,
        "attempt": op.attempt,
        "idempotency_key": op.idempotency_key,
        "step_id": op.step.step_id if op.step_id else None,
        "external_id": op.external_id,
        "next_moves": states.next_moves(op.state),
        "approval": None if gate is None else {
            "needed": gate.needed, "live": gate.have, "policies": gate.patterns,
            "denied_reason": gate.denial},
        "relied_on": [{"subject": f.subject, "predicate": f.predicate, "version": f.version,
                       "current": f.status == FactStatus.CURRENT} for f in relied_on],
    }


class HandOffObligation(BaseModel):
    key: str
    kind: str
    deadline: str | None
    created_at: str


def hand_off_obligation(obligation: Obligation) -> dict[str, Any]:
    return {
        "key": obligation.key,
        "kind": obligation.kind,
        "deadline": iso(obligation.deadline),
        "created_at": iso(obligation.created_at),
    }


class HandOffFact(BaseModel):
    subject: str
    predicate: str
    value: Any
    version: int | None
    source: str
    observed_at: str
    recorded_at: str
    run_id: str | None
    # Kept in the hand-off once expired, marked: the successor learns what the run knew
    # and that it must be read again from its source before anything relies on it.
    expires_at: str | None = None
    expired: bool = False


def hand_off_fact(fact: Fact) -> dict[str, Any]:
    """A current fact the run wrote, with provenance, expired or not (`expired`). Reads
    `fact.run` when set."""
    return {
        "subject": fact.subject,
        "predicate": fact.predicate,
        "value": fact.value,
        "version": fact.version,
        "source": fact.source,
        "observed_at": iso(fact.observed_at),
        "recorded_at": iso(fact.created_at),
        "run_id": fact.run.run_id if fact.run_id else None,
        "expires_at": iso(fact.expires_at) if fact.expires_at else None,
        "expired": fact.is_expired,
    }


class HandOffConflict(BaseModel):
    subject: str
    predicate: str
    current_version: int | None
    candidate: Any
    candidate_source: str


def hand_off_conflict(conflict: FactConflict) -> dict[str, Any]:
    """Reads `conflict.current` and `conflict.candidate` (select them)."""
    return {"subject": conflict.subject, "predicate": conflict.predicate,
            "current_version": conflict.current.version,
            "candidate": conflict.candidate.value,
            "candidate_source": conflict.candidate.source}


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


def hand_off(view) -> dict[str, Any]:
    """The hand-off view of a run (ResumeOut), from a `runs.Resume` (which offers it as
    `as_dict()`): what a worker taking the run over must know."""
    return {
        "run_id": view.run.run_id,
        "tenant": view.run.tenant,
        "objective": view.objective,
        "token": view.token,
        "holder": view.holder,
        "steps": [hand_off_step(s) for s in view.steps],
        "open_operations": [hand_off_operation(op, gate=view.approvals.get(op.pk),
                                               relied_on=view.relied_on.get(op.pk, ()))
                            for op in view.open_operations],
        "pending_obligations": [hand_off_obligation(o) for o in view.pending_obligations],
        "facts": [hand_off_fact(f) for f in view.facts],
        "open_conflicts": [hand_off_conflict(c) for c in view.open_conflicts],
        "blocked_by_stale_facts": [hand_off_operation(op, gate=view.approvals.get(op.pk),
                                                      relied_on=view.relied_on.get(op.pk, ()))
                                   for op in view.blocked_by_stale_facts],
    }


# --- the audit log -----------------------------------------------------------------------


class AuditEventOut(BaseModel):
    """One transition as the audit log exports it (the CSV's columns, in order)."""

    time: str
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


def audit_event(event: OperationEvent) -> dict[str, Any]:
    """One row of the audit export (AuditEventOut). Reads `event.operation` (select it)."""
    return {
        "time": iso(event.created_at),
        "operation_id": event.operation.operation_id,
        "tenant": event.tenant,
        "operation": event.operation.operation,
        "version": event.version,
        "from_state": event.from_state,
        "to_state": event.to_state,
        "actor_kind": event.actor_kind,
        "actor_id": event.actor_id,
        "reason": event.reason,
    }
