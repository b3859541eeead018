"""Runs and steps: dependencies, resume after a killed worker, fencing, episodes."""

import json
import signal
import time
from datetime import timedelta

import pytest
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.utils import timezone

from ledger import episodes, facts, leases, obligations, receipts, runs
from ledger.errors import (
    DependencyNotMet,
    IllegalTransition,
    InvalidInput,
    LeaseHeld,
    StaleFencingToken,
)
from ledger.models import Episode, Run, Step, StepState
from ledger.states import State
from tests.factories import drive
from tests.support.processes import spawn, wait_for_line


@pytest.fixture
def run(db):
    return runs.start("Ship order 17", run_id="run-17")


def raw(sql, params=()):
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)


# --- runs --------------------------------------------------------------------------------


@pytest.mark.django_db
def test_start_makes_a_run_with_a_generated_id():
    run = runs.start("Reconcile invoices", tenant="acme")
    assert run.run_id.startswith("run-") and (run.tenant, run.objective) == (
        "acme", "Reconcile invoices")


@pytest.mark.django_db
def test_starting_the_same_run_id_twice_returns_the_run_but_another_objective_is_refused(run):
    assert runs.start("Ship order 17", run_id="run-17").pk == run.pk
    with pytest.raises(InvalidInput, match="expected run_id 'run-17' to be new"):
        runs.start("Something else", run_id="run-17")
    assert Run.objects.count() == 1


# --- steps -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_step_with_an_uncommitted_dependency_cannot_start(run):
    runs.add_step(run, "charge-card")
    runs.add_step(run, "reserve-stock")
    runs.add_step(run, "ship", depends_on=["charge-card", "reserve-stock"])
    runs.commit_step(run, "reserve-stock")
    with pytest.raises(DependencyNotMet, match="found charge-card pending") as info:
        runs.start_step(run, "ship")
    assert info.value.missing == ("charge-card",)
    assert Step.objects.get(step_id="ship").state == StepState.PENDING


@pytest.mark.django_db
def test_a_started_but_uncommitted_dependency_still_blocks(run):
    runs.add_step(run, "charge-card")
    runs.add_step(run, "ship", depends_on=["charge-card"])
    runs.start_step(run, "charge-card")
    with pytest.raises(DependencyNotMet, match="found charge-card started"):
        runs.commit_step(run, "ship")


@pytest.mark.django_db
def test_once_every_dependency_is_committed_the_step_starts_and_commits(run):
    runs.add_step(run, "charge-card")
    runs.add_step(run, "ship", depends_on=["charge-card"])
    runs.start_step(run, "charge-card")
    runs.commit_step(run, "charge-card")
    started = runs.start_step(run, "ship")
    assert (started.state, started.committed_at) == ("started", None)
    assert started.started_at is not None
    committed = runs.commit_step(run, "ship")
    assert committed.state == "committed" and committed.committed_at >= committed.started_at
    assert runs.commit_step(run, "ship").committed_at == committed.committed_at


@pytest.mark.django_db
def test_starting_a_started_step_returns_it_and_a_committed_one_is_refused(run):
    runs.add_step(run, "charge-card")
    first = runs.start_step(run, "charge-card")
    assert runs.start_step(run, "charge-card").started_at == first.started_at
    runs.commit_step(run, "charge-card")
    with pytest.raises(IllegalTransition, match="found it committed"):
        runs.start_step(run, "charge-card")


@pytest.mark.django_db
def test_the_database_refuses_a_raw_start_before_the_dependencies_commit(run):
    runs.add_step(run, "charge-card")
    runs.add_step(run, "ship", depends_on=["charge-card"])
    with pytest.raises(IntegrityError, match="expected every dependency committed before it "
                                             "starts, found charge-card \\(pending\\)"):
        raw("UPDATE ledger_step SET state = 'started' WHERE step_id = 'ship'")
    with pytest.raises(IntegrityError, match="expected pending -> started -> committed"):
        raw("UPDATE ledger_step SET state = 'committed' WHERE step_id = 'charge-card'")
    runs.commit_step(run, "charge-card")
    with pytest.raises(IntegrityError, match="found committed -> pending"):
        raw("UPDATE ledger_step SET state = 'pending' WHERE step_id = 'charge-card'")


@pytest.mark.django_db
def test_dependencies_must_be_added_first_so_steps_never_form_a_cycle(run):
    runs.add_step(run, "a")
    with pytest.raises(InvalidInput, match="found no step b"):
        runs.add_step(run, "c", depends_on=["a", "b"])
    with pytest.raises(InvalidInput, match="found no step a2"):
        runs.add_step(run, "a2", depends_on=["a2"])
    assert list(Step.objects.values_list("step_id", flat=True)) == ["a"]


