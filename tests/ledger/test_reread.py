"""Re-reads: a retried operation that succeeded is read again once its windows have passed.

The scenario of the issue against the simulated articles service: the first request is
still in the network when the reconciler looks; it lands later, beside the retry. With the
default window the absence is not taken as proof and nothing is sent twice; with a window
shorter than the delay the retry is sent, and the re-read flags the duplicate on the
succeeded operation: never silent.
"""

import http.client
from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from demo.simulated.articles import ArticleRejected, ArticlesClient, ArticlesService
from ledger import chain, leases, receipts, reconcile, selectors
from ledger.errors import StaleFencingToken
from ledger.models import Evidence, Operation, OperationEvent
from ledger.models.operations import Conflict
from ledger.states import ActorKind, State
from tests.factories import UserFactory

TRANSPORT = (OSError, http.client.HTTPException)


def later(monkeypatch, by: timedelta):
    """Every clock of the ledger, frozen `by` after now (the service keeps real time)."""
    moment = timezone.now() + by
    monkeypatch.setattr(reconcile.timezone, "now", lambda: moment)


def send(op, client, *, fault=None, in_flight_for=None):
    """What an agent does with a planned or safe_to_retry receipt: submit, call, record."""
    intent = op.intent
    try:
        with receipts.submit(op, rejections=(ArticleRejected,),
                             in_flight_for=in_flight_for) as attempt:
            answer = client.create(title=intent["title"], body=intent["body"],
                                   idempotency_key=op.idempotency_key, fault=fault)
            attempt.succeeded(external_id=answer["id"])
    except (ArticleRejected, *TRANSPORT):
        pass
    return Operation.objects.get(pk=op.pk)


@pytest.fixture
def service():
    # The service records keys without enforcing them (an SMTP server, a payment rail
    # without idempotency): only the ledger stands between a late copy and a duplicate.
    with ArticlesService(dedupe_keys=False) as running:
        yield running


def first_attempt_lost_in_the_network(service, *, in_flight_for=None):
    client = ArticlesClient(service.url)
    op = receipts.record_intent("articles.create", client.articles_url,
                                {"title": "Quarterly report", "body": "numbers"})
    op = send(op, client, fault="deliver_late", in_flight_for=in_flight_for)
    assert op.state == State.OUTCOME_UNKNOWN and service.late_requests() == 1
    return op, client


# --- the delayed-delivery knob of the simulated service ------------------------------------


def test_a_late_request_is_invisible_until_it_lands(service):
    client = ArticlesClient(service.url)
    with pytest.raises(TRANSPORT):
        client.create(title="T", idempotency_key="k-late", fault="deliver_late")
    status, answer = client.find_by_key("k-late")
    assert (status, answer["matches"], service.side_effects()) == (200, [], [])
    [landed] = service.deliver_late()
    assert landed["idempotency_key"] == "k-late"
    assert [a["id"] for a in client.find_by_key("k-late")[1]["matches"]] == [landed["id"]]
    assert service.late_requests() == 0 and service.deliver_late() == []


def test_a_late_request_lands_by_itself_after_late_seconds():
    with ArticlesService(late_seconds=0.05) as running:
        with pytest.raises(TRANSPORT):
            ArticlesClient(running.url).create(title="T", idempotency_key="k",
                                               fault="deliver_late")
        for timer in running._timers:
            timer.join(timeout=5)
        assert [a["idempotency_key"] for a in running.side_effects()] == ["k"]
        assert running.late_requests() == 0


# --- the late-delivery scenario --------------------------------------------------------------


@pytest.mark.django_db
def test_with_the_default_window_a_late_request_is_found_and_nothing_is_sent_twice(
    service, monkeypatch
):
    op, client = first_attempt_lost_in_the_network(service)
    # The reconciler looks while the request is still travelling: absent, but not proof.
    reconcile.run_once(worker="w1")
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN
    assert list(receipts.retries_due()) == []
    service.deliver_late()
    later(monkeypatch, timedelta(seconds=61))
    reconcile.run_once(worker="w1")
    op.refresh_from_db()
    [article] = service.side_effects()
    assert (op.state, op.attempt, op.external_id) == (State.SUCCEEDED, 1, article["id"])
    assert (op.conflict, op.reread_due_at) == ("", None)


