"""The reconciler kits against the simulated articles service: verdicts, evidence, late delivery."""

import http.client
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from demo.simulated.articles import ArticleRejected, ArticlesClient, ArticlesService
from ledger import receipts, reconcile, reconcilers
from ledger.errors import InvalidInput
from ledger.models import Evidence
from ledger.models.operations import Conflict
from ledger.states import State

TRANSPORT = (OSError, http.client.HTTPException)
LOOKUP, LISTING = "kit.lookup", "kit.listing"


@pytest.fixture
def service():
    with ArticlesService(dedupe_keys=False) as running:
        yield running


@pytest.fixture
def kit():
    """kit(factory, operation, **arguments): build and register; unregistered afterwards."""
    made = []

    def make(factory, operation, **arguments):
        reconcile.unregister(operation)
        made.append(operation)
        return factory(operation, **arguments)

    yield make
    for operation in made:
        reconcile.unregister(operation)


def by_key(kit, **extra):
    extra.setdefault("url", "{target}/by-key/{idempotency_key}")
    return kit(reconcilers.http_lookup, LOOKUP, external_id="article.id", **extra)


def by_listing(kit, operation=LISTING, **extra):
    extra.setdefault("url", "{target}?since={since}&limit={limit}")
    return kit(reconcilers.list_and_match, operation, items="items",
               match=("title", "body"), **extra)


def send(service, operation, title, *, fault=None, in_flight_for=timedelta(0), body="text"):
    """An agent's call through the ledger; returns the operation as it ended."""
    client = ArticlesClient(service.url)
    op = receipts.record_intent(operation, client.articles_url, {"title": title, "body": body},
                                idempotency_key=f"{operation}-{uuid.uuid4().hex[:12]}")
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


def control(service, operation):
    """A succeeded operation on the service: the positive control a later absence is
    backed by (the same reader must find it: reconcile.check_absence)."""
    done = send(service, operation, f"Control {uuid.uuid4().hex[:6]}")
    assert (done.state, bool(done.external_id)) == (State.SUCCEEDED, True)
    return done


def reconciled(op, monkeypatch=None, *, after=None):
    """One engine pass (its clock `after` from now, if given); the operation and evidence."""
    if after is not None:
        moment = timezone.now() + after
        monkeypatch.setattr(reconcile.timezone, "now", lambda: moment)
    reconcile.run_once(worker="test")
    op.refresh_from_db()
    return op, list(Evidence.objects.filter(operation=op).order_by("id"))


# --- http_lookup -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_http_lookup_finds_a_committed_article_by_its_key_and_records_the_request(service, kit):
    by_key(kit)
    op = send(service, LOOKUP, "Dropped", fault="drop_response")
    assert op.state == State.OUTCOME_UNKNOWN
    op, [ev] = reconciled(op)
    [article] = service.side_effects()
    assert (op.state, op.external_id) == (State.SUCCEEDED, article["id"])
    assert (ev.verdict, ev.matched_by) == ("found", "idempotency_key")
    assert ev.query["request"] == f"GET {service.articles_url}/by-key/{op.idempotency_key}"
    assert ev.observed["status"] == 200 and ev.observed["body"]["article"]["id"] == article["id"]


@pytest.mark.django_db
def test_http_lookup_proves_a_lost_request_absent_by_the_404(service, kit):
    by_key(kit)
    done = control(service, LOOKUP)
    op = send(service, LOOKUP, "Lost", fault="lose_request")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict, ev.matched_by) == (State.SAFE_TO_RETRY, "proven_absent",
                                                     "idempotency_key")
    assert ev.observed["status"] == 404
    seen = ev.observed["positive_control"]
    assert (seen["status"], seen["control"]["operation_id"], seen["reading"]["external_id"]) \
        == ("seen", done.operation_id, done.external_id)
    assert f"the same reader found the control {done.operation_id}" in ev.detail


@pytest.mark.django_db
@pytest.mark.parametrize("declared", ["", "the key index answers 404 only for keys it never saw"])
def test_http_lookup_first_404_on_a_target_proves_absence_only_when_declared(
        service, kit, declared):
    by_key(kit, trusted_absence=declared)
    op = send(service, LOOKUP, "First", fault="lose_request")
    op, [ev] = reconciled(op)
    if declared:
        assert (op.state, ev.verdict) == (State.SAFE_TO_RETRY, "proven_absent")
        assert ev.observed["positive_control"] == {"status": "declared",
                                                   "trusted_absence": declared}
        assert declared in ev.detail
    else:
        assert (op.state, ev.verdict, op.reconcile_failures) == (
            State.OUTCOME_UNKNOWN, "verifier_blind", 1)
        assert ev.observed["positive_control"] == {"status": "none"}
        assert "no operation on this target has succeeded yet" in ev.detail


