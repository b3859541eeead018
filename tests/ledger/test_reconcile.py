"""The reconciliation engine: verdicts and their evidence, workers, fencing, crashes."""

import io
import signal
import threading
import time
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection, connections
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from ledger import leases, reconcile
from ledger.canonical import REDACTED
from ledger.errors import InvalidInput, StaleFencingToken
from ledger.models import Evidence, Lease, Operation, OperationEvent, Run
from ledger.states import ActorKind, State
from tests.factories import OperationFactory
from tests.support.processes import spawn, wait_for_line

# --- a scripted reconciler: each operation's intent says what lookup and search answer ----

CALLS: list[tuple[str, str]] = []  # (method, operation_id) of every call


def _answer(op, spec):
    kind, _, arg = spec.partition(":")
    observed = {"seen": kind, "headers": {"Authorization": "Bearer sk-live-123"}}
    return {
        "none": lambda: None,
        # The service records keys: what it found carries this operation's.
        "found": lambda: reconcile.Found(arg or "ext-1", observed,
                                         idempotency_key=op.idempotency_key),
        "absent": lambda: reconcile.ProvenAbsent(observed),
        "ambiguous": lambda: reconcile.Ambiguous({"matches": ["a", "b"]}, reason="two matches",
                                                 matched_by="fingerprint"),
        "notyet": lambda: reconcile.NotYet(observed),
        "bad": lambda: "succeeded, trust me",
    }[kind]()


@reconcile.register("test.scripted")
class Scripted(reconcile.Reconciler):
    backoff_initial = timedelta(0)
    grace_period = timedelta(days=1)
    # The "service" is the script in each intent: its absence is what the test says it is.
    # Controls and blind readers: tests/ledger/test_blind_verifier.py.
    trusted_absence = "a scripted test double: the intent says what the service shows"

    def lookup(self, op):
        CALLS.append(("lookup", op.operation_id))
        spec = op.intent["lookup"]
        if spec == "raise":
            raise ConnectionError("articles service down, password=hunter2")
        return _answer(op, spec)

    def search(self, op):
        CALLS.append(("search", op.operation_id))
        return _answer(op, op.intent.get("search", "none"))


def unknown(lookup, search="none", *, operation="test.scripted", **kwargs):
    intent = {"title": f"t-{time.monotonic_ns()}", "lookup": lookup, "search": search}
    return OperationFactory(state=State.OUTCOME_UNKNOWN, operation=operation, intent=intent,
                            **kwargs)


def reconcile_one(op, **kwargs):
    finished = reconcile.run_once(worker="w1", **kwargs)
    op.refresh_from_db()
    return finished, list(Evidence.objects.filter(operation=op))


def last_event(op):
    return OperationEvent.objects.filter(operation=op).order_by("-version").first()


@pytest.fixture(autouse=True)
def _clear_calls():
    CALLS.clear()


# --- each verdict path, with its evidence --------------------------------------------------


@pytest.mark.django_db
def test_found_by_lookup_succeeds_stores_the_external_id_and_never_searches():
    op = unknown("found:article-7")
    finished, evidence = reconcile_one(op)
    assert (finished, op.state, op.external_id) == (1, State.SUCCEEDED, "article-7")
    assert list(CALLS) == [("lookup", op.operation_id)]
    [ev] = evidence
    assert (ev.verdict, ev.matched_by, ev.reconciler) == ("found", "idempotency_key",
                                                          Scripted.label())
    assert ev.query == {"method": "lookup", "idempotency_key": op.idempotency_key,
                        "external_id": ""}
    event = last_event(op)
    assert (event.from_state, event.to_state, event.actor_kind) == (
        State.RECONCILING, State.SUCCEEDED, ActorKind.RECONCILER)
    assert event.fencing_token == leases.current_token(f"reconcile:{op.operation_id}")


@pytest.mark.django_db
def test_lookup_returning_none_falls_back_to_the_fingerprint_search():
    op = unknown("none", "found:article-9")
    _, [ev] = reconcile_one(op)
    assert list(CALLS) == [("lookup", op.operation_id), ("search", op.operation_id)]
    assert (op.state, op.external_id) == (State.SUCCEEDED, "article-9")
    assert (ev.verdict, ev.matched_by) == ("found", "fingerprint")
    assert ev.query == {"method": "search", "fingerprint": op.intent_fingerprint}