@pytest.mark.django_db
def test_with_a_window_shorter_than_the_delay_the_duplicate_is_flagged_on_the_success(
    service, monkeypatch
):
    op, client = first_attempt_lost_in_the_network(service, in_flight_for=timedelta(seconds=1))
    later(monkeypatch, timedelta(seconds=2))
    reconcile.run_once(worker="w1")  # past the (too short) window: absence taken as proof
    [due] = receipts.retries_due()
    op = send(due, client, in_flight_for=timedelta(seconds=1))
    assert (op.state, op.attempt) == (State.SUCCEEDED, 2)
    assert op.reread_due_at == op.in_flight_until
    service.deliver_late()  # the first request lands after all, beside the retry
    assert len(service.side_effects()) == 2
    version = op.version

    later(monkeypatch, timedelta(seconds=5))
    reconcile.run_once(worker="w1")
    op.refresh_from_db()
    assert (op.state, op.conflict, op.reread_due_at) == (State.SUCCEEDED, "duplicate", None)
    assert op.version == version + 1
    evidence = Evidence.objects.filter(operation=op).order_by("-created_at", "-id").first()
    assert sorted(m["id"] for m in evidence.observed["matches"]) == sorted(
        a["id"] for a in service.side_effects())
    assert "re-read after attempt 2: 2 effects" in evidence.detail
    event = OperationEvent.objects.get(operation=op, version=op.version)
    assert (event.from_state, event.to_state, event.actor_kind) == (
        State.SUCCEEDED, State.SUCCEEDED, ActorKind.RECONCILER)
    assert "2 effects found" in event.reason
    assert event.evidence["conflict"] == {"from": "", "to": "duplicate"}
    # On the desk, waiting for a person.
    page = selectors.review_queue(UserFactory(username="desk"))
    assert [item.operation_id for item in page.items] == [op.operation_id]


# --- when re-reads are due ------------------------------------------------------------------

SEEN: list[reconcile.Verdict] = []  # what the test reconciler answers next, in order
ASKED: list[str] = []


@reconcile.register("test.reread")
class Scripted(reconcile.Reconciler):
    backoff_initial = timedelta(seconds=10)
    max_failures = 3
    # These tests read the re-read; the first look's absence is declared proof.
    trusted_absence = "a test double of a service that never received the first request"

    def lookup(self, op):
        return reconcile.ProvenAbsent({"matches": []})

    def reread(self, op):
        ASKED.append(op.operation_id)
        return SEEN.pop(0)


@pytest.fixture(autouse=True)
def _script():
    SEEN.clear()
    ASKED.clear()


def retried_success(monkeypatch, *, window=timedelta(seconds=1), external_id="e-1"):
    """A test.reread operation proven absent after its window, sent again, succeeded."""
    op = receipts.record_intent("test.reread", "https://svc.example/a",
                                {"n": timezone.now().timestamp()})
    receipts.mark_submitted(op, in_flight_for=window)
    receipts.mark_outcome_unknown(op, error_code="Timeout")
    later(monkeypatch, window * 2)
    reconcile.run_once(worker="w0")
    op = Operation.objects.get(pk=op.pk)
    assert op.state == State.SAFE_TO_RETRY
    receipts.mark_submitted(op, in_flight_for=window)
    return receipts.mark_succeeded(op, external_id=external_id)


@pytest.mark.django_db
def test_a_success_on_the_first_attempt_is_never_read_again(monkeypatch):
    op = receipts.record_intent("test.reread", "https://svc.example/a", {"n": 1})
    receipts.mark_submitted(op)
    receipts.mark_succeeded(op, external_id="e-1")
    later(monkeypatch, timedelta(days=1))
    reconcile.run_once(worker="w1")
    op.refresh_from_db()
    assert (op.reread_due_at, ASKED) == (None, [])