@pytest.mark.django_db
def test_http_lookup_late_delivery_stays_unknown_inside_the_window_then_is_found(
    service, kit, monkeypatch
):
    by_key(kit)
    done = control(service, LOOKUP)
    op = send(service, LOOKUP, "Late", fault="lose_request", in_flight_for=timedelta(seconds=60))
    op, [first] = reconciled(op)
    assert (op.state, first.verdict) == (State.OUTCOME_UNKNOWN, "proven_absent")
    assert op.next_attempt_at == op.in_flight_until
    # The request lands after the first look (a queue, a retrying proxy delivered it late).
    late = ArticlesClient(service.url).create(title="Late", body="text",
                                              idempotency_key=op.idempotency_key)
    op, [_, second] = reconciled(op, monkeypatch, after=timedelta(seconds=61))
    assert (op.state, op.external_id, second.verdict) == (State.SUCCEEDED, late["id"], "found")
    assert [a["id"] for a in service.side_effects()] == [done.external_id, late["id"]]


@pytest.mark.django_db
def test_http_lookup_inside_the_consistency_window_is_not_yet(service, kit):
    by_key(kit, consistent_as_of="consistent_as_of")
    service.read_lag = 3600
    op = send(service, LOOKUP, "Lagging", fault="lose_request")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict) == (State.OUTCOME_UNKNOWN, "not_yet")
    assert "reads are complete up to" in ev.observed["not_yet"]


@pytest.mark.django_db
def test_http_lookup_an_unexpected_status_is_a_reconciler_error_naming_the_request(
    service, kit
):
    by_key(kit)
    service.key_lookup = False  # 501 from the key index
    op = send(service, LOOKUP, "Index down", fault="drop_response")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict, op.reconcile_failures) == (State.OUTCOME_UNKNOWN, "error", 1)
    assert "expected 200 (found) or 404 (absent)" in ev.detail
    assert "found 501" in ev.detail and "/by-key/" in ev.detail


@pytest.mark.django_db
def test_http_lookup_falls_back_to_its_search_on_the_statuses_it_names(service, kit):
    search = reconcilers.list_and_match(None, url="{target}?since={since}&limit={limit}",
                                        items="items", match=("title", "body"))
    by_key(kit, fall_back_on=(501,), search=search)
    service.key_lookup = False
    op = send(service, LOOKUP, "Searched", fault="drop_response")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict, ev.matched_by) == (State.SUCCEEDED, "found", "fingerprint")
    assert ev.query["method"] == "search" and "limit=50" in ev.query["request"]


@pytest.mark.django_db
def test_http_lookup_never_records_credentials_of_the_url_or_the_headers(service, kit):
    secret = "sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc"
    by_key(kit, url="{target}/by-key/{idempotency_key}?api_key=" + secret,
           headers={"Authorization": f"Bearer {secret}"})
    op = send(service, LOOKUP, "Secretive", fault="drop_response")
    op, [ev] = reconciled(op)
    assert ev.verdict == "found"
    stored = str(ev.query) + str(ev.observed) + ev.detail + ev.reconciler
    assert secret not in stored and "[redacted]" in ev.query["request"]


@pytest.mark.django_db
def test_http_lookup_by_external_id_reads_only_when_the_receipt_has_one(service, kit):
    kit(reconcilers.http_lookup, LOOKUP, url="{target}/{external_id}", external_id="article.id")
    op = send(service, LOOKUP, "No id", fault="drop_response")
    op, [ev] = reconciled(op)
    # No external id and no search: a person decides, nothing was guessed.
    assert (op.state, ev.verdict) == (State.MANUAL_REVIEW, "ambiguous")
    assert "no search" in ev.detail


def test_http_lookup_refuses_a_template_naming_an_unknown_field():
    with pytest.raises(InvalidInput, match=r"expected url to name only .* found \['title'\]"):
        reconcilers.http_lookup(None, url="https://svc.example/{title}")


