"""Runs, their steps, and resuming a run from the durable record.

A step moves pending -> started -> committed, and starts only once every step it depends on
is committed ("no shipping before the payment clears"); a trigger refuses anything else.
`resume` hands a run to a new worker: it takes the run's lease `run:<tenant>:<run_id>` (a
larger fencing token, so writes still carrying the previous worker's token are refused) and
returns the hand-off view, read from the tables, never from a summary or a transcript.
Once a run is leased, adding its steps (`add_step`) and moving them (`start_step`,
`commit_step`) takes the lease's current token (`leases.check_run`, and PostgreSQL's
`step_added_fenced` and `step_fenced`, which the token is written for).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models.functions import Now
from django.utils import timezone

from ledger import leases, shapes, states, tracing
from ledger.canonical import scrub_text
from ledger.errors import DependencyNotMet, IllegalTransition, InvalidInput
from ledger.inputs import (
    check_fencing_token,
    check_identifier,
    check_names,
    check_optional_identifier,
    check_text,
    storable_text,
)
from ledger.models import (
    Fact,
    FactConflict,
    Lease,
    Obligation,
    Operation,
    Run,
    Step,
    StepState,
)
from ledger.models.execution import FactStatus
from ledger.selectors.approvals import Gate, gate
from ledger.selectors.runs import run_records
from ledger.states import State

DEFAULT_RESUME_TTL = timedelta(minutes=5)


def as_run(run: Run | str, *, tenant: str | None = None) -> Run:
    """`run` itself, or the Run named by that run_id in `tenant`; InvalidInput if there is
    none, or if the Run belongs to another tenant than `tenant` (when given).

    Run ids are unique per tenant: without `tenant`, a run_id that names runs of several
    tenants is InvalidInput too (name the tenant, or pass the Run)."""
    check_optional_identifier(tenant, "tenant", 100)
    if isinstance(run, str):
        check_identifier(run, "run", 100)
        named = Run.objects.filter(run_id=run)
        found = list(named.filter(tenant=tenant)[:1] if tenant is not None else named[:2])
        if not found:
            where = f" in tenant {tenant!r}" if tenant is not None else ""
            raise InvalidInput(f"expected run {run!r} to exist{where}, found no such run")
        if len(found) > 1:
            raise InvalidInput(
                f"expected run_id {run!r} to name one run, found runs of several tenants; "
                "name the tenant (tenant=...) or pass the Run")
        run = found[0]
    elif not isinstance(run, Run) or run.pk is None:
        raise InvalidInput(f"expected a saved Run or a run_id, found {run!r}")
    if tenant is not None and run.tenant != tenant:
        raise InvalidInput(
            f"expected run {run.run_id} to belong to tenant {tenant!r}, found {run.tenant!r}"
        )
    return run


def as_run_and_step(
    run: Run | str | None, step: Step | str | None, *, tenant: str
) -> tuple[Run | None, Step | None]:
    """The run and step an agent's write names, each given as an object, an id or None.

    A step given by step_id needs its run; a Step object brings its run along when none is
    given. InvalidInput when either does not exist, the run belongs to another tenant than
    `tenant`, or the step to another run.
    """
    if isinstance(step, str):
        check_identifier(step, "step", 100)
    run = as_run(run, tenant=tenant) if run is not None else None
    if isinstance(step, str):
        if run is None:
            raise InvalidInput(f"expected a run with step {step!r}, found run=None")
        found = Step.objects.filter(run=run, step_id=step).first()
        if found is None:
            raise InvalidInput(
                f"expected step {step!r} to exist in run {run.run_id}, found no such step"
            )
        return run, found
    if step is None:
        return run, None
    if not isinstance(step, Step):
        raise InvalidInput(
            f"expected step to be a Step or a step_id, found {type(step).__name__}"
        )
    if run is None:
        return as_run(step.run, tenant=tenant), step
    if step.run_id != run.pk:
        raise InvalidInput(
            f"expected step {step.step_id} to belong to run {run.run_id}, found another run"
        )
    return run, step


def start(objective: str, *, tenant: str = "default", run_id: str | None = None) -> Run:
    """Start a run working on `objective`; returns it. With the `run_id` of an existing run
    of the same tenant and objective, returns that run (starting twice is harmless); with
    another objective, InvalidInput. Run ids are unique per tenant: another tenant's run
    with the same id is another run, never seen from here."""
    # The objective is the agent's prose: made storable, not refused for its characters.
    objective = check_text(scrub_text(storable_text(objective, "objective", 10_000)),
                           "objective", 10_000)
    check_identifier(tenant, "tenant", 100)
    if run_id is None:
        run_id = f"run-{timezone.now():%Y%m%dT%H%M%SZ}-{secrets.token_hex(5)}"
    check_identifier(run_id, "run_id", 100)
    with transaction.atomic(durable=True):
        run, created = Run.objects.get_or_create(
            tenant=tenant, run_id=run_id, defaults={"objective": objective}
        )
    if not created and run.objective != objective:
        raise InvalidInput(
            f"expected run_id {run_id!r} to be new in tenant {tenant!r}, or to name its run "
            f"with objective {objective[:80]!r}, found objective {run.objective[:80]!r}"
        )
    return run


def add_step(run: Run | str, step_id: str, *, depends_on: Iterable[str] = (),
             tenant: str | None = None, fencing_token: int | None = None) -> Step:
    """Add step `step_id` (pending) to `run`, depending on steps already added to it.

    Adding the same step with the same dependencies again returns it; other dependencies
    raise InvalidInput. A dependency must exist before the step that needs it, so steps
    never depend on each other in a cycle. Once the run is leased, StaleFencingToken
    unless `fencing_token` is the lease's current token (none, or an older one, is
    refused: a worker whose lease was taken over adds nothing); a run never leased takes
    steps without a token. PostgreSQL checks the token written with the step too
    (`step_added_fenced`).
    """
    check_identifier(step_id, "step_id", 100)
    wanted = check_names(depends_on, "depends_on", 100)
    check_fencing_token(fencing_token)
    run = as_run(run, tenant=tenant)
    with leases.refused_as_stale(), transaction.atomic(durable=True):
        leases.check_run(run.pk, fencing_token)
        deps = list(Step.objects.filter(run=run, step_id__in=wanted))
        unknown = sorted(set(wanted) - {d.step_id for d in deps})
        if unknown:
            raise InvalidInput(
                f"expected the dependencies of {step_id} to be steps already added to run "
                f"{run.run_id}, found no step {', '.join(unknown)}"
            )
        step, created = Step.objects.get_or_create(
            run=run, step_id=step_id, defaults={"added_token": fencing_token})
        if created:
            step.depends_on.set(deps)
            return step
        have = sorted(step.depends_on.values_list("step_id", flat=True))
    if have != sorted(wanted):
        raise InvalidInput(
            f"expected step {step_id} of run {run.run_id} to be new, or to depend on "
            f"{sorted(wanted)} as before, found it depending on {have}"
        )
    return step


def start_step(run: Run | str, step_id: str, *, fencing_token: int | None = None,
               tenant: str | None = None) -> Step:
    """pending -> started. Raises DependencyNotMet (`.missing`: the uncommitted steps)
    until every dependency is committed. A started step is returned as it is (a resumed
    worker takes it over); a committed one raises IllegalTransition: it is done."""
    _check_step_args(run, step_id, fencing_token)
    with leases.refused_as_stale(), transaction.atomic(durable=True):
        step = _locked_step(as_run(run, tenant=tenant), step_id, fencing_token)
        if step.state == StepState.COMMITTED:
            raise IllegalTransition(
                f"expected step {step_id} of run {step.run.run_id} to be pending to start it, "
                f"found it committed at {step.committed_at.isoformat()}",
                from_state=step.state, to_state=StepState.STARTED,
            )
        return _start(step, fencing_token)


def commit_step(run: Run | str, step_id: str, *, fencing_token: int | None = None,
                tenant: str | None = None) -> Step:
    """-> committed (a pending step is started first, so DependencyNotMet applies too).
    Committing a committed step returns it unchanged."""
    _check_step_args(run, step_id, fencing_token)
    with leases.refused_as_stale(), transaction.atomic(durable=True):
        step = _locked_step(as_run(run, tenant=tenant), step_id, fencing_token)
        if step.state == StepState.COMMITTED:
            return step
        _start(step, fencing_token)
        Step.objects.filter(pk=step.pk).update(state=StepState.COMMITTED, committed_at=Now(),
                                               committed_token=fencing_token)
        step.refresh_from_db()
        return step


def _check_step_args(run, step_id, fencing_token) -> None:
    if isinstance(run, str):
        check_identifier(run, "run", 100)
    check_identifier(step_id, "step_id", 100)
    check_fencing_token(fencing_token)


def _locked_step(run: Run, step_id: str, fencing_token: int | None) -> Step:
    leases.check_run(run.pk, fencing_token)
    # Only the step's row: Step's ordering joins its run, which stays unlocked (and the
    # application role may not lock runs: it has no UPDATE on them).
    step = Step.objects.select_for_update(of=("self",)).filter(run=run, step_id=step_id).first()
    if step is None:
        raise InvalidInput(
            f"expected step {step_id!r} in run {run.run_id}, found no such step (add_step first)"
        )
    step.run = run
    return step


def _start(step: Step, fencing_token: int | None) -> Step:
    if step.state == StepState.STARTED:
        return step
    missing = list(
        step.depends_on.exclude(state=StepState.COMMITTED)
        .order_by("step_id").values_list("step_id", "state")
    )
    if missing:
        raise DependencyNotMet(
            f"expected every step that {step.step_id} depends on to be committed before it "
            f"starts, found {', '.join(f'{name} {state}' for name, state in missing)}",
            missing=[name for name, _ in missing],
        )
    Step.objects.filter(pk=step.pk).update(state=StepState.STARTED, started_at=Now(),
                                           started_token=fencing_token)
    step.refresh_from_db()
    return step


# --- resuming ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Resume:
    """The hand-off view of a run, read from its records.

    `token` is the fencing token to pass to every write (None when no lease was ever taken,
    from `hand_off`). `open_operations` are the run's non-terminal operations;
    `pending_obligations` its open obligations; `facts` the current version of every
    (subject, predicate) the run wrote, with provenance (`Fact.provenance`);
    `open_conflicts` the conflicts its own writes opened and a person has not decided;
    `blocked_by_stale_facts` the open operations not yet sent (planned, safe_to_retry)
    that rely on a fact version since superseded or expired (`record_intent(relies_on=)`):
    they will not be sent as planned; re-read the facts and plan again.
    """

    run: Run
    token: int | None
    holder: str | None
    objective: str
    steps: tuple[Step, ...]
    open_operations: tuple[Operation, ...]
    pending_obligations: tuple[Obligation, ...]
    facts: tuple[Fact, ...]
    open_conflicts: tuple[FactConflict, ...]
    blocked_by_stale_facts: tuple[Operation, ...] = ()
    # The approval gate of each planned operation, by its pk (the others are past it).
    approvals: Mapping[int, Gate] = field(default_factory=dict)
    # The fact versions each open operation relied on (`record_intent(relies_on=)`), by
    # its pk, as stored now (`status` says whether each is still current).
    relied_on: Mapping[int, tuple[Fact, ...]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The view as plain JSON-ready data (times in ISO 8601): `shapes.hand_off`."""
        return shapes.hand_off(self)