@pytest.mark.django_db
def test_the_re_read_waits_for_every_attempts_window(monkeypatch):
    op = receipts.record_intent("test.reread", "https://svc.example/a", {"n": 2})
    receipts.mark_submitted(op, in_flight_for=timedelta(minutes=10))
    receipts.mark_outcome_unknown(op, error_code="Timeout")
    first_window = Operation.objects.get(pk=op.pk).in_flight_until
    # A person decided before the window ended: the retry goes out inside it.
    receipts.resolve(Operation.objects.get(pk=op.pk), State.SAFE_TO_RETRY,
                     user=UserFactory(username="p", role="reviewer"), reason="not sent")
    op = Operation.objects.get(pk=op.pk)
    receipts.mark_submitted(op, in_flight_for=timedelta(seconds=1))
    receipts.mark_succeeded(op)
    op.refresh_from_db()
    assert op.reread_due_at == first_window > op.in_flight_until
    later(monkeypatch, timedelta(minutes=5))
    reconcile.run_once(worker="w1")
    assert ASKED == []
    SEEN.append(reconcile.Found("e-1"))
    later(monkeypatch, timedelta(minutes=11))
    reconcile.run_once(worker="w1")
    assert [op.operation_id] == ASKED


@pytest.mark.django_db
def test_one_effect_is_confirmed_with_evidence_and_the_re_read_is_done(monkeypatch):
    op = retried_success(monkeypatch)
    version = op.version
    SEEN.append(reconcile.Found("e-1", {"matches": [{"id": "e-1"}]}))
    later(monkeypatch, timedelta(seconds=10))
    assert reconcile.reread_due(worker="w1") == 0
    op.refresh_from_db()
    # The re-read is an event of its own (the state to itself), which seals its evidence.
    assert (op.conflict, op.reread_due_at, op.version) == ("", None, version + 1)
    evidence = Evidence.objects.filter(operation=op).latest("id")
    assert evidence.verdict == "found" and "one effect, as recorded" in evidence.detail
    event = op.events.get(version=version + 1)
    assert (event.from_state, event.to_state, event.actor_kind) == (
        "succeeded", "succeeded", "reconciler")
    assert chain.verify(actor="test").is_intact
    assert evidence.query["method"] == "reread"
    reconcile.run_once(worker="w1")
    assert [op.operation_id] == ASKED  # done: not asked twice


@pytest.mark.django_db
def test_a_retry_that_did_not_succeed_is_not_re_read(monkeypatch):
    op = receipts.record_intent("test.reread", "https://svc.example/a", {"n": 3})
    receipts.mark_submitted(op, in_flight_for=timedelta(seconds=1))
    receipts.mark_outcome_unknown(op, error_code="Timeout")
    later(monkeypatch, timedelta(seconds=2))
    reconcile.run_once(worker="w0")
    op = Operation.objects.get(pk=op.pk)
    receipts.mark_submitted(op, in_flight_for=timedelta(seconds=1))
    receipts.mark_rejected(op, error_code="422")
    later(monkeypatch, timedelta(minutes=5))
    reconcile.run_once(worker="w1")
    assert ASKED == []


@pytest.mark.django_db
def test_several_effects_on_an_operation_already_flagged_as_a_twin_keep_the_flag(monkeypatch):
    op = retried_success(monkeypatch)
    twin = receipts.record_intent("test.reread", "https://svc.example/a", op.intent,
                                  idempotency_key="other-key")
    receipts.mark_submitted(twin)
    receipts.mark_succeeded(twin, external_id="e-9")
    op.refresh_from_db()
    assert op.conflict == Conflict.DUPLICATE
    version, events = op.version, op.events.count()
    SEEN.append(reconcile.Ambiguous({"matches": [{"id": "e-1"}, {"id": "e-2"}]}))
    later(monkeypatch, timedelta(seconds=10))
    assert reconcile.reread_due(worker="w1") == 0
    op.refresh_from_db()
    assert (op.conflict, op.reread_due_at, op.version) == ("duplicate", None, version + 1)
    assert op.events.count() == events + 1  # the re-read's own, sealing its evidence
    assert "2 effects" in Evidence.objects.filter(operation=op).latest("id").detail