# --- list_and_match --------------------------------------------------------------------------


@pytest.mark.django_db
def test_list_and_match_finds_the_one_matching_item(service, kit):
    by_listing(kit)
    op = send(service, LISTING, "Listed", fault="drop_response")
    op, [ev] = reconciled(op)
    [article] = service.side_effects()
    assert (op.state, op.external_id) == (State.SUCCEEDED, article["id"])
    assert (ev.verdict, ev.matched_by) == ("found", "fingerprint")
    assert ev.query["match"] == {"title": "Listed", "body": "text"}
    assert (ev.observed["listed"], ev.observed["complete"]) == (1, True)


@pytest.mark.django_db
def test_list_and_match_proves_absence_only_from_a_complete_listing(service, kit):
    by_listing(kit)
    done = control(service, LISTING)
    op = send(service, LISTING, "Never arrived", fault="lose_request")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict) == (State.SAFE_TO_RETRY, "proven_absent")
    assert ev.observed["complete"] is True
    seen = ev.observed["positive_control"]
    assert (seen["status"], seen["reading"]["external_id"]) == ("seen", done.external_id)


@pytest.mark.django_db
def test_list_and_match_a_listing_that_hit_its_bound_is_never_proof_of_absence(service, kit):
    by_listing(kit, limit=2)
    client = ArticlesClient(service.url)
    for n in range(2):
        client.create(title=f"Other {n}", idempotency_key=f"other-{n}")
    op = send(service, LISTING, "Buried", fault="lose_request")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict) == (State.MANUAL_REVIEW, "ambiguous")
    assert (ev.observed["listed"], ev.observed["complete"]) == (2, False)
    assert "hit its bound of 2 items" in ev.detail


@pytest.mark.django_db
def test_list_and_match_several_matches_are_ambiguous_and_flag_the_operation(service, kit):
    by_listing(kit, keys=False)  # a service without keys: content alone cannot tell them
    first = send(service, LISTING, "Twin", fault="drop_response")
    second = send(service, LISTING, "Twin", fault="drop_response")
    reconcile.run_once(worker="test")
    for op in (first, second):
        op.refresh_from_db()
        [ev] = Evidence.objects.filter(operation=op)
        assert (op.state, ev.verdict, op.conflict) == (State.MANUAL_REVIEW, "ambiguous",
                                                       Conflict.AMBIGUOUS)
        assert len(ev.observed["matches"]) == 2


@pytest.mark.django_db
def test_list_and_match_leaves_out_items_another_operation_already_owns(service, kit):
    by_listing(kit)
    done = send(service, LISTING, "Same content")
    assert done.state == State.SUCCEEDED
    op = send(service, LISTING, "Same content", fault="lose_request")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict) == (State.SAFE_TO_RETRY, "proven_absent")
    assert ev.observed["attributed_to_other_operations"] == [done.external_id]


@pytest.mark.django_db
def test_list_and_match_late_delivery_stays_unknown_inside_the_window_then_is_found(
    service, kit, monkeypatch
):
    by_listing(kit)
    control(service, LISTING)
    op = send(service, LISTING, "Late listed", fault="lose_request",
              in_flight_for=timedelta(seconds=60))
    op, [first] = reconciled(op)
    assert (op.state, first.verdict) == (State.OUTCOME_UNKNOWN, "proven_absent")
    late = ArticlesClient(service.url).create(title="Late listed", body="text",
                                              idempotency_key=op.idempotency_key)
    op, [_, second] = reconciled(op, monkeypatch, after=timedelta(seconds=61))
    assert (op.state, op.external_id, second.verdict) == (State.SUCCEEDED, late["id"], "found")


@pytest.mark.django_db
def test_list_and_match_inside_the_consistency_window_is_not_yet(service, kit):
    by_listing(kit, consistent_as_of="consistent_as_of")
    service.read_lag = 3600
    op = send(service, LISTING, "Lagging list", fault="lose_request")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict) == (State.OUTCOME_UNKNOWN, "not_yet")


