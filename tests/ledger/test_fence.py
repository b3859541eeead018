"""Guarantees by construction: derived step keys, leased runs always fenced, human-only
moves refused by PostgreSQL without the deciding user, no effect before its dependencies.

None of them depends on the caller's discipline: a stale worker that simply passes no
token, a raw SQL statement, or a re-run of a step after a SIGKILL is refused or finds its
receipt.
"""

import signal
import time
from datetime import timedelta

import pytest
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models import F

from demo.simulated.articles import ArticlesService
from ledger import leases, obligations, receipts, reconcile, runs, states, transitions
from ledger.errors import (
    DependencyNotMet,
    IdempotencyKeyReused,
    IllegalTransition,
    InvalidInput,
    LeaseHeld,
    LedgerError,
    StaleFencingToken,
)
from ledger.models import Obligation, Operation, OperationEvent, Step
from ledger.states import ActorKind, State
from tests.factories import OperationFactory, drive, reconciler_lease
from tests.support.processes import spawn, wait_for_line

INTENT = {"title": "Quarterly report", "body": "numbers"}


def immediate_constraints():
    """Deferred triggers fire at commit; a test transaction never commits, so fire them now."""
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")


# --- derived keys ----------------------------------------------------------------------------


def test_the_derived_key_is_the_run_the_step_and_the_call():
    assert receipts.idempotency_key("run-1", "ship") == "run:run-1/step:ship"
    assert receipts.idempotency_key("run-1", "ship", call="2") == "run:run-1/step:ship/call:2"
    assert receipts.idempotency_key("run-1", "ship") == receipts.idempotency_key("run-1", "ship")


def test_derived_keys_of_different_runs_and_steps_never_coincide():
    # Without escaping, run "a/step:b" step "c" and run "a" step "b/step:c" would share a key.
    assert receipts.idempotency_key("a/step:b", "c") != receipts.idempotency_key("a", "b/step:c")
    assert receipts.idempotency_key("a", "b/call:c") != receipts.idempotency_key("a", "b", "c")
    assert receipts.idempotency_key("a/step:b", "c") == "run:a%2Fstep%3Ab/step:c"


def test_a_derived_key_too_long_for_the_column_is_its_digest():
    long_key = receipts.idempotency_key("r" * 100, "s" * 100)
    assert long_key.startswith("run-step:sha256:") and len(long_key) <= 200
    assert long_key == receipts.idempotency_key("r" * 100, "s" * 100)
    assert long_key != receipts.idempotency_key("r" * 100, "s" * 99 + "t")


@pytest.fixture
def run(db):
    run = runs.start("Ship order 17", run_id="run-17")
    runs.add_step(run, "charge")
    runs.add_step(run, "ship", depends_on=["charge"])
    return run


@pytest.mark.django_db
def test_a_step_records_its_operation_under_the_derived_key_once(run):
    first = receipts.record_intent("charges.create", "https://pay.example", INTENT, run=run,
                                   step="charge")
    again = receipts.record_intent("charges.create", "https://pay.example", INTENT,
                                   run="run-17", step="charge")
    assert first.idempotency_key == "run:run-17/step:charge"
    assert (again.pk, first.recorded_now, again.recorded_now) == (first.pk, True, False)
    assert Operation.objects.count() == 1


@pytest.mark.django_db
def test_other_intent_under_the_same_step_is_a_reused_key(run):
    receipts.record_intent("charges.create", "https://pay.example", INTENT, run=run,
                           step="charge")
    with pytest.raises(IdempotencyKeyReused, match="run:run-17/step:charge"):
        receipts.record_intent("charges.create", "https://pay.example",
                               {**INTENT, "body": "other numbers"}, run=run, step="charge")
    assert Operation.objects.count() == 1


@pytest.mark.django_db
def test_call_tells_apart_several_calls_of_one_operation_in_a_step(run):
    first = receipts.record_intent("charges.create", "t", INTENT, run=run, step="charge")
    second = receipts.record_intent("charges.create", "t", {"n": 2}, run=run, step="charge",
                                    call="2")
    assert second.idempotency_key == "run:run-17/step:charge/call:2"
    assert first.pk != second.pk


