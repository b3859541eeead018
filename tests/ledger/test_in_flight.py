"""The in-flight window: an absence read while the request may still land proves nothing."""

from datetime import timedelta

import pytest
from django.utils import timezone

from ledger import receipts, reconcile
from ledger.errors import InvalidInput
from ledger.models import Evidence, Operation, OperationEvent
from ledger.states import State

ABSENT: list[str] = []  # operation ids the reconciler was asked about


@reconcile.register("test.inflight")
class AlwaysAbsent(reconcile.Reconciler):
    backoff_initial = timedelta(0)
    # What these tests read is the window, not the reader: its absence is declared proof
    # (a reader that says absent to everything is blind: tests/ledger/test_blind_verifier.py).
    trusted_absence = "a test double of a service that never received the request"

    def lookup(self, op):
        ABSENT.append(op.operation_id)
        return reconcile.ProvenAbsent({"matches": [], "status": 200})


@pytest.fixture(autouse=True)
def _clear():
    ABSENT.clear()


def sent_and_lost(*, retry_policy="if_absent_proven", **submit):
    op = receipts.record_intent("test.inflight", "https://svc.example/a",
                                {"title": f"t-{timezone.now().timestamp()}"},
                                retry_policy=retry_policy)
    receipts.mark_submitted(op, **submit)
    return receipts.mark_outcome_unknown(op, error_code="Timeout", detail="no reply")


def later(monkeypatch, by: timedelta):
    """The reconciler's clock, `by` after now (the database's rows keep their times)."""
    moment = timezone.now() + by
    monkeypatch.setattr(reconcile.timezone, "now", lambda: moment)


@pytest.mark.django_db
def test_mark_submitted_stores_the_default_window_of_sixty_seconds():
    op = receipts.record_intent("test.inflight", "https://svc.example/a", {"title": "d"})
    receipts.mark_submitted(op)
    op.refresh_from_db()
    assert op.in_flight_until - op.submitted_at == timedelta(seconds=60)
    receipts.mark_outcome_unknown(op, error_code="Timeout", detail="no reply")
    op.refresh_from_db()
    assert op.in_flight_until - op.unknown_since == timedelta(seconds=60)


@pytest.mark.django_db
def test_the_window_comes_from_the_setting_and_from_in_flight_for(settings):
    settings.LEDGER_IN_FLIGHT_SECONDS = 5
    op = sent_and_lost()
    assert op.in_flight_until - op.unknown_since == timedelta(seconds=5)
    other = sent_and_lost(in_flight_for=timedelta(minutes=3))
    assert other.in_flight_until - other.unknown_since == timedelta(minutes=3)


@pytest.mark.django_db
def test_submit_passes_its_window_on():
    op = receipts.record_intent("test.inflight", "https://svc.example/a", {"title": "x"})
    with receipts.submit(op, in_flight_for=timedelta(seconds=90)) as attempt:
        attempt.succeeded(external_id="a-1")
    op.refresh_from_db()
    assert op.in_flight_until - op.submitted_at == timedelta(seconds=90)


@pytest.mark.django_db
@pytest.mark.parametrize("bad", [timedelta(seconds=-1), 30, "60s", timedelta(days=8)])
def test_a_malformed_window_is_refused_and_nothing_is_written(bad):
    op = receipts.record_intent("test.inflight", "https://svc.example/a", {"title": "y"})
    with pytest.raises(InvalidInput, match="in_flight_for"):
        receipts.mark_submitted(op, in_flight_for=bad)
    op.refresh_from_db()
    assert (op.state, op.version) == (State.PLANNED, 1)


@pytest.mark.django_db
@pytest.mark.parametrize("policy", ["if_absent_proven", "never"])
def test_proven_absent_inside_the_window_stays_unknown_with_evidence_and_a_next_attempt(
    policy
):
    op = sent_and_lost(retry_policy=policy)
    finished = reconcile.run_once(worker="w1")
    op.refresh_from_db()
    assert (finished, op.state) == (0, State.OUTCOME_UNKNOWN)
    [ev] = Evidence.objects.filter(operation=op)
    assert ev.verdict == "proven_absent"
    assert op.next_attempt_at == op.in_flight_until
    event = OperationEvent.objects.filter(operation=op).order_by("-version").first()
    assert (event.from_state, event.to_state) == (State.RECONCILING, State.OUTCOME_UNKNOWN)
    assert "in flight" in event.reason
    # Not due again before the window has passed: a second pass does not ask.
    assert reconcile.run_once(worker="w2") == 0
    assert [op.operation_id] == ABSENT