@pytest.mark.django_db
def test_proven_absent_is_safe_to_retry_when_the_retry_policy_allows_it():
    op = unknown("absent")
    finished, [ev] = reconcile_one(op)
    assert (finished, op.state, ev.verdict) == (1, State.SAFE_TO_RETRY, "proven_absent")


@pytest.mark.django_db
def test_proven_absent_goes_to_manual_review_when_the_retry_policy_is_never():
    op = unknown("absent", retry_policy="never")
    _, [ev] = reconcile_one(op)
    assert (op.state, ev.verdict) == (State.MANUAL_REVIEW, "proven_absent")
    assert "never" in last_event(op).reason


@pytest.mark.django_db
def test_ambiguous_goes_to_manual_review_with_what_was_seen():
    op = unknown("ambiguous")
    _, [ev] = reconcile_one(op)
    assert (op.state, ev.verdict, ev.matched_by) == (State.MANUAL_REVIEW, "ambiguous",
                                                     "fingerprint")
    assert ev.observed == {"matches": ["a", "b"]}
    assert "two matches" in ev.detail


@pytest.mark.django_db
def test_an_operation_without_a_reconciler_goes_to_manual_review():
    op = unknown("found", operation="test.nobody-reconciles-this")
    finished, [ev] = reconcile_one(op)
    assert (finished, op.state, ev.verdict, ev.reconciler) == (
        1, State.MANUAL_REVIEW, "no_reconciler", "")
    assert "test.nobody-reconciles-this" in ev.detail


@pytest.mark.django_db
def test_not_yet_inside_the_grace_period_stays_unknown_with_a_next_attempt_and_backoff(
    monkeypatch,
):
    monkeypatch.setattr(Scripted, "backoff_initial", timedelta(minutes=1))
    op = unknown("notyet")
    before = timezone.now()
    finished, [ev] = reconcile_one(op)
    assert (finished, op.state, ev.verdict) == (0, State.OUTCOME_UNKNOWN, "not_yet")
    assert op.next_attempt_at >= before + timedelta(minutes=1)
    assert op.reconcile_attempts == 1
    # Not due yet: the next pass leaves it alone.
    assert reconcile.run_once(worker="w2") == 0
    assert Evidence.objects.filter(operation=op).count() == 1


@pytest.mark.django_db
def test_backoff_doubles_with_each_attempt_and_stops_at_the_maximum(monkeypatch):
    monkeypatch.setattr(Scripted, "backoff_initial", timedelta(seconds=10))
    monkeypatch.setattr(Scripted, "backoff_max", timedelta(seconds=35))
    assert [reconcile._backoff(Scripted, n).total_seconds() for n in (1, 2, 3, 4)] == [
        10, 20, 35, 35]


@pytest.mark.django_db
def test_not_yet_after_the_grace_period_goes_to_manual_review(monkeypatch):
    monkeypatch.setattr(Scripted, "grace_period", timedelta(0))
    op = unknown("notyet")
    finished, [ev] = reconcile_one(op)
    assert (finished, op.state, ev.verdict) == (1, State.MANUAL_REVIEW, "not_yet")
    assert "grace period" in last_event(op).reason


@pytest.mark.django_db
def test_a_reconciler_that_keeps_raising_goes_to_manual_review_after_the_configured_failures(
    settings,
):
    settings.LEDGER_RECONCILE_MAX_FAILURES = 2
    op = unknown("raise")
    assert reconcile_one(op)[0] == 0
    assert (op.state, op.reconcile_failures) == (State.OUTCOME_UNKNOWN, 1)
    finished, evidence = reconcile_one(op)
    assert (finished, op.state, op.reconcile_failures) == (1, State.MANUAL_REVIEW, 2)
    assert [ev.verdict for ev in evidence] == ["error", "error"]
    assert "ConnectionError: articles service down" in evidence[-1].detail
    assert "hunter2" not in evidence[-1].detail + str(evidence[-1].observed)
    assert "failed 2 times" in last_event(op).reason


@pytest.mark.django_db
def test_the_default_number_of_failures_is_three():
    op = unknown("raise")
    for _ in range(3):
        reconcile_one(op)
    assert (op.state, op.reconcile_failures) == (State.MANUAL_REVIEW, 3)


@pytest.mark.django_db
def test_a_malformed_verdict_is_counted_as_a_reconciler_error():
    op = unknown("bad")
    _, [ev] = reconcile_one(op)
    assert (op.state, ev.verdict) == (State.OUTCOME_UNKNOWN, "error")
    assert "expected lookup to return Found" in ev.detail