@pytest.mark.django_db
def test_adding_a_step_again_is_idempotent_unless_its_dependencies_differ(run):
    runs.add_step(run, "a")
    runs.add_step(run, "b")
    step = runs.add_step(run, "c", depends_on=["a"])
    assert runs.add_step(run, "c", depends_on=["a"]).pk == step.pk
    with pytest.raises(InvalidInput, match="to depend on \\['a', 'b'\\] as before, found it "
                                           "depending on \\['a'\\]"):
        runs.add_step(run, "c", depends_on=["a", "b"])


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda r: runs.add_step(r, ""), "expected step_id to be a non-empty string"),
        (lambda r: runs.add_step(r, "x", depends_on="a"), "found the string 'a'"),
        (lambda r: runs.add_step(r, "x", depends_on=["a", "a"]), "without repeats"),
        (lambda r: runs.start_step(r, "missing"), "found no such step"),
        (lambda r: runs.add_step("no-such-run", "x"), "expected run 'no-such-run' to exist"),
        (lambda r: runs.start(""), "expected objective to be a non-empty string"),
        (lambda r: runs.resume("run-17", worker=""), "expected worker to be a non-empty"),
        (lambda r: runs.resume("run-17", worker="w", ttl=5), "expected ttl to be a positive"),
    ],
)
def test_bad_input_gets_a_clear_error_and_writes_nothing(run, call, message):
    with pytest.raises(InvalidInput, match=message):
        call(run)
    assert Step.objects.count() == 0


# --- resume ------------------------------------------------------------------------------


def _busy_run(run):
    """A run part-way through: a committed and a started step, an operation in flight, an
    open obligation, facts (one later superseded by another run) and a candidate."""
    runs.add_step(run, "charge-card")
    runs.add_step(run, "ship", depends_on=["charge-card"])
    runs.commit_step(run, "charge-card")
    runs.start_step(run, "ship")
    op = receipts.record_intent("shipments.create", "https://wms.example/api", {"order": 17},
                                run=run, step="ship",
                                idempotency_key=receipts.idempotency_key(run.run_id, "ship"))
    receipts.mark_submitted(op)
    done = receipts.record_intent("payments.capture", "https://psp.example", {"order": 17},
                                  run=run, step="charge-card")
    drive(done, State.SUCCEEDED)
    obligations.open(run, "email.confirmation", "confirm-17",
                     deadline=timezone.now() + timedelta(days=1))
    obligations.open(run, "payment.capture", "capture-17")
    obligations.commit("capture-17", {"capture": "c-1"})
    facts.assert_fact("order:17", "status", "paid", source="psp", run=run)
    facts.assert_fact("order:17", "carrier", "dhl", source="wms", run=run)
    other = runs.start("Customer service", run_id="run-cs")
    facts.assert_fact("order:17", "carrier", "ups", source="agent-cs", expected_version=1,
                      run=other)
    facts.assert_fact("order:17", "status", "lost", source="rumour", run=run)
    return op


@pytest.mark.django_db
def test_resume_returns_the_hand_off_view_from_the_records(run):
    op = _busy_run(run)
    view = runs.resume("run-17", worker="worker-b")
    assert view.token == leases.current_token("run:default:run-17") and view.holder == "worker-b"
    assert view.objective == "Ship order 17"
    assert [(s.step_id, s.state) for s in view.steps] == [("charge-card", "committed"),
                                                          ("ship", "started")]
    assert [(o.operation_id, o.state) for o in view.open_operations] == [
        (op.operation_id, "submitted")]
    assert [o.key for o in view.pending_obligations] == ["confirm-17"]
    assert [(f.predicate, f.value, f.version, f.source) for f in view.facts] == [
        ("carrier", "ups", 2, "agent-cs"), ("status", "paid", 1, "psp")]
    assert [(c.predicate, c.candidate.value) for c in view.open_conflicts] == [
        ("status", "lost")]
    as_data = view.as_dict()
    assert json.loads(json.dumps(as_data)) == as_data
    assert as_data["steps"][1] == {"step_id": "ship", "state": "started",
                                   "depends_on": ["charge-card"],
                                   "started_at": view.steps[1].started_at.isoformat(),
                                   "committed_at": None}