@pytest.mark.django_db
def test_call_without_a_step_or_with_an_explicit_key_is_refused(run):
    with pytest.raises(InvalidInput, match="found no step"):
        receipts.record_intent("charges.create", "t", INTENT, run=run, call="2")
    with pytest.raises(InvalidInput, match="found an explicit idempotency_key"):
        receipts.record_intent("charges.create", "t", INTENT, run=run, step="charge",
                               idempotency_key="mine", call="2")
    assert Operation.objects.count() == 0


@pytest.mark.django_db
def test_an_explicit_key_wins_over_the_derived_one(run):
    op = receipts.record_intent("charges.create", "t", INTENT, run=run, step="charge",
                                idempotency_key="order-17-charge")
    assert op.idempotency_key == "order-17-charge"


@pytest.mark.django_db
def test_decorated_calls_in_a_step_scope_take_the_derived_keys(run):
    sent = []

    @receipts.action("charges.create", target="https://pay.example")
    def charge(amount: int) -> dict:
        sent.append(amount)
        return {"charged": amount}

    with receipts.step_scope(run, "charge"):
        charge(10)
        charge(20)
    with receipts.step_scope(run, "charge"):  # the step re-run: both already succeeded
        assert charge(10) == {"charged": 10}
        assert charge(20) == {"charged": 20}
    assert sent == [10, 20]
    assert sorted(Operation.objects.values_list("idempotency_key", flat=True)) == [
        "run:run-17/step:charge", "run:run-17/step:charge/call:2"]


# --- mandatory fencing -------------------------------------------------------------------------


def take_over(run, *, from_worker="worker-a", to_worker="worker-b"):
    """worker-a resumes the run with a short lease; worker-b resumes it once that lease
    has really expired (the database's clock). Returns (old token, new token)."""
    old = runs.resume(run, worker=from_worker, ttl=timedelta(milliseconds=50)).token
    deadline = time.monotonic() + 30
    while True:
        try:
            new = runs.resume(run, worker=to_worker).token
            break
        except LeaseHeld:
            assert time.monotonic() < deadline, "expected worker-a's lease to expire"
            time.sleep(0.05)
    assert new > old
    return old, new


def operation_in(run, to_state, step="charge"):
    op = receipts.record_intent("charges.create", "https://pay.example", INTENT, run=run,
                                step=step)
    return drive(op, to_state) if to_state != State.PLANNED else op


def submit_and_succeed(op, token):
    with receipts.submit(op, fencing_token=token) as attempt:
        attempt.succeeded(external_id="ch-1")
    return op