@tracing.state_tool("run_resume", tracing.resume_attributes)
def resume(run_id: str | Run, *, worker: str, ttl: timedelta = DEFAULT_RESUME_TTL,
           tenant: str | None = None) -> Resume:
    """Take over the run for `worker` and return its hand-off view.

    Takes the lease `run:<tenant>:<run_id>` (`Run.lease_resource`) with a fencing token
    larger than any before, so writes still carrying an older token
    (`receipts.mark_succeeded(op, fencing_token=old)`, `commit_step`, `obligations.commit`,
    `facts.assert_fact` with `fencing_token=`) are
    refused with StaleFencingToken. While another worker's lease is live this raises
    LeaseHeld (`.owner`, `.expires_at`) and takes nothing: wait for it to expire, or for
    its holder to release it. The same worker resuming again gets a new, larger token.
    """
    check_identifier(worker, "worker", 200)
    run = as_run(run_id, tenant=tenant)
    with transaction.atomic(durable=True):
        token = leases.acquire(run.lease_resource, worker, ttl)
        return _view(run, token, worker)


def hand_off(run_id: str | Run, *, tenant: str | None = None) -> Resume:
    """The hand-off view without taking the lease (token and holder: the lease's current
    ones, if any). For pages and supervisors; a worker resumes with `resume`."""
    run = as_run(run_id, tenant=tenant)
    lease = Lease.objects.filter(resource=run.lease_resource).first()
    return _view(run, lease.token if lease else None, lease.owner if lease else None)