@pytest.mark.django_db
def test_found_with_another_id_than_the_receipt_already_names_is_ambiguous():
    op = unknown("found:article-2")
    with connection.cursor() as cursor:  # as a superuser would, behind the triggers
        cursor.execute("SET session_replication_role = replica")
        cursor.execute("UPDATE ledger_operation SET external_id = 'article-1' WHERE id = %s",
                       [op.pk])
        cursor.execute("RESET session_replication_role")
    op.refresh_from_db()
    _, [ev] = reconcile_one(op)
    assert (op.state, op.external_id, ev.verdict) == (State.MANUAL_REVIEW, "article-1",
                                                      "ambiguous")


@pytest.mark.django_db
def test_observed_data_is_redacted_like_intents():
    op = unknown("found")
    _, [ev] = reconcile_one(op)
    assert ev.observed["headers"] == {"Authorization": REDACTED}
    assert "sk-live-123" not in str(ev.observed)


@pytest.mark.django_db
def test_every_verdict_leaves_exactly_one_evidence_row_and_one_event():
    ops = [unknown(spec) for spec in ("found", "absent", "ambiguous", "notyet", "raise")]
    reconcile.run_once(worker="w1")
    for op in ops:
        assert Evidence.objects.filter(operation=op).count() == 1
        events = OperationEvent.objects.filter(operation=op, actor_kind=ActorKind.RECONCILER)
        assert [e.to_state for e in events.order_by("version")][0] == State.RECONCILING
        assert events.count() == 2


# --- claims, leases and fencing ------------------------------------------------------------


def wait_for_expiry(resource, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not Lease.objects.filter(resource=resource, expires_at__lte=Now()).exists():
        assert time.monotonic() < deadline, f"expected the lease {resource} to expire"
        time.sleep(0.02)


@pytest.mark.django_db
def test_an_operation_under_a_live_lease_is_not_claimed_again():
    op = unknown("found")
    claim = reconcile.claim_next(worker="a", lease_ttl=timedelta(minutes=5))
    assert claim.operation.pk == op.pk
    assert reconcile.claim_next(worker="b") is None
    op.refresh_from_db()
    assert op.state == State.RECONCILING


@pytest.mark.django_db
def test_a_late_write_from_a_worker_whose_lease_was_taken_over_is_refused_and_leaves_no_trace():
    op = unknown("found:article-b")
    a = reconcile.claim_next(worker="a", lease_ttl=timedelta(milliseconds=200))
    outcome_a = reconcile.consult(a.operation)  # A pauses past its TTL after this read
    wait_for_expiry(a.resource)
    b = reconcile.claim_next(worker="b", lease_ttl=timedelta(minutes=5))
    assert (b.operation.pk, b.taken_over_from) == (op.pk, "a")
    assert b.token > a.token
    events_before = OperationEvent.objects.filter(operation=op).count()
    # A wakes up before B writes: its verdict is refused although the version still matches.
    with pytest.raises(StaleFencingToken, match=f"expected fencing token {a.token}"):
        reconcile.settle(a, outcome_a)
    assert OperationEvent.objects.filter(operation=op).count() == events_before
    assert not Evidence.objects.filter(operation=op).exists()
    reconcile.settle(b, reconcile.consult(b.operation))
    # ...and after B wrote, A is refused again.
    with pytest.raises(StaleFencingToken):
        reconcile.settle(a, outcome_a)
    op.refresh_from_db()
    assert op.state == State.SUCCEEDED
    [ev] = Evidence.objects.filter(operation=op)
    assert ev.verdict == "found"
    assert not OperationEvent.objects.filter(operation=op, fencing_token=a.token,
                                             to_state=State.SUCCEEDED).exists()
    assert "taken over from a" in last_event(op).reason
    assert last_event(op).fencing_token == b.token


@pytest.mark.django_db(transaction=True)
def test_a_claim_whose_verdict_was_lost_is_taken_back_by_its_worker_at_once():
    """A worker whose connection went before its verdict was stored (a failover) finds its
    own claim at its next pass, without waiting out its own lease; another worker leaves
    that live lease alone."""
    op = unknown("found:article-c")
    lost = reconcile.claim_next(worker="a", lease_ttl=timedelta(minutes=5))
    assert lost.operation.pk == op.pk  # ... and its verdict is never stored
    assert reconcile.claim_next(worker="b") is None
    assert reconcile.run_once(worker="a") == 1
    op.refresh_from_db()
    assert op.state == State.SUCCEEDED
    assert last_event(op).fencing_token > lost.token
    assert "taken over" not in last_event(op).reason


@reconcile.register("test.slow")
class Slow(reconcile.Reconciler):
    """Sleeps in every lookup; the first three calls meet at a barrier (all three workers
    hold an operation at the same time)."""

    barrier = threading.Barrier(3, timeout=60)
    lock = threading.Lock()
    calls: list[tuple[str, int]] = []

    def lookup(self, op):
        with self.lock:
            self.calls.append((threading.current_thread().name, op.pk))
            first_three = len(self.calls) <= 3
        if first_three:
            self.barrier.wait()
        time.sleep(0.005)
        return reconcile.Found(f"ext-{op.pk}")


@pytest.mark.django_db(transaction=True)
def test_three_workers_over_two_hundred_operations_reconcile_each_exactly_once():
    ops = [OperationFactory(state=State.OUTCOME_UNKNOWN, operation="test.slow")
           for _ in range(200)]
    Slow.calls.clear()
    Slow.barrier.reset()
    finished = {}

    def work(name):
        try:
            finished[name] = reconcile.run_once(worker=name, limit=1000)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work, args=(f"w{i}",), name=f"w{i}") for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(finished.values()) == 200
    assert all(count >= 1 for count in finished.values()), finished
    assert sorted(pk for _, pk in Slow.calls) == sorted(op.pk for op in ops)
    assert set(Operation.objects.filter(operation="test.slow").values_list("state", flat=True)) \
        == {State.SUCCEEDED}
    for op in ops:
        assert Evidence.objects.filter(operation=op).count() == 1
        assert OperationEvent.objects.filter(operation=op, to_state=State.RECONCILING).count() == 1


