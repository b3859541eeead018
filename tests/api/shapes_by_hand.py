"""The shape functions as they were written by hand, before each was derived from its
model (`ledger.shapes` at e357b5b, verbatim but for the imports): the oracle that
tests/api/test_shapes.py holds the derived ones to, byte for byte, on rows in every state.

A shape that changes on purpose changes here too, in the same commit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ledger import states
from ledger.shapes import iso

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

def recorded(op: Operation, *, submitted_now: bool,
             request_repeated: bool = False) -> dict[str, Any]:
    """An operation as a request that recorded (and maybe submitted) it (RecordedOut)."""
    return {**operation(op), "submitted_now": submitted_now,
            "request_repeated": request_repeated}

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

def operation_page(items: Iterable[Operation], next_cursor: str) -> dict[str, Any]:
    """A page of operations (OperationPage); an empty cursor is the last page (None)."""
    return {"items": [operation(op) for op in items], "next_cursor": next_cursor or None}

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

def run(run: Run) -> dict[str, Any]:
    return {"run_id": run.run_id, "tenant": run.tenant, "objective": run.objective}

def step(step: Step, *, run: Run, depends_on: Iterable[str]) -> dict[str, Any]:
    """A step as added (StepOut), with the step ids it depends on."""
    return {"run_id": run.run_id, "step_id": step.step_id, "state": step.state,
            "depends_on": sorted(depends_on)}

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

def hand_off_step(step: Step) -> dict[str, Any]:
    """Reads `step.depends_on` (prefetch it)."""
    return {
        "step_id": step.step_id,
        "state": step.state,
        "depends_on": sorted(d.step_id for d in step.depends_on.all()),
        "started_at": iso(step.started_at),
        "committed_at": iso(step.committed_at),
    }

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

def hand_off_obligation(obligation: Obligation) -> dict[str, Any]:
    return {
        "key": obligation.key,
        "kind": obligation.kind,
        "deadline": iso(obligation.deadline),
        "created_at": iso(obligation.created_at),
    }

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

def hand_off_conflict(conflict: FactConflict) -> dict[str, Any]:
    """Reads `conflict.current` and `conflict.candidate` (select them)."""
    return {"subject": conflict.subject, "predicate": conflict.predicate,
            "current_version": conflict.current.version,
            "candidate": conflict.candidate.value,
            "candidate_source": conflict.candidate.source}

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
