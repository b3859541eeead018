"""The simulated articles service, its failure modes, its reconciler, and kill-and-resume."""

import http.client
import json
import signal
from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from demo.simulated.agent import STEPS, publish_articles
from demo.simulated.articles import (
    ArticleRejected,
    ArticlesClient,
    ArticlesReconciler,
    ArticlesService,
)
from ledger import conf, receipts, reconcile
from ledger.models import Evidence, Operation
from ledger.states import State
from tests.support.processes import spawn, wait_for_line

TRANSPORT = (OSError, http.client.HTTPException)


@pytest.fixture
def service():
    with ArticlesService() as running:
        yield running


def send(service, title, *, fault=None, timeout=5.0, retry_policy="if_absent_proven",
         body="text", in_flight_for=None):
    """What an agent does: record, submit, call; returns the operation as it ended."""
    client = ArticlesClient(service.url, timeout=timeout)
    op = receipts.record_intent("articles.create", client.articles_url,
                                {"title": title, "body": body}, retry_policy=retry_policy)
    try:
        with receipts.submit(op, rejections=(ArticleRejected,),
                             in_flight_for=in_flight_for) as attempt:
            answer = client.create(title=title, body=body, idempotency_key=op.idempotency_key,
                                   fault=fault)
            attempt.succeeded(external_id=answer["id"])
    except (ArticleRejected, *TRANSPORT):
        pass
    op.refresh_from_db()
    return op


def reconciled(op):
    reconcile.run_once(worker="test")
    op.refresh_from_db()
    return op, list(Evidence.objects.filter(operation=op))


# --- the service ---------------------------------------------------------------------------


def test_the_service_listens_on_127_0_0_1_only_on_a_random_port():
    with ArticlesService() as one, ArticlesService() as two:
        assert one._server.server_address[0] == "127.0.0.1"
        assert one.url.startswith("http://127.0.0.1:") and one.url != two.url


def test_the_client_refuses_any_host_but_127_0_0_1():
    for url in ("http://example.com:80", "https://127.0.0.1:443", "http://localhost:8000"):
        with pytest.raises(ValueError, match="expected the simulated service"):
            ArticlesClient(url)


def test_commit_then_drop_the_response_creates_the_article_but_the_client_sees_an_error(
    service,
):
    with pytest.raises(TRANSPORT):
        ArticlesClient(service.url).create(title="A", idempotency_key="k1",
                                           fault="drop_response")
    assert [a["idempotency_key"] for a in service.side_effects()] == ["k1"]


def test_a_lost_request_creates_nothing(service):
    service.fail_next("lose_request")
    with pytest.raises(TRANSPORT):
        ArticlesClient(service.url).create(title="A", idempotency_key="k1")
    assert service.side_effects() == []


def test_a_slow_answer_times_the_client_out_after_the_commit(service):
    service.slow_seconds = 1.0
    with pytest.raises(TimeoutError):
        ArticlesClient(service.url, timeout=0.2).create(title="A", idempotency_key="k1",
                                                        fault="slow")
    assert len(service.side_effects()) == 1


def test_an_empty_title_is_rejected_and_creates_nothing(service):
    with pytest.raises(ArticleRejected, match="422 title must not be empty"):
        ArticlesClient(service.url).create(title=" ", idempotency_key="k1")
    assert service.side_effects() == []


def test_the_same_key_is_deduplicated_unless_the_service_is_told_not_to(service):
    client = ArticlesClient(service.url)
    first = client.create(title="A", idempotency_key="k1")
    assert client.create(title="A", idempotency_key="k1")["id"] == first["id"]
    service.dedupe_keys = False
    assert client.create(title="A", idempotency_key="k1")["id"] != first["id"]
    assert len(service.side_effects()) == 2


def test_reads_inside_the_lag_window_do_not_show_recent_articles(service):
    client = ArticlesClient(service.url)
    service.read_lag = 3600
    client.create(title="A", idempotency_key="k1")
    status, answer = client.find_by_key("k1")
    assert (status, answer["matches"]) == (200, [])
    service.read_lag = 0
    assert len(client.find_by_key("k1")[1]["matches"]) == 1


# --- the reconciler against each failure mode ---------------------------------------------


@pytest.mark.django_db
def test_a_dropped_response_is_reconciled_to_succeeded_by_idempotency_key(service):
    op = send(service, "Dropped", fault="drop_response")
    assert op.state == State.OUTCOME_UNKNOWN
    op, [ev] = reconciled(op)
    [article] = service.side_effects()
    assert (op.state, op.external_id) == (State.SUCCEEDED, article["id"])
    assert (ev.verdict, ev.matched_by) == ("found", "idempotency_key")
    assert ev.query == {"method": "lookup", "idempotency_key": op.idempotency_key,
                        "external_id": "",
                        "request": f"GET {service.articles_url}/by-key/{op.idempotency_key}"}
    assert (ev.observed["status"], ev.observed["body"]["article"]["id"]) == (200, article["id"])