@reconcile.register("test.killed")
class AfterTheCrash(reconcile.Reconciler):
    def lookup(self, op):
        return reconcile.Found("ext-after-crash")


@pytest.mark.django_db(transaction=True)
def test_a_worker_killed_mid_reconcile_is_taken_over_after_its_lease_expires():
    op = OperationFactory(state=State.OUTCOME_UNKNOWN, operation="test.killed")
    child = spawn("""
        import time
        from datetime import timedelta
        from ledger import reconcile

        @reconcile.register("test.killed")
        class Hangs(reconcile.Reconciler):
            def lookup(self, op):
                print("LOOKING", op.operation_id, flush=True)
                time.sleep(600)

        reconcile.run_once(worker="doomed", lease_ttl=timedelta(seconds=1))
    """)
    assert wait_for_line(child, "LOOKING") == f"LOOKING {op.operation_id}"
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
    op.refresh_from_db()
    assert op.state == State.RECONCILING
    assert not Evidence.objects.filter(operation=op).exists()
    doomed_token = last_event(op).fencing_token

    wait_for_expiry(f"reconcile:{op.operation_id}")
    assert reconcile.run_once(worker="survivor") == 1
    op.refresh_from_db()
    assert (op.state, op.external_id) == (State.SUCCEEDED, "ext-after-crash")
    [ev] = Evidence.objects.filter(operation=op)
    assert ev.verdict == "found"
    events = list(OperationEvent.objects.filter(operation=op).order_by("version"))
    assert [(e.to_state, e.actor_id) for e in events[-2:]] == [
        (State.RECONCILING, "doomed"), (State.SUCCEEDED, "survivor")]
    assert events[-1].fencing_token > doomed_token
    assert "taken over from doomed" in events[-1].reason


# --- crashed senders -----------------------------------------------------------------------


@pytest.mark.django_db
def test_sweep_turns_old_submissions_of_gone_senders_into_outcome_unknown_and_says_why():
    orphan = OperationFactory(state=State.SUBMITTED)
    dead_run = Run.objects.create(run_id="run-dead")
    token = leases.acquire("run:default:run-dead", "agent-1", timedelta(minutes=5))
    leases.release("run:default:run-dead", "agent-1", token)
    of_dead_run = OperationFactory(state=State.SUBMITTED, run=dead_run)
    live_run = Run.objects.create(run_id="run-live")
    leases.acquire("run:default:run-live", "agent-2", timedelta(minutes=5))
    of_live_run = OperationFactory(state=State.SUBMITTED, run=live_run)
    of_unleased_run = OperationFactory(state=State.SUBMITTED,
                                       run=Run.objects.create(run_id="run-unleased"))

    assert reconcile.sweep_stale_submissions(older_than=timedelta(hours=1)) == 0
    assert reconcile.sweep_stale_submissions(older_than=timedelta(0)) == 3
    assert "run:default:run-unleased was never leased" in last_event(of_unleased_run).reason
    for op in (orphan, of_dead_run, of_live_run):
        op.refresh_from_db()
    assert (orphan.state, of_dead_run.state, of_live_run.state) == (
        State.OUTCOME_UNKNOWN, State.OUTCOME_UNKNOWN, State.SUBMITTED)
    assert orphan.unknown_since is not None and orphan.error_code == "SenderGone"
    assert "no run holds a lease" in last_event(orphan).reason
    event = last_event(of_dead_run)
    assert "run:default:run-dead of agent-1 expired" in event.reason
    assert (event.actor_kind, event.evidence["run"]) == (ActorKind.SYSTEM, "run-dead")