# Each agent write path to a run: (the state its operation starts in, the write).
OPERATION_WRITES = {
    "mark_submitted": (State.PLANNED,
                       lambda op, token: receipts.mark_submitted(op, fencing_token=token)),
    "submit": (State.PLANNED, submit_and_succeed),
    "mark_succeeded": (State.SUBMITTED, lambda op, token: receipts.mark_succeeded(
        op, external_id="ch-1", fencing_token=token)),
    "mark_rejected": (State.SUBMITTED, lambda op, token: receipts.mark_rejected(
        op, error_code="Declined", fencing_token=token)),
    "mark_outcome_unknown": (State.SUBMITTED, lambda op, token: receipts.mark_outcome_unknown(
        op, error_code="Timeout", fencing_token=token)),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("write", sorted(OPERATION_WRITES))
def test_a_worker_whose_lease_was_taken_over_cannot_change_its_operations(run, write):
    from_state, do = OPERATION_WRITES[write]
    op = operation_in(run, from_state)
    old, new = take_over(run)
    events = op.events.count()
    for stale in (None, old):
        with pytest.raises(StaleFencingToken, match=f"run:default:run-17|current token {new}"):
            do(Operation.objects.get(pk=op.pk), stale)
    fresh = Operation.objects.get(pk=op.pk)
    assert (fresh.state, fresh.version, fresh.events.count()) == (from_state, op.version, events)
    done = do(fresh, new)
    assert done.state != from_state
    assert set(fresh.events.filter(version__gt=op.version)
               .values_list("fencing_token", flat=True)) == {new}


@pytest.mark.django_db(transaction=True)
def test_without_a_token_the_refusal_names_the_current_one(run):
    op = operation_in(run, State.PLANNED)
    _, new = take_over(run)
    with pytest.raises(StaleFencingToken, match=rf"current fencing token \({new}\) of "
                                                r"run:default:run-17 .* found none") as refused:
        receipts.mark_submitted(op)
    assert refused.value.current_token == new


OBLIGATION_WRITES = {
    "commit": lambda token: obligations.commit("confirm-17", {"sent": True},
                                               fencing_token=token),
    "cancel": lambda token: obligations.cancel("confirm-17", reason="not needed",
                                               fencing_token=token),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("write", sorted(OBLIGATION_WRITES))
def test_a_worker_whose_lease_was_taken_over_cannot_settle_obligations(run, write):
    obligations.open(run, "email.confirmation", "confirm-17")
    old, new = take_over(run)
    for stale in (None, old):
        with pytest.raises(StaleFencingToken):
            OBLIGATION_WRITES[write](stale)
        assert Obligation.objects.get(key="confirm-17").state == "open"
    assert OBLIGATION_WRITES[write](new).state != "open"


STEP_WRITES = {
    "start_step": lambda run, token: runs.start_step(run, "charge", fencing_token=token),
    "commit_step": lambda run, token: runs.commit_step(run, "charge", fencing_token=token),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("write", sorted(STEP_WRITES))
def test_a_worker_whose_lease_was_taken_over_cannot_move_steps(run, write):
    old, new = take_over(run)
    for stale in (None, old):
        with pytest.raises(StaleFencingToken):
            STEP_WRITES[write](run, stale)
        assert Step.objects.get(run=run, step_id="charge").state == "pending"
    assert STEP_WRITES[write](run, new).state != "pending"


@pytest.mark.django_db(transaction=True)
def test_a_decorated_call_in_a_stale_step_scope_is_refused_before_it_sends(run):
    sent = []

    @receipts.action("charges.create", target="https://pay.example")
    def charge(amount: int) -> dict:
        sent.append(amount)
        return {"charged": amount}

    old, new = take_over(run)
    for stale in (None, old):
        with receipts.step_scope(run, "charge", fencing_token=stale):
            with pytest.raises(StaleFencingToken):
                charge(10)
    assert sent == []
    with receipts.step_scope(run, "charge", fencing_token=new):
        assert charge(10) == {"charged": 10}
    assert sent == [10]
    assert Operation.objects.get().state == State.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_a_run_never_leased_is_not_fenced(run):
    op = operation_in(run, State.PLANNED)
    receipts.mark_submitted(op)
    receipts.mark_succeeded(op, external_id="ch-1")
    assert runs.commit_step(run, "charge").state == "committed"
    with pytest.raises(StaleFencingToken, match="no lease at all"):
        runs.commit_step(run, "ship", fencing_token=3)


@pytest.mark.django_db(transaction=True)
def test_a_released_lease_still_fences_its_run(run):
    # "Once a lease exists": releasing it early does not unfence the run for tokenless writers.
    op = operation_in(run, State.PLANNED)
    token = leases.acquire(run.lease_resource, "worker-a", timedelta(minutes=5))
    leases.release(run.lease_resource, "worker-a", token)
    with pytest.raises(StaleFencingToken):
        receipts.mark_submitted(op)
    assert receipts.mark_submitted(op, fencing_token=token).state == State.SUBMITTED


def raw_move(op, *, to_state, actor_kind=ActorKind.AGENT, fencing_token=None,
             decided_by=None, from_state=None):
    """The row's move and its event in one raw statement, as a process that bypasses the
    ledger would write them (PostgreSQL wants the event in the statement that changes the
    row: operation_event_in_statement), unsealed (a link set by the writer is refused:
    event_chain_columns). `from_state`: what the event claims it left."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH changed AS (
                UPDATE ledger_operation SET state = %s, version = version + 1
                 WHERE id = %s RETURNING id, tenant, version)
            INSERT INTO ledger_operationevent
                   (operation_id, tenant, version, from_state, to_state, actor_kind, actor_id,
                    reason, fencing_token, decided_by_id, created_at)
            SELECT id, tenant, version, %s, %s, %s, 'raw', 'raw sql', %s, %s, now()
              FROM changed
            """,
            [to_state, op.pk, from_state or op.state, to_state, actor_kind, fencing_token,
             decided_by],
        )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stale", ["old", None])
def test_postgresql_refuses_an_agent_event_without_the_current_token(run, stale):
    op = operation_in(run, State.SUBMITTED)
    old, new = take_over(run)
    token = old if stale == "old" else None
    with pytest.raises(IntegrityError, match=f"expected the current fencing token {new} of "
                                             "run:default:run-17"), transaction.atomic():
        raw_move(op, to_state=State.SUCCEEDED, fencing_token=token)
    assert Operation.objects.get(pk=op.pk).state == State.SUBMITTED
    assert not OperationEvent.objects.filter(operation=op, version=op.version + 1).exists()


@pytest.mark.django_db(transaction=True)
def test_postgresql_takes_an_agent_event_with_the_current_token(run):
    op = operation_in(run, State.SUBMITTED)
    _, new = take_over(run)
    with transaction.atomic():
        raw_move(op, to_state=State.SUCCEEDED, fencing_token=new)
    assert Operation.objects.get(pk=op.pk).state == State.SUCCEEDED


# --- human-only transitions ------------------------------------------------------------------


# A reconciler's change is fenced by PostgreSQL alone: its event carries the current token
# of the lease reconcile:<operation_id> (event_reconciler_fenced).


def raw_claim(op, token) -> None:
    """outcome_unknown -> reconciling in raw SQL with a reconciler's event carrying `token`."""
    with transaction.atomic():
        raw_move(op, to_state=State.RECONCILING, actor_kind=ActorKind.RECONCILER,
                     fencing_token=token)


def reconciler_took_over(op) -> tuple[int, int]:
    """worker-a's token, then worker-b's after it took the operation's lease over."""
    return reconciler_lease(op, "worker-a"), reconciler_lease(op, "worker-b")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stale", ["old", None, "no lease"])
def test_postgresql_refuses_a_reconciler_event_without_its_leases_current_token(stale):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    if stale == "no lease":
        token, found = 1, "no lease at all"
    else:
        old, new = reconciler_took_over(op)
        token, found = (old if stale == "old" else None), f"current token {new}"
    with pytest.raises(IntegrityError, match=(
            f"expected fencing token {token or 'none'} to be current for the reconciler's "
            f"lease of operation {op.operation_id} \\(outcome_unknown -> reconciling\\), "
            f"found {found}")):
        raw_claim(op, token)
    assert Operation.objects.get(pk=op.pk).state == State.OUTCOME_UNKNOWN


@pytest.mark.django_db(transaction=True)
def test_postgresql_takes_a_reconciler_event_with_its_leases_current_token():
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    _, new = reconciler_took_over(op)
    raw_claim(op, new)
    assert Operation.objects.get(pk=op.pk).state == State.RECONCILING


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("to_state", [State.RECONCILING, State.MANUAL_REVIEW])
def test_a_reconciler_whose_lease_was_taken_over_changes_nothing(to_state):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN if to_state == State.RECONCILING
                          else State.RECONCILING)
    version = op.version
    old, new = reconciler_took_over(op)
    with pytest.raises(StaleFencingToken, match=f"expected fencing token {old} to be current "
                                                f".* found current token {new}") as refused:
        with transaction.atomic():
            transitions.by_reconciler(op, to_state, worker="worker-a", token=old,
                                      resource=f"reconcile:{op.operation_id}",
                                      reason="a late verdict")
    assert refused.value.current_token == new
    stored = Operation.objects.get(pk=op.pk)
    assert (stored.version, stored.state) == (version, op.state)
    assert not OperationEvent.objects.filter(operation=op, version=version + 1).exists()


@pytest.mark.django_db
def test_a_reconcilers_change_is_fenced_by_its_operations_own_lease():
    op, other = OperationFactory(state=State.OUTCOME_UNKNOWN), OperationFactory()
    with pytest.raises(InvalidInput, match=f"expected the lease reconcile:{op.operation_id} "
                                           f"to fence .* found 'reconcile:{other.operation_id}'"):
        transitions.by_reconciler(op, State.RECONCILING, worker="worker-a",
                                  token=reconciler_lease(other),
                                  resource=f"reconcile:{other.operation_id}", reason="mixed up")


@pytest.mark.django_db
def test_a_decision_records_the_deciding_user(reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    receipts.resolve(op, State.ABANDONED, user=reviewer, reason="never sent")
    event = op.events.get(version=op.version)
    assert (event.actor_kind, event.actor_id, event.decided_by) == (
        ActorKind.HUMAN, "reviewer", reviewer)


@pytest.mark.django_db
@pytest.mark.parametrize("user", [None, "reviewer"])
def test_no_public_writer_takes_a_decision_without_a_user(user):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    with pytest.raises(InvalidInput, match="expected a saved user to decide on operation"):
        transitions.by_person(op, State.SUCCEEDED, user=user, reason="trust me")
    with pytest.raises(InvalidInput, match="expected a saved user to resolve operation"):
        receipts.resolve(op, State.SUCCEEDED, user=user, reason="trust me")
    # No writer names an arbitrary actor: the agent's, the reconciler's and the sweep's
    # writers refuse a human decision, and nothing public takes an actor kind.
    with pytest.raises(IllegalTransition):
        transitions.by_agent(op, State.SUCCEEDED, reason="trust me", actor="human:alice")
    public = {name for name in vars(transitions) if not name.startswith("_")}
    assert not [name for name in public | set(vars(receipts))
                if name in {"apply_transition", "apply", "transition"}]
    assert Operation.objects.get(pk=op.pk).state == State.OUTCOME_UNKNOWN


@pytest.mark.django_db
@pytest.mark.parametrize(("from_state", "to_state"), sorted(states.HUMAN_ONLY))
@pytest.mark.parametrize("actor_kind", [ActorKind.HUMAN, ActorKind.SYSTEM])
def test_postgresql_refuses_a_human_decision_without_the_deciding_user(
        from_state, to_state, actor_kind):
    # Even through the private writer, with actor kind human: no decided_by, no decision.
    # Which trigger speaks first depends on the session's role: the actor-role check
    # (migration 0030) names the missing deciding user, the decision check the person.
    op = OperationFactory(state=from_state)
    with pytest.raises((DatabaseError, LedgerError),
                       match="expected (a person's decision|the deciding user)"):
        with transaction.atomic():
            transitions._apply(op, to_state, actor_kind=actor_kind, actor_id="alice",
                               reason="claimed")
    assert Operation.objects.get(pk=op.pk).state == from_state


@pytest.mark.django_db
@pytest.mark.parametrize("to_state", states.RESOLUTIONS)
def test_a_raw_update_to_a_human_decision_with_an_agent_event_is_refused(to_state, reviewer):
    op = OperationFactory(state=State.MANUAL_REVIEW)
    with pytest.raises(IntegrityError, match="expected a person's decision"):
        with transaction.atomic():
            raw_move(op, to_state=to_state, actor_kind=ActorKind.AGENT,
                         decided_by=reviewer.pk)
    assert Operation.objects.get(pk=op.pk).state == State.MANUAL_REVIEW


@pytest.mark.django_db
def test_a_raw_update_whose_event_records_another_move_is_refused():
    # The event claims reconciling -> succeeded (not a human decision); the row makes
    # outcome_unknown -> succeeded (one). The check at the statement's end compares the two.
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    token = reconciler_lease(op)  # the reconciler's fence is not what refuses it
    with pytest.raises(IntegrityError, match="found an event of reconciling -> succeeded"):
        with transaction.atomic():
            raw_move(op, to_state=State.SUCCEEDED, actor_kind=ActorKind.RECONCILER,
                     fencing_token=token, from_state=State.RECONCILING)
    assert Operation.objects.get(pk=op.pk).state == State.OUTCOME_UNKNOWN


@pytest.mark.django_db
def test_a_raw_update_with_a_persons_event_is_taken(reviewer):
    # The trigger refuses what lacks a person, not every raw statement.
    op = OperationFactory(state=State.MANUAL_REVIEW)
    with transaction.atomic():
        raw_move(op, to_state=State.ABANDONED, actor_kind=ActorKind.HUMAN,
                     decided_by=reviewer.pk)
        immediate_constraints()
    assert Operation.objects.get(pk=op.pk).state == State.ABANDONED


def installed_human_decision_check() -> str:
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT p.prosrc FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
             WHERE t.tgrelid = 'ledger_operationevent'::regclass
               AND t.tgname LIKE 'pgtrigger_event_human_decision_check_%%'
            """
        )
        rows = cursor.fetchall()
    assert len(rows) == 1, f"expected one human decision trigger, found {len(rows)}"
    return rows[0][0]


@pytest.mark.django_db
def test_the_migrated_human_decision_trigger_matches_the_table():
    assert states.human_decision_check_sql() in installed_human_decision_check()


@pytest.mark.django_db
def test_a_changed_decision_table_would_no_longer_match_the_migrated_trigger(monkeypatch):
    monkeypatch.setattr(states, "HUMAN_ONLY",
                        states.HUMAN_ONLY | {(State.RECONCILING, State.MANUAL_REVIEW)})
    assert states.human_decision_check_sql() not in installed_human_decision_check()


# --- dependencies bind effects ---------------------------------------------------------------


@pytest.mark.django_db
def test_a_dependent_steps_operation_is_not_submitted_before_its_dependency_commits(run):
    ship = receipts.record_intent("shipments.create", "https://wms.example", {"order": 17},
                                  run=run, step="ship")
    with pytest.raises(DependencyNotMet, match="found charge pending") as refused:
        receipts.mark_submitted(ship)
    assert list(refused.value.missing) == ["charge"]
    entered = []
    with pytest.raises(DependencyNotMet, match="ship depends on"):
        with receipts.submit(ship):
            entered.append(True)
    assert entered == []
    assert Operation.objects.get(pk=ship.pk).state == State.PLANNED

    runs.start_step(run, "charge")
    with pytest.raises(DependencyNotMet, match="found charge started"):
        receipts.mark_submitted(ship)
    runs.commit_step(run, "charge")
    assert receipts.mark_submitted(ship).state == State.SUBMITTED


@pytest.mark.django_db
@pytest.mark.parametrize("charge", [None, "started"])
def test_postgresql_refuses_submitting_before_the_dependencies_commit(run, charge):
    # The rule is PostgreSQL's alone: a raw UPDATE, as a process bypassing the ledger sends.
    ship = receipts.record_intent("shipments.create", "https://wms.example", {"order": 17},
                                  run=run, step="ship")
    if charge:
        runs.start_step(run, "charge")
    with pytest.raises(IntegrityError, match=(
            f"expected every step that ship depends on to be committed before operation "
            f"{ship.operation_id} \\(shipments.create\\) is submitted, found charge "
            f"{charge or 'pending'}")), transaction.atomic():
        Operation.objects.filter(pk=ship.pk).update(state=State.SUBMITTED,
                                                    version=F("version") + 1)
    assert Operation.objects.get(pk=ship.pk).state == State.PLANNED


@pytest.mark.django_db
def test_an_operation_without_a_step_or_whose_dependencies_committed_is_submitted(run):
    runs.add_step(run, "pack", depends_on=["charge", "ship"])
    loose = receipts.record_intent("notes.create", "https://notes.example", {"n": 1}, run=run)
    pack = receipts.record_intent("boxes.create", "https://wms.example", {"order": 17},
                                  run=run, step="pack")
    with pytest.raises(DependencyNotMet, match="found charge pending, ship pending") as refused:
        receipts.mark_submitted(pack)
    assert refused.value.missing == ("charge", "ship")
    assert receipts.mark_submitted(loose).state == State.SUBMITTED
    runs.commit_step(run, "charge")
    runs.commit_step(run, "ship")
    assert receipts.mark_submitted(pack).state == State.SUBMITTED


# --- a step re-run after a SIGKILL -----------------------------------------------------------

STEP_SCRIPT = """
import sys
from demo.simulated.articles import ArticlesClient
from ledger import receipts
from ledger.states import State

client = ArticlesClient({url!r})
intent = {{"title": {title!r}, "body": "numbers"}}
op = receipts.record_intent("articles.create", client.articles_url, intent, run="run-kill",
                            step="publish")
print(f"RECORDED {{op.operation_id}} {{op.state}}", flush=True)
if op.state != State.PLANNED:
    print(f"SKIPPED {{op.state}}", flush=True)
    sys.exit(0)
receipts.mark_submitted(op)
answer = client.create(title=intent["title"], body=intent["body"],
                       idempotency_key=op.idempotency_key)
print(f"SENT {{answer['id']}}", flush=True)
{after_send}
receipts.mark_succeeded(op, external_id=answer["id"])
print("DONE", flush=True)
"""


@pytest.mark.django_db(transaction=True)
def test_a_step_recorded_again_after_a_sigkill_finds_its_receipt_and_sends_once():
    runs.start("Publish the report", run_id="run-kill")
    runs.add_step("run-kill", "publish")
    # The service does not deduplicate keys: only the ledger stands between the re-run and
    # a second article.
    with ArticlesService(dedupe_keys=False) as service:
        first = spawn(STEP_SCRIPT.format(url=service.url, title="Report",
                                         after_send="import time; time.sleep(600)"))
        wait_for_line(first, "SENT ")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        assert first.returncode == -signal.SIGKILL

        second = spawn(STEP_SCRIPT.format(url=service.url, title="Report", after_send=""))
        assert wait_for_line(second, "SKIPPED ") == "SKIPPED submitted"
        assert second.wait(timeout=60) == 0

        (op,) = Operation.objects.filter(run__run_id="run-kill")
        assert op.idempotency_key == receipts.idempotency_key("run-kill", "publish")
        # The restarted agent cannot know whether its send took effect: a read settles it.
        receipts.mark_outcome_unknown(op, error_code="SenderRestarted")
        assert reconcile.run_once(worker="reconciler-1") == 1
        op.refresh_from_db()
        assert op.state == State.SUCCEEDED
        (article,) = service.side_effects()
        assert op.external_id == article["id"]

        with pytest.raises(IdempotencyKeyReused):
            receipts.record_intent("articles.create", service.articles_url,
                                   {"title": "Another report", "body": "numbers"},
                                   run="run-kill", step="publish")
    assert Operation.objects.filter(run__run_id="run-kill").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_step_killed_before_sending_is_sent_once_by_its_rerun():
    runs.start("Publish the report", run_id="run-kill")
    runs.add_step("run-kill", "publish")
    with ArticlesService(dedupe_keys=False) as service:
        child = spawn(
            f"""
            from ledger import receipts
            op = receipts.record_intent("articles.create", {service.articles_url!r},
                                        {{"title": "Report", "body": "numbers"}},
                                        run="run-kill", step="publish")
            print("RECORDED", flush=True)
            import time; time.sleep(600)
            """
        )
        wait_for_line(child, "RECORDED")
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        rerun = spawn(STEP_SCRIPT.format(url=service.url, title="Report", after_send=""))
        assert wait_for_line(rerun, "RECORDED ").endswith(" planned")
        assert rerun.wait(timeout=60) == 0, rerun.stderr.read()
        assert len(service.side_effects()) == 1
    (op,) = Operation.objects.filter(run__run_id="run-kill")
    assert (op.state, op.attempt) == (State.SUCCEEDED, 1)