@pytest.mark.django_db
def test_list_and_match_over_a_callable_listing(kit):
    outbox = [{"message_id": "m-1", "to": "ada@example.com"}]
    # The outbox shows no idempotency keys at all: content alone decides.
    kit(reconcilers.list_and_match, "kit.mail", listing=lambda op, limit: outbox[-limit:],
        match=("to",), external_id="message_id", keys=False)
    op = receipts.record_intent("kit.mail", "smtp://mail.example", {"to": "ada@example.com"})
    receipts.mark_submitted(op, in_flight_for=timedelta(0))
    receipts.mark_outcome_unknown(op, error_code="TimeoutError")
    op, [ev] = reconciled(op)
    assert (op.state, op.external_id, ev.matched_by) == (State.SUCCEEDED, "m-1", "fingerprint")
    assert ev.query["listing"] == "test_list_and_match_over_a_callable_listing.<locals>.<lambda>"


@pytest.mark.django_db
def test_list_and_match_refuses_to_match_on_a_redacted_field(kit):
    kit(reconcilers.list_and_match, "kit.mail", listing=lambda op, limit: [],
        match=("password",))
    op = receipts.record_intent("kit.mail", "smtp://mail.example", {"password": "hunter2"})
    receipts.mark_submitted(op, in_flight_for=timedelta(0))
    receipts.mark_outcome_unknown(op, error_code="TimeoutError")
    op, [ev] = reconciled(op)
    assert (op.state, ev.verdict) == (State.OUTCOME_UNKNOWN, "error")
    assert "found it redacted" in ev.detail


@pytest.mark.parametrize("arguments, message", [
    ({"match": ("title",)}, "exactly one of url= and listing="),
    ({"match": (), "listing": list}, "match to name at least one intent field"),
    ({"match": ("t",), "listing": list, "limit": 0}, "limit to be an integer from 1"),
    ({"match": ("t",), "url": "https://svc.example?n={count}"}, r"found \['count'\]"),
])
def test_list_and_match_refuses_malformed_arguments(arguments, message):
    with pytest.raises(InvalidInput, match=message):
        reconcilers.list_and_match(None, **arguments)


def test_the_kits_are_reconcilers_registered_under_their_operation(kit):
    cls = by_key(kit)
    assert issubclass(cls, reconcile.Reconciler)
    assert reconcile.reconciler_for(LOOKUP) is cls


@pytest.mark.django_db
def test_list_and_match_takes_the_match_under_the_operations_own_key(service, kit):
    by_listing(kit)
    first = send(service, LISTING, "Twin", fault="drop_response")
    second = send(service, LISTING, "Twin", fault="drop_response")
    reconcile.run_once(worker="test")
    by_key = {a["idempotency_key"]: a["id"] for a in service.side_effects()}
    for op in (first, second):
        op.refresh_from_db()
        [ev] = Evidence.objects.filter(operation=op)
        assert (op.state, ev.verdict) == (State.SUCCEEDED, "found")
        assert op.external_id == by_key[op.idempotency_key]
    # Two effects of one content under two keys: the ledger says so.
    assert {first.conflict, second.conflict} == {Conflict.DUPLICATE}


@pytest.mark.django_db
@pytest.mark.parametrize("keys", [True, False])
def test_http_lookup_found_under_another_key_is_ambiguous_unless_the_service_has_none(
        service, kit, keys):
    client = ArticlesClient(service.url)
    by_hand = client.create(title="By hand", idempotency_key="hand-made")
    # A look-up by something else than the key (a slug, a title) answers the hand-made one.
    kit(reconcilers.http_lookup, "articles.by-slug",
        url=lambda op: f"{op.target}/{by_hand['id']}", external_id="article.id", keys=keys)
    op = receipts.record_intent("articles.by-slug", client.articles_url, {"title": "By hand"},
                                idempotency_key="agent-key")
    receipts.mark_submitted(op, in_flight_for=timedelta(0))
    receipts.mark_outcome_unknown(op, error_code="Timeout")
    op, [ev] = reconciled(op)
    if keys:
        assert (op.state, ev.verdict) == (State.MANUAL_REVIEW, "ambiguous")
        assert ev.observed["ids"]["found"] == {"external_id": by_hand["id"],
                                               "idempotency_key": "hand-made"}
        assert ev.observed["ids"]["operation"]["idempotency_key"] == "agent-key"
    else:
        assert (op.state, op.external_id) == (State.SUCCEEDED, by_hand["id"])


# --- function_lookup -------------------------------------------------------------------------