@pytest.mark.django_db
def test_a_re_read_that_cannot_count_is_tried_again_then_given_up_with_evidence(monkeypatch):
    op = retried_success(monkeypatch)
    SEEN.extend([reconcile.NotYet(), RuntimeError, reconcile.NotYet()])

    def answer(self, op):
        ASKED.append(op.operation_id)
        verdict = SEEN.pop(0)
        if verdict is RuntimeError:
            raise RuntimeError("service down")
        return verdict

    monkeypatch.setattr(Scripted, "reread", answer)
    later(monkeypatch, timedelta(seconds=10))
    reconcile.reread_due(worker="w1")
    op.refresh_from_db()
    assert op.reconcile_failures == 1
    due = op.reread_due_at
    assert due - timezone.now() == timedelta(seconds=10)  # the reconciler's backoff
    reconcile.reread_due(worker="w1")
    assert [op.operation_id] == ASKED  # not due again before the backoff
    later(monkeypatch, timedelta(seconds=30))
    reconcile.reread_due(worker="w1")
    op.refresh_from_db()
    assert op.reconcile_failures == 2 and op.reread_due_at is not None
    later(monkeypatch, timedelta(minutes=5))
    reconcile.reread_due(worker="w1")
    op.refresh_from_db()
    assert (op.reread_due_at, op.reconcile_failures, op.conflict) == (None, 0, "")
    details = list(Evidence.objects.filter(operation=op, query__method="reread")
                   .values_list("verdict", flat=True).order_by("id"))
    assert details == ["not_yet", "error", "not_yet"]


@pytest.mark.django_db
def test_a_re_read_under_another_workers_live_lease_is_skipped(monkeypatch):
    op = retried_success(monkeypatch)
    later(monkeypatch, timedelta(seconds=10))
    leases.acquire(f"reconcile:{op.operation_id}", "busy", timedelta(minutes=5))
    assert reconcile.claim_reread(worker="w1") is None
    assert ASKED == []


@pytest.mark.django_db
def test_a_finding_of_a_worker_whose_lease_was_taken_over_writes_nothing(monkeypatch):
    op = retried_success(monkeypatch)
    later(monkeypatch, timedelta(seconds=10))
    claim = reconcile.claim_reread(worker="w1", lease_ttl=timedelta(seconds=1))
    assert claim is not None and claim.operation.pk == op.pk
    evidence = Evidence.objects.filter(operation=op).count()
    # w1's lease expires (the database's clock) and w2 takes the re-read over.
    with connection.cursor() as cursor:
        cursor.execute("UPDATE ledger_lease SET expires_at = now() - interval '1 second' "
                       "WHERE resource = %s", [claim.resource])
    assert reconcile.claim_reread(worker="w2") is not None
    outcome = reconcile.Outcome(verdict="ambiguous", reconciler="t", query={},
                                observed={"matches": [{"id": "a"}, {"id": "b"}]})
    with pytest.raises(StaleFencingToken):
        reconcile.settle_reread(claim, outcome)
    op.refresh_from_db()
    assert op.conflict == "" and op.reread_due_at is not None
    assert Evidence.objects.filter(operation=op).count() == evidence


# --- what PostgreSQL allows ------------------------------------------------------------------


@pytest.mark.django_db
def test_a_flag_change_without_its_event_is_refused_by_postgresql(monkeypatch):
    op = retried_success(monkeypatch)
    expected = f"expected the statement changing it to version {op.version + 1} .*found none"
    with pytest.raises(IntegrityError, match=expected):
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
            Operation.objects.filter(pk=op.pk).update(conflict="duplicate",
                                                      version=op.version + 1)


@pytest.mark.django_db
def test_a_version_step_without_a_flag_change_or_on_an_open_operation_is_refused():
    done = receipts.record_intent("test.reread", "https://svc.example/a", {"n": 4})
    receipts.mark_submitted(done)
    receipts.mark_succeeded(done)
    open_op = receipts.record_intent("test.reread", "https://svc.example/a", {"n": 5})
    receipts.mark_submitted(open_op)
    for op, values in ((done, {}), (open_op, {"conflict": "duplicate"})):
        with pytest.raises(IntegrityError, match="unchanged without a state change"):
            with transaction.atomic():
                Operation.objects.filter(pk=op.pk).update(version=op.version + 1, **values)


@pytest.mark.django_db
def test_the_reconcile_loop_reports_each_re_read(monkeypatch):
    op = retried_success(monkeypatch)
    SEEN.append(reconcile.Ambiguous({"matches": [{"id": "e-1"}, {"id": "e-2"}]}))
    later(monkeypatch, timedelta(seconds=10))
    seen = []
    reconcile.run_once(worker="w1", on_verdict=lambda o, outcome: seen.append(
        (o.operation_id, o.state, outcome.detail)))
    [(operation_id, state, detail)] = seen
    assert (operation_id, state) == (op.operation_id, State.SUCCEEDED)
    assert detail.startswith("re-read: 2 effects, expected one: flagged duplicate")