@pytest.mark.django_db
def test_proven_absent_after_the_window_is_safe_to_retry(monkeypatch):
    op = sent_and_lost()
    reconcile.run_once(worker="w1")
    later(monkeypatch, timedelta(seconds=61))
    assert reconcile.run_once(worker="w1") == 1
    op.refresh_from_db()
    assert op.state == State.SAFE_TO_RETRY
    assert Evidence.objects.filter(operation=op, verdict="proven_absent").count() == 2


@pytest.mark.django_db
def test_proven_absent_after_the_window_of_a_never_operation_goes_to_manual_review(monkeypatch):
    op = sent_and_lost(retry_policy="never")
    later(monkeypatch, timedelta(seconds=61))
    reconcile.run_once(worker="w1")
    op.refresh_from_db()
    assert op.state == State.MANUAL_REVIEW


@pytest.mark.django_db
def test_each_attempt_sets_its_own_window(monkeypatch):
    op = sent_and_lost(in_flight_for=timedelta(seconds=10))
    first_window = op.in_flight_until
    later(monkeypatch, timedelta(seconds=11))
    reconcile.run_once(worker="w1")
    op = Operation.objects.get(pk=op.pk)
    assert op.state == State.SAFE_TO_RETRY
    receipts.mark_submitted(op, in_flight_for=timedelta(seconds=120))
    op.refresh_from_db()
    assert op.attempt == 2
    assert op.in_flight_until - op.submitted_at == timedelta(seconds=120)
    assert op.in_flight_until > first_window


# --- the window counts from the give-up (issue 30) ---------------------------------------


@pytest.mark.django_db
def test_the_window_counts_from_the_outcome_unknown_transition_not_from_submission():
    op = sent_and_lost(in_flight_for=timedelta(seconds=30))
    op.refresh_from_db()
    assert op.in_flight_until - op.unknown_since == timedelta(seconds=30)
    assert op.unknown_since > op.submitted_at


@pytest.mark.django_db
def test_a_swept_submission_counts_its_window_from_the_sweep(monkeypatch):
    op = receipts.record_intent("test.inflight", "https://svc.example/a", {"title": "swept"})
    receipts.mark_submitted(op, in_flight_for=timedelta(seconds=45))
    later(monkeypatch, timedelta(hours=2))
    assert reconcile.sweep_stale_submissions(older_than=timedelta(hours=1)) == 1
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN
    assert op.in_flight_until - op.unknown_since == timedelta(seconds=45)
    assert op.in_flight_until > op.submitted_at + timedelta(hours=1)


@pytest.mark.django_db
def test_a_call_that_hung_past_its_window_then_timed_out_is_not_retried_into_a_duplicate(
    monkeypatch,
):
    """Default settings; the simulated service holds the request and lands it late, and it
    does not honour idempotency keys, so only the ledger can prevent the duplicate."""
    from demo.simulated.articles import ArticlesClient, ArticlesService
    from ledger import conf
    from ledger.errors import OutcomeUnknown

    real_now = timezone.now
    offset = {"by": -timedelta(seconds=conf.IN_FLIGHT_SECONDS + 1)}
    monkeypatch.setattr(timezone, "now", lambda: real_now() + offset["by"])

    with ArticlesService() as service:
        service.dedupe_keys = False
        client = ArticlesClient(service.url, timeout=5)
        calls = []

        @receipts.action("articles.create", target=client.articles_url,
                         key=lambda title: f"hung-{title}")
        def publish(title: str) -> dict:
            calls.append(title)
            # Submitted a window and a second ago: the request hung all that time, and
            # times out now, with the request still in the network.
            offset["by"] = timedelta(0)
            fault = "deliver_late" if len(calls) == 1 else None
            return client.create(title=title, body="text", idempotency_key=f"hung-{title}",
                                 fault=fault)

        with pytest.raises(OSError):
            publish("Hung")
        op = Operation.objects.get(idempotency_key="hung-Hung")
        assert op.state == State.OUTCOME_UNKNOWN
        reconcile.run_once(worker="w1")  # reads absent: the request has not landed yet
        op.refresh_from_db()
        assert op.state == State.OUTCOME_UNKNOWN
        with pytest.raises(OutcomeUnknown):
            publish("Hung")  # not sent again
        service.deliver_late()
        offset["by"] = timedelta(seconds=conf.IN_FLIGHT_SECONDS + 1)
        reconcile.run_once(worker="w1")
        op.refresh_from_db()
        assert op.state == State.SUCCEEDED
        assert calls == ["Hung"]
        assert len(service.side_effects()) == 1