@pytest.mark.django_db
def test_run_once_sweeps_stale_submissions_and_then_reconciles_them():
    op = OperationFactory(state=State.SUBMITTED, operation="test.scripted",
                          intent={"lookup": "found:article-5"})
    assert reconcile.run_once(worker="w1", stale_after=timedelta(0)) == 1
    op.refresh_from_db()
    assert (op.state, op.external_id) == (State.SUCCEEDED, "article-5")
    assert [e.to_state for e in OperationEvent.objects.filter(operation=op)][-3:] == [
        State.OUTCOME_UNKNOWN, State.RECONCILING, State.SUCCEEDED]


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("kwargs, message", [
    ({"worker": ""}, "expected worker"),
    ({"worker": "w", "limit": 0}, "expected limit"),
])
def test_run_once_refuses_bad_arguments(kwargs, message):
    with pytest.raises(InvalidInput, match=message):
        reconcile.run_once(**kwargs)


def test_registering_a_second_reconciler_for_a_name_is_refused():
    with pytest.raises(InvalidInput, match="expected one reconciler for 'test.scripted'"):
        @reconcile.register("test.scripted")
        class Other(reconcile.Reconciler):
            pass


def test_registering_something_that_is_not_a_reconciler_is_refused():
    with pytest.raises(InvalidInput, match="subclass of reconcile.Reconciler"):
        reconcile.register("test.not-a-class")(object)


@pytest.mark.django_db
def test_sweep_refuses_a_negative_threshold():
    with pytest.raises(InvalidInput, match="older_than"):
        reconcile.sweep_stale_submissions(older_than=timedelta(seconds=-1))