def _view(run: Run, token: int | None, holder: str | None) -> Resume:
    records = run_records(run, open_only=True)
    relied_on = _relied_on(records.operations)
    return Resume(
        run=run,
        token=token,
        holder=holder,
        objective=run.objective,
        steps=tuple(records.steps),
        open_operations=tuple(records.operations),
        pending_obligations=tuple(records.obligations),
        facts=tuple(records.facts),
        open_conflicts=tuple(records.open_conflicts),
        blocked_by_stale_facts=tuple(
            op for op in records.operations
            if op.state in states.SENDABLE
            and any(f.status != FactStatus.CURRENT or f.is_expired
                    for f in relied_on.get(op.pk, ()))),
        approvals={op.pk: gate(op) for op in records.operations
                   if op.state == State.PLANNED},
        relied_on=relied_on,
    )


def _relied_on(operations) -> dict[int, tuple[Fact, ...]]:
    """The fact versions each operation relied on, by its pk: one query for them all,
    none when no operation relied on any."""
    wanted = {fact_id for op in operations for fact_id in op.relies_on or ()}
    if not wanted:
        return {}
    facts = Fact.objects.in_bulk(wanted)
    return {op.pk: tuple(facts[i] for i in op.relies_on if i in facts)
            for op in operations if op.relies_on}