def _unknown(operation, intent):
    op = receipts.record_intent(operation, "nats://orders", intent,
                                idempotency_key=f"{operation}-{uuid.uuid4().hex[:8]}")
    receipts.mark_submitted(op, in_flight_for=timedelta(0))
    return receipts.mark_outcome_unknown(op, error_code="TimeoutError")


@pytest.mark.django_db
def test_function_lookup_finds_through_any_function_and_records_what_it_found(kit):
    stream = {}

    def find_in_stream(op):
        return stream.get(op.idempotency_key)

    kit(reconcilers.function_lookup, "kit.publish", find=find_in_stream, external_id="seq")
    op = _unknown("kit.publish", {"subject": "orders.1"})
    stream[op.idempotency_key] = {"seq": 17, "subject": "orders.1"}
    op, [ev] = reconciled(op)
    assert (op.state, op.external_id, ev.verdict, ev.matched_by) == (
        State.SUCCEEDED, "17", "found", "idempotency_key")
    assert ev.observed == {"found": {"seq": 17, "subject": "orders.1"}}
    assert ev.query["function"].endswith("find_in_stream")


@pytest.mark.django_db
def test_function_lookup_none_is_proof_of_absence_and_a_verdict_passes_through(kit):
    answers = {}
    kit(reconcilers.function_lookup, "kit.mailbox", find=lambda op: answers[op.operation_id],
        trusted_absence="the mailbox is searched whole, by message id")
    absent = _unknown("kit.mailbox", {"to": "ada@example.com"})
    later = _unknown("kit.mailbox", {"to": "bob@example.com"})
    answers[absent.operation_id] = None
    answers[later.operation_id] = reconcile.NotYet({"mailbox": "still syncing"})
    reconcile.run_once(worker="test")
    absent.refresh_from_db()
    later.refresh_from_db()
    assert absent.state == State.SAFE_TO_RETRY
    assert later.state == State.OUTCOME_UNKNOWN
    assert Evidence.objects.get(operation=later).verdict == "not_yet"


@pytest.mark.django_db
def test_function_lookup_a_failing_function_is_a_reconciler_error_not_a_verdict(kit):
    def broken(op):
        raise ConnectionError("stream unreachable")

    kit(reconcilers.function_lookup, "kit.broken", find=broken)
    op = _unknown("kit.broken", {"n": 1})
    reconcile.run_once(worker="test")
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN
    assert op.reconcile_failures == 1


def test_function_lookup_refuses_what_is_not_a_function():
    with pytest.raises(InvalidInput, match="expected find to be a function"):
        reconcilers.function_lookup(None, find="https://x")


# --- keyless look-alikes -----------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("keys", [True, False])
def test_list_and_match_a_lone_match_without_a_key_is_ambiguous_unless_the_service_has_none(
        service, kit, keys):
    by_listing(kit, keys=keys)
    # Made by hand through the service's own form: the same content, no idempotency key.
    by_hand = ArticlesClient(service.url).create(title="Look-alike", body="text")
    op = send(service, LISTING, "Look-alike", fault="lose_request")
    op, [ev] = reconciled(op)
    if keys:
        assert (op.state, op.external_id, ev.verdict) == (State.MANUAL_REVIEW, "", "ambiguous")
        assert ev.observed["ids"] == {
            "found": {"external_id": by_hand["id"], "idempotency_key": ""},
            "operation": {"external_id": "", "idempotency_key": op.idempotency_key}}
        assert "carries no idempotency key" in ev.detail
    else:
        assert (op.state, op.external_id, ev.verdict) == (State.SUCCEEDED, by_hand["id"],
                                                          "found")


@pytest.mark.parametrize("arguments, message", [
    ({"trusted_absence": True}, "expected trusted_absence to be the reason, in words"),
    ({"canary": {"intent": {"title": "x"}}}, "expected canary to be a dict naming an "
                                             "idempotency_key or an external_id"),
    ({"canary": {"external_id": "a-1", "account": "x"}}, r"found \['account'\]"),
])
def test_the_kits_refuse_a_malformed_control_declaration(arguments, message):
    for make in (lambda: reconcilers.http_lookup(None, url="https://svc.example/{idempotency_key}",
                                                 **arguments),
                 lambda: reconcilers.list_and_match(None, listing=list, match=("t",),
                                                    **arguments),
                 lambda: reconcilers.function_lookup(None, find=len, **arguments)):
        with pytest.raises(InvalidInput, match=message):
            make()