@pytest.mark.django_db
def test_a_slow_answer_is_reconciled_to_succeeded(service):
    service.slow_seconds = 1.0
    op = send(service, "Slow", fault="slow", timeout=0.2)
    assert (op.state, op.error_code) == (State.OUTCOME_UNKNOWN, "TimeoutError")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict) == (State.SUCCEEDED, "found")


@pytest.mark.django_db
def test_a_lost_request_proven_absent_inside_the_in_flight_window_stays_unknown(service):
    op = send(service, "Lost", fault="lose_request")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict) == (State.OUTCOME_UNKNOWN, "proven_absent")
    assert op.next_attempt_at == op.in_flight_until


@pytest.mark.django_db
def test_a_lost_request_is_proven_absent_and_safe_to_retry(service):
    op = send(service, "Lost", fault="lose_request", in_flight_for=timedelta(0))
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict, ev.matched_by) == (State.SAFE_TO_RETRY, "proven_absent",
                                                     "idempotency_key")


@pytest.mark.django_db
def test_a_lost_request_with_retry_policy_never_goes_to_manual_review(service):
    op = send(service, "Lost", fault="lose_request", retry_policy="never",
              in_flight_for=timedelta(0))
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict) == (State.MANUAL_REVIEW, "proven_absent")


@pytest.mark.django_db
def test_an_empty_read_inside_the_consistency_window_is_not_yet_never_proof_of_absence(service):
    service.read_lag = 3600
    op = send(service, "Lost while lagging", fault="lose_request")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict) == (State.OUTCOME_UNKNOWN, "not_yet")
    assert op.next_attempt_at is not None


@pytest.mark.django_db
def test_not_yet_past_the_grace_period_goes_to_manual_review(service, monkeypatch):
    monkeypatch.setattr(ArticlesReconciler, "grace_period", timedelta(0))
    service.read_lag = 3600
    op = send(service, "Dropped while lagging", fault="drop_response")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict) == (State.MANUAL_REVIEW, "not_yet")


@pytest.mark.django_db
def test_without_the_key_index_the_fingerprint_search_finds_the_one_article(service):
    service.key_lookup = False
    op = send(service, "Searched", fault="drop_response")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict, ev.matched_by) == (State.SUCCEEDED, "found", "fingerprint")
    assert ev.query["method"] == "search" and ev.query["limit"] == ArticlesReconciler.then.limit


@pytest.mark.django_db
def test_two_articles_matching_the_fingerprint_are_ambiguous_and_listed(service):
    service.key_lookup = False
    # Neither carries the operation's key (made by hand): content alone cannot tell.
    for n in (1, 2):
        ArticlesClient(service.url).create(title="Twin", body="text", idempotency_key=f"h{n}")
    op = send(service, "Twin", fault="lose_request", in_flight_for=timedelta(0))
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict) == (State.MANUAL_REVIEW, "ambiguous")
    assert sorted(m["id"] for m in ev.observed["matches"]) == sorted(
        a["id"] for a in service.side_effects())


@pytest.mark.django_db
def test_the_search_leaves_out_articles_already_attributed_to_another_operation(service):
    done = send(service, "Same content")
    assert done.state == State.SUCCEEDED
    service.key_lookup = False
    op = send(service, "Same content", fault="lose_request", in_flight_for=timedelta(0))
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict, ev.matched_by) == (State.SAFE_TO_RETRY, "proven_absent",
                                                     "fingerprint")
    assert ev.observed["attributed_to_other_operations"] == [done.external_id]


@pytest.mark.django_db
def test_a_target_that_is_not_the_simulated_service_goes_to_manual_review():
    op = receipts.record_intent("articles.create", "https://cms.example/api/articles",
                                {"title": "Elsewhere"})
    receipts.mark_submitted(op)
    receipts.mark_outcome_unknown(op, error_code="TimeoutError")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict) == (State.MANUAL_REVIEW, "ambiguous")
    assert "not a simulated articles service" in ev.detail


@pytest.mark.django_db
def test_a_service_that_is_down_is_a_reconciler_error_not_a_verdict():
    with ArticlesService() as gone:
        op = send(gone, "Before the outage", fault="drop_response")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict, op.reconcile_failures) == (State.OUTCOME_UNKNOWN, "error", 1)
    assert "ConnectError" in ev.detail and "Connection refused" in ev.detail


# --- kill and resume -------------------------------------------------------------------------

AGENT = """
    import json, time
    from demo.simulated.agent import publish_articles

    def pause(step, point):
        if f"{{step}}:{{point}}" == {kill_at!r}:
            print("REACHED", step, point, flush=True)
            time.sleep(600)

    print("RESULT", json.dumps(publish_articles({run_id!r}, {url!r}, pause=pause)), flush=True)
"""


def run_agent(run_id, url, kill_at=None):
    child = spawn(AGENT.format(run_id=run_id, url=url, kill_at=kill_at))
    if kill_at:
        wait_for_line(child, "REACHED")
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=30)
        assert child.returncode == -signal.SIGKILL
        return None
    result = json.loads(wait_for_line(child, "RESULT").split(" ", 1)[1])
    _, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    return result