# --- manage.py reconcile -------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_reconcile_command_prints_one_line_per_verdict():
    found, absent = unknown("found:article-3"), unknown("absent")
    out = io.StringIO()
    call_command("reconcile", "--once", "--workers", "2", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("reconcile: started")
    assert any(line.startswith(f"{found.operation_id} test.scripted found -> succeeded")
               for line in lines)
    assert any(line.startswith(f"{absent.operation_id} test.scripted proven_absent -> "
                               "safe_to_retry") for line in lines)
    assert lines[-1] == "reconcile: stopped; finished 2 operation(s)"


@pytest.mark.django_db(transaction=True)
def test_the_reconcile_loop_stops_cleanly_on_sigterm():
    child = spawn("""
        from django.core.management import call_command
        call_command("reconcile", "--workers", "2", "--interval", "0.1")
    """)
    wait_for_line(child, "reconcile: started")
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert "reconcile: stopped" in out


@pytest.mark.django_db
def test_several_matching_effects_flag_the_operation_until_a_person_decides(reviewer):
    from ledger.models.operations import Conflict
    from ledger.receipts import resolve

    op = unknown("none", "ambiguous")
    reconcile_one(op)
    assert (op.state, op.conflict) == (State.MANUAL_REVIEW, Conflict.AMBIGUOUS)
    resolve(op, State.SUCCEEDED, user=reviewer, reason="a-2 is ours", external_id="a-2")
    op.refresh_from_db()
    assert op.conflict == ""


@pytest.mark.django_db
def test_two_operations_with_one_fingerprint_that_both_succeed_are_both_flagged_duplicate():
    from ledger.models.operations import Conflict

    intent = {"title": "Same article"}
    first = OperationFactory(state=State.SUCCEEDED, intent=intent, idempotency_key="twin-1")
    assert first.conflict == ""
    second = OperationFactory(state=State.SUCCEEDED, intent=intent, idempotency_key="twin-2")
    first.refresh_from_db()
    assert (first.conflict, second.conflict) == (Conflict.DUPLICATE, Conflict.DUPLICATE)
    other = OperationFactory(state=State.SUCCEEDED, intent={"title": "Another"})
    assert other.conflict == ""


# --- what one reconciled operation costs ---------------------------------------------------


def statements(captured) -> list[str]:
    """What was sent, without the savepoints the test's own transaction adds."""
    return [q["sql"] for q in captured if "SAVEPOINT" not in q["sql"]]


@pytest.mark.django_db
def test_a_claim_is_three_statements_and_a_verdict_four():
    # The claim: the pick (orphaned first, then the oldest due: one statement), the lease,
    # the move to reconciling. The verdict: the row's lock, the evidence, the lease's
    # release, the transition. The lease's token is checked by PostgreSQL's event trigger,
    # not by a statement of its own.
    op = unknown("found:ext-7")
    with CaptureQueriesContext(connection) as claiming:
        claim = reconcile.claim_next(worker="w1")
    assert claim.operation.pk == op.pk
    outcome = reconcile.consult(claim.operation)
    with CaptureQueriesContext(connection) as settling:
        reconcile.settle(claim, outcome)
    assert len(statements(claiming)) == 3, statements(claiming)
    assert len(statements(settling)) == 4, statements(settling)
    op.refresh_from_db()
    assert (op.state, op.external_id) == (State.SUCCEEDED, "ext-7")


# --- the unknown-outcome policy per operation name ------------------------------------------


@pytest.mark.django_db
def test_a_policy_without_automatic_retry_sends_a_proven_absence_to_a_person(settings):
    settings.LEDGER_UNKNOWN_OUTCOME_POLICIES = {"test.*": {"automatic_retry": False},
                                                "other.*": {"attempts": 9}}
    op = unknown("absent")
    finished, [ev] = reconcile_one(op)
    assert (finished, op.state, ev.verdict) == (1, State.MANUAL_REVIEW, "proven_absent")
    assert "unknown-outcome policy for 'test.*' sends no retry without a person" in \
        last_event(op).reason


@pytest.mark.django_db
def test_a_policy_sets_the_readings_before_manual_review_the_exact_name_first(settings):
    settings.LEDGER_UNKNOWN_OUTCOME_POLICIES = {"test.*": {"attempts": 5},
                                                "test.scripted": {"attempts": 1}}
    assert reconcile.unknown_outcome_policy("test.scripted").attempts == 1
    assert reconcile.unknown_outcome_policy("test.other").attempts == 5
    assert reconcile.unknown_outcome_policy("mail.send") == reconcile.UnknownOutcomePolicy()
    op = unknown("raise")
    _, [ev] = reconcile_one(op)
    assert (op.state, ev.verdict) == (State.MANUAL_REVIEW, "error")
    assert "reconciler failed 1 times (limit 1)" in last_event(op).reason


@pytest.mark.django_db
def test_a_policy_window_ends_not_yet_sooner_than_the_reconcilers_grace(settings, monkeypatch):
    settings.LEDGER_UNKNOWN_OUTCOME_POLICIES = {"test.scripted": {"window_seconds": 60}}
    op = unknown("notyet")
    moment = timezone.now() + timedelta(seconds=61)  # Scripted's own grace: a day
    monkeypatch.setattr(reconcile.timezone, "now", lambda: moment)
    _, [ev] = reconcile_one(op)
    assert (op.state, ev.verdict) == (State.MANUAL_REVIEW, "not_yet")
    assert "grace period of 0:01:00" in last_event(op).reason


# --- blind readings inside the in-flight window ------------------------------------------------


@reconcile.register("test.sees-nothing")
class SeesNothing(reconcile.Reconciler):
    """Absent for everything, and declares nothing: with no control it proves nothing."""

    def lookup(self, op):
        return reconcile.ProvenAbsent({"matches": []})


@pytest.mark.django_db
def test_a_blind_reading_inside_the_in_flight_window_waits_for_it_uncounted():
    from ledger import receipts

    op = receipts.record_intent("test.sees-nothing", "https://svc.example/x", {"n": 1})
    receipts.mark_submitted(op, in_flight_for=timedelta(seconds=60))
    op = receipts.mark_outcome_unknown(op, error_code="Timeout")
    _, [ev] = reconcile_one(op)
    assert (op.state, ev.verdict, op.reconcile_failures) == (State.OUTCOME_UNKNOWN,
                                                             "verifier_blind", 0)
    assert op.next_attempt_at == op.in_flight_until
    assert ev.observed["positive_control"] == {"status": "none"}
    assert "may still be in flight" in last_event(op).reason