@pytest.mark.django_db
def test_resume_reads_a_busy_run_in_a_fixed_number_of_queries(run, django_assert_num_queries):
    _busy_run(run)
    # The run, the lease upsert, six reads (steps, their dependencies, operations,
    # obligations, facts, conflicts), and one savepoint pair (the test's transaction turns
    # resume's atomic block into a savepoint; the lease upsert needs none).
    with django_assert_num_queries(10):
        view = runs.resume("run-17", worker="worker-b")
        view.as_dict()
    # Reading without the lease: the run, the lease, and the same six reads.
    with django_assert_num_queries(8):
        runs.hand_off("run-17").as_dict()


@pytest.mark.django_db
def test_resume_is_refused_while_another_workers_lease_is_live(run):
    runs.resume("run-17", worker="worker-a", ttl=timedelta(minutes=5))
    with pytest.raises(LeaseHeld, match="found it held by worker-a") as info:
        runs.resume("run-17", worker="worker-b")
    assert info.value.owner == "worker-a"
    assert leases.current_token("run:default:run-17") == 1


@pytest.mark.django_db
def test_the_same_worker_resuming_again_gets_a_larger_token(run):
    first = runs.resume("run-17", worker="worker-a")
    second = runs.resume("run-17", worker="worker-a")
    assert second.token > first.token


@pytest.mark.django_db
def test_after_a_resume_every_write_with_the_old_token_is_refused(run):
    runs.add_step(run, "ship")
    op = receipts.record_intent("shipments.create", "t", {"order": 17}, run=run)
    obligations.open(run, "email.confirmation", "confirm-17")
    old = runs.resume("run-17", worker="worker-a", ttl=timedelta(seconds=1)).token
    receipts.mark_submitted(op, fencing_token=old)
    leases.release("run:default:run-17", "worker-a", old)
    new = runs.resume("run-17", worker="worker-b").token
    late_writes = [
        lambda: receipts.mark_succeeded(op, external_id="s-1", fencing_token=old),
        lambda: runs.start_step(run, "ship", fencing_token=old),
        lambda: obligations.commit("confirm-17", "sent", fencing_token=old),
        lambda: facts.assert_fact("order:17", "status", "shipped", source="worker-a",
                                  run=run, fencing_token=old),
    ]
    for write in late_writes:
        with pytest.raises(StaleFencingToken, match=f"current token {new}"):
            write()
    op.refresh_from_db()
    assert op.state == State.SUBMITTED
    assert runs.start_step(run, "ship", fencing_token=new).state == "started"
    assert receipts.mark_succeeded(op, external_id="s-1", fencing_token=new).state == "succeeded"


@pytest.mark.django_db(transaction=True)
def test_resume_after_a_killed_worker_reproduces_its_view_and_refuses_its_late_writes():
    run = runs.start("Ship order 17", run_id="run-kill")
    runs.add_step(run, "charge-card")
    runs.add_step(run, "ship", depends_on=["charge-card"])
    child = spawn(
        """
        import json, time
        from datetime import timedelta
        from ledger import facts, obligations, receipts, runs

        view = runs.resume("run-kill", worker="worker-a", ttl=timedelta(seconds=1))
        token = view.token
        runs.commit_step("run-kill", "charge-card", fencing_token=token)
        runs.start_step("run-kill", "ship", fencing_token=token)
        op = receipts.record_intent(
            "shipments.create", "https://wms.example/api", {"order": 17}, run="run-kill",
            step="ship", idempotency_key=receipts.idempotency_key("run-kill", "ship"))
        receipts.mark_submitted(op, fencing_token=token)
        obligations.open("run-kill", "email.confirmation", "confirm-kill", fencing_token=token)
        facts.assert_fact("order:17", "status", "shipping", source="worker-a", run="run-kill",
                          fencing_token=token)
        seen = runs.hand_off("run-kill").as_dict()
        print("VIEW " + json.dumps(seen), flush=True)
        time.sleep(600)   # waiting on the carrier's response when the worker is killed
        """
    )
    before = json.loads(wait_for_line(child, "VIEW ").removeprefix("VIEW "))
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    view = _resume_once_the_lease_lapses("run-kill", worker="worker-b")
    after = view.as_dict()
    old_token = before["token"]
    assert before["holder"] == "worker-a" and after["holder"] == "worker-b"
    assert after["token"] > old_token
    for key in ("token", "holder"):
        before.pop(key), after.pop(key)
    assert after == before
    assert [s["state"] for s in after["steps"]] == ["committed", "started"]
    assert [o["state"] for o in after["open_operations"]] == ["submitted"]

    (op,) = view.open_operations
    with pytest.raises(StaleFencingToken):
        receipts.mark_succeeded(op, external_id="late", fencing_token=old_token)
    op.refresh_from_db()
    assert (op.state, op.external_id) == (State.SUBMITTED, "")