def run_to_completion(run_id, url):
    """Restart the agent, reconcile between runs, until every step succeeded.

    Each reconciliation looks once the in-flight window of the last attempt has passed (its
    clock moved past it): before that, an absence would prove nothing.
    """
    for _ in range(4):
        result = run_agent(run_id, url)
        if result == {step: State.SUCCEEDED for step in STEPS}:
            return
        after_window = timezone.now() + timedelta(seconds=conf.IN_FLIGHT_SECONDS + 1)
        with mock.patch.object(reconcile.timezone, "now", return_value=after_window):
            reconcile.run_once(worker="test")
    raise AssertionError(f"expected the task to finish after restarts, found {result}")


def side_effects_of_the_run(service, run_id):
    ops = Operation.objects.filter(run__run_id=run_id).order_by("id")
    assert [op.state for op in ops] == [State.SUCCEEDED] * 3
    assert sorted(op.external_id for op in ops) == sorted(a["id"] for a in
                                                          service.side_effects())
    return len(service.side_effects())


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kill_at", [
    f"{step}:{point}" for step in STEPS for point in ("after_submit", "after_send",
                                                      "after_succeed")
])
def test_an_agent_killed_at_any_step_boundary_and_resumed_makes_the_same_side_effects(kill_at):
    # The service does not deduplicate keys: only the ledger stands between a restart and a
    # second article.
    with ArticlesService(dedupe_keys=False) as uninterrupted:
        assert publish_articles("run-uninterrupted", uninterrupted.url) == {
            step: State.SUCCEEDED for step in STEPS}
        expected = side_effects_of_the_run(uninterrupted, "run-uninterrupted")
    assert expected == 3
    with ArticlesService(dedupe_keys=False) as service:
        run_agent("run-killed", service.url, kill_at=kill_at)
        run_to_completion("run-killed", service.url)
        assert side_effects_of_the_run(service, "run-killed") == expected
    step, point = kill_at.split(":")
    killed = Operation.objects.get(run__run_id="run-killed", step__isnull=True,
                                   idempotency_key=receipts.idempotency_key("run-killed", step))
    verdicts = list(Evidence.objects.filter(operation=killed).values_list("verdict", flat=True))
    # Killed before sending: proven absent, sent again as attempt 2. Killed after the
    # service committed: found, never sent again. Killed after recording: nothing to settle.
    assert (verdicts, killed.attempt) == {
        "after_submit": (["proven_absent"], 2),
        "after_send": (["found"], 1),
        "after_succeed": ([], 1),
    }[point]


# --- a match under another key is not this operation's effect (issue 30) ---------------------


@pytest.mark.django_db
def test_a_hand_sent_twin_under_another_key_is_ambiguous_with_both_ids_in_the_evidence(
    service,
):
    ArticlesClient(service.url).create(title="Twin by hand", body="text",
                                       idempotency_key="sent-by-hand")
    service.key_lookup = False  # the search decides, matching on content
    op = send(service, "Twin by hand", fault="lose_request", in_flight_for=timedelta(0))
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict) == (State.MANUAL_REVIEW, "ambiguous")
    [article] = service.side_effects()
    assert op.external_id == ""
    ids = ev.observed["ids"]
    assert ids["found"] == {"external_id": article["id"], "idempotency_key": "sent-by-hand"}
    assert ids["operation"]["idempotency_key"] == op.idempotency_key
    assert "sent-by-hand" in ev.detail and op.idempotency_key in ev.detail


@pytest.mark.django_db
def test_the_twin_under_this_operations_key_is_found_among_other_matches(service):
    ArticlesClient(service.url).create(title="Pair", body="text", idempotency_key="by-hand")
    service.key_lookup = False
    op = send(service, "Pair", fault="drop_response")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict, ev.matched_by) == (State.SUCCEEDED, "found",
                                                     "idempotency_key")
    mine = [a for a in service.side_effects() if a["idempotency_key"] == op.idempotency_key]
    assert op.external_id == mine[0]["id"]


@pytest.mark.django_db
def test_a_kit_told_the_service_has_no_keys_takes_the_content_match(service):
    from ledger import reconcilers

    ArticlesClient(service.url).create(title="Keyless", body="text", idempotency_key="other")
    keyless = reconcilers.list_and_match(
        "articles.keyless", url="{target}?since={since}&limit={limit}", items="items",
        match=("title", "body"), limit=20, keys=False)
    try:
        op = receipts.record_intent("articles.keyless",
                                    ArticlesClient(service.url).articles_url,
                                    {"title": "Keyless", "body": "text"})
        receipts.mark_submitted(op, in_flight_for=timedelta(0))
        receipts.mark_outcome_unknown(op, error_code="TimeoutError")
        op, [ev] = reconciled(op)
        assert (op.state, ev.verdict) == (State.SUCCEEDED, "found")
        assert keyless.service_has_keys is False
    finally:
        reconcile.unregister("articles.keyless")