def _resume_once_the_lease_lapses(run_id, *, worker, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return runs.resume(run_id, worker=worker)
        except LeaseHeld:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# --- episodes ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_an_episode_records_what_was_said_with_credentials_masked(run):
    episode = episodes.record(run, "assistant", content="Calling the API with Bearer sk-123",
                              content_ref="s3://transcripts/run-17/4.json")
    episode.refresh_from_db()
    assert (episode.role, episode.tenant, episode.content_ref) == (
        "assistant", "default", "s3://transcripts/run-17/4.json")
    assert "sk-123" not in episode.content and "Bearer [redacted]" in episode.content
    assert episodes.record("run-17", "tool", content_ref="s3://x").content is None


@pytest.mark.django_db
def test_an_episode_needs_content_or_a_reference(run):
    with pytest.raises(InvalidInput, match="expected content or a content_ref, found neither"):
        episodes.record(run, "user")
    assert Episode.objects.count() == 0


@pytest.mark.django_db
def test_episodes_are_append_only(run):
    episode = episodes.record(run, "user", content="ship it")
    with pytest.raises(DatabaseError, match="expected episodes never to change"):
        raw("UPDATE ledger_episode SET content = 'edited' WHERE id = %s", [episode.pk])
    with pytest.raises(DatabaseError, match="only the retention purge to delete one"):
        raw("DELETE FROM ledger_episode WHERE id = %s", [episode.pk])


@pytest.mark.django_db
def test_resume_names_each_open_operations_next_moves_and_the_approvals_it_waits_for(run):
    from ledger import approvals
    from tests.factories import UserFactory

    admin = UserFactory(username="policy-admin", role="admin")
    approvals.set_policy("payments.*", user=admin, approvals_needed=2)
    runs.add_step(run, "refund")
    planned = receipts.record_intent("payments.refund", "https://psp", {"n": 1}, run=run,
                                     step="refund")
    unknown = receipts.record_intent("mail.send", "smtp://m", {"n": 2}, run=run,
                                     step="refund")
    receipts.mark_submitted(unknown)
    receipts.mark_outcome_unknown(unknown, error_code="TimeoutError")
    moves = {o["operation_id"]: o for o in runs.resume(run.run_id, worker="w").as_dict()[
        "open_operations"]}
    assert moves[planned.operation_id]["next_moves"] == [
        {"to": "abandoned", "by": "person"}, {"to": "submitted", "by": "agent"}]
    assert moves[planned.operation_id]["approval"] == {
        "needed": 2, "live": 0, "policies": "payments.*", "denied_reason": None}
    assert moves[unknown.operation_id]["next_moves"] == [
        {"to": "abandoned", "by": "person"}, {"to": "reconciling", "by": "reconciler"},
        {"to": "safe_to_retry", "by": "person"}, {"to": "succeeded", "by": "person"}]
    assert moves[unknown.operation_id]["approval"] is None


@pytest.mark.django_db
def test_run_ids_and_obligation_keys_are_unique_per_tenant():
    ours = runs.start("ours", run_id="run-1")
    theirs = runs.start("theirs", tenant="acme", run_id="run-1")
    assert ours.pk != theirs.pk
    assert runs.start("theirs", tenant="acme", run_id="run-1") == theirs
    with pytest.raises(InvalidInput, match="several tenants; name the tenant"):
        runs.hand_off("run-1")
    resumed = runs.resume("run-1", worker="w", tenant="acme")
    assert resumed.run == theirs
    assert runs.hand_off("run-1", tenant="default").token is None
    with pytest.raises(InvalidInput, match="to exist in tenant 'nobody'"):
        runs.as_run("run-1", tenant="nobody")
    obligations.open(ours, "refund", "refund-1")
    # Theirs is leased: opened under their lease's token, ours (never leased) without one.
    with pytest.raises(StaleFencingToken, match="run:acme:run-1"):
        obligations.open(theirs, "invoice", "refund-1")
    obligations.open(theirs, "invoice", "refund-1", fencing_token=resumed.token)
    with pytest.raises(InvalidInput, match="several tenants; name the tenant"):
        obligations.commit("refund-1", {"ours": True})
    assert obligations.commit("refund-1", {"ours": True}, tenant="default").run == ours
    # Theirs is leased: their lease fences their obligation, not ours.
    with pytest.raises(StaleFencingToken, match="run:acme:run-1"):
        obligations.cancel("refund-1", reason="no", tenant="acme")
