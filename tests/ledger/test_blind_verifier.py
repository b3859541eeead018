"""Positive controls: a reader's "not found" proves absence only once it has shown it can see.

Against the simulated articles service on 127.0.0.1 (real HTTP), with every reconcile pass
in a child process logged in as the reconciler's role. A blind reader is one that reads
another account of the provider: a second, empty service answering `200 []` and 404 to
everything, as a wrong URL, account or token would.
"""

import http.client
import json
import uuid
from datetime import timedelta

import pytest
from django.core.management import call_command

from demo.simulated.articles import ArticleRejected, ArticlesClient, ArticlesService
from ledger import metrics, receipts, retention
from ledger.models import Evidence, Operation, OperationEvent
from ledger.states import State
from tests.conftest import TEST_LOGINS
from tests.support.processes import run_as
from tests.support.retention import complete_days_ago, retention_admin

pytestmark = pytest.mark.django_db(transaction=True)

TRANSPORT = (OSError, http.client.HTTPException)

# The four kinds of reader, each built in the child against `base` (the account it reads).
READERS = {
    "each.listing": """
reconcilers.list_and_match("each.listing", url=BASE + "/articles?since={since}&limit={limit}",
                           items="items", match=("title", "body"))
""",
    "each.lookup": """
reconcilers.http_lookup("each.lookup", url=BASE + "/articles/by-key/{idempotency_key}",
                        external_id="article.id")
""",
    "each.function": """
def find_by_key(op):
    status, answer = ArticlesClient(BASE).find_by_key(op.idempotency_key)
    return answer["matches"][0] if answer["matches"] else None

reconcilers.function_lookup("each.function", find=find_by_key)
""",
    "each.custom": """
@reconcile.register("each.custom")
class ByKey(reconcile.Reconciler):
    def lookup(self, op):
        status, answer = ArticlesClient(BASE).find_by_key(op.idempotency_key)
        if answer["matches"]:
            return reconcile.Found(answer["matches"][0]["id"], answer,
                                   idempotency_key=op.idempotency_key)
        return reconcile.ProvenAbsent(answer)
""",
}


@pytest.fixture
def service():
    with ArticlesService() as running:
        yield running


@pytest.fixture
def other_account():
    """The same provider, another account: it holds none of this ledger's articles."""
    with ArticlesService() as running:
        yield running


def send(service, operation, title, *, fault=None, in_flight_for=timedelta(0), run=None):
    """An agent's call through the ledger; the operation as it ended."""
    client = ArticlesClient(service.url)
    op = receipts.record_intent(operation, client.articles_url, {"title": title, "body": "text"},
                                idempotency_key=f"{operation}-{uuid.uuid4().hex[:12]}", run=run)
    try:
        with receipts.submit(op, rejections=(ArticleRejected,),
                             in_flight_for=in_flight_for) as attempt:
            answer = client.create(title=title, body="text", idempotency_key=op.idempotency_key,
                                   fault=fault)
            attempt.succeeded(external_id=answer["id"])
    except (ArticleRejected, *TRANSPORT):
        pass
    return Operation.objects.get(pk=op.pk)


def reconcile_as_reconciler(readers: str, base: str, *, passes: int = 1,
                            first_after: timedelta = timedelta(0)) -> list[list[str]]:
    """`passes` reconcile passes in a child logged in as the reconciler, the readers built
    against `base`; pass n runs with the clock `first_after` + n * 10 minutes ahead (every
    backoff has passed). Returns [operation_id, verdict, state] per verdict."""
    found = run_as(TEST_LOGINS["reconciler"], f"""
from datetime import timedelta
from django.db import connection
from django.utils import timezone
from demo.simulated.articles import ArticlesClient
from ledger import reconcile, reconcilers
BASE = {base!r}
{readers}
verdicts = []
start = timezone.now()
for n in range({passes}):
    moment = start + timedelta(seconds={first_after.total_seconds()} + n * 600)
    timezone.now = lambda moment=moment: moment
    reconcile.run_once(worker="child", on_verdict=lambda op, outcome: verdicts.append(
        [op.operation_id, outcome.verdict, op.state]))
with connection.cursor() as cursor:
    cursor.execute("SELECT current_user")
    login = cursor.fetchone()[0]
result = {{"login": login, "verdicts": verdicts}}
""")
    assert found["login"] == TEST_LOGINS["reconciler"], found
    return found["verdicts"]


def states_reached(op) -> list[str]:
    return list(OperationEvent.objects.filter(operation=op).order_by("version")
                .values_list("to_state", flat=True))


def control_of(ev) -> dict:
    return ev.observed["positive_control"]


# --- the blind listing --------------------------------------------------------------------


def test_a_blind_listing_stays_unproven_goes_to_a_person_and_shows_as_blind(
        service, other_account):
    done = send(service, "each.listing", "Sent and seen")
    assert done.state == State.SUCCEEDED
    lost = send(service, "each.listing", "Lost on the way", fault="lose_request")
    assert lost.state == State.OUTCOME_UNKNOWN

    verdicts = reconcile_as_reconciler(READERS["each.listing"], other_account.url, passes=4)

    assert verdicts == [[lost.operation_id, "verifier_blind", State.OUTCOME_UNKNOWN],
                        [lost.operation_id, "verifier_blind", State.OUTCOME_UNKNOWN],
                        [lost.operation_id, "verifier_blind", State.MANUAL_REVIEW]]
    lost.refresh_from_db()
    assert lost.state == State.MANUAL_REVIEW
    assert State.SAFE_TO_RETRY not in states_reached(lost)
    assert list(receipts.retries_due()) == []
    # Nothing was sent again: the service holds the control's article only.
    assert [a["id"] for a in service.side_effects()] == [done.external_id]
    evidence = list(Evidence.objects.filter(operation=lost).order_by("id"))
    assert [ev.verdict for ev in evidence] == ["verifier_blind"] * 3
    for ev in evidence:
        control = control_of(ev)
        assert control["status"] == "not_seen"
        assert (control["control"]["operation_id"], control["control"]["external_id"]) == (
            done.operation_id, done.external_id)
        assert control["reading"]["verdict"] == "proven_absent"
        assert (ev.observed["listed"], ev.observed["matches"]) == (0, [])
        assert f"could not find {done.operation_id}" in ev.detail
    assert "unproven after 3 readings" in lost.events.order_by("-version").first().reason

    text = metrics.render().decode()
    labels = f'operation="each.listing",target="{service.articles_url}",tenant="default"'
    assert f"ledger_reconciler_blind{{{labels}}} 1.0" in text, text
    assert (f'ledger_reconciler_blind_readings{{control="not_seen",{labels}}} 3.0'
            in text), text
    assert f"ledger_unproven_blind_operations{{{labels}}} 1.0" in text, text


def test_a_healthy_listing_still_proves_absence_after_the_window(service):
    done = send(service, "each.listing", "Sent and seen")
    lost = send(service, "each.listing", "Lost on the way", fault="lose_request",
                in_flight_for=timedelta(seconds=30))

    verdicts = reconcile_as_reconciler(READERS["each.listing"], service.url, passes=2)

    assert verdicts == [[lost.operation_id, "proven_absent", State.OUTCOME_UNKNOWN],
                        [lost.operation_id, "proven_absent", State.SAFE_TO_RETRY]]
    inside, after = Evidence.objects.filter(operation=lost).order_by("id")
    for ev in (inside, after):
        control = control_of(ev)
        assert (control["status"], control["control"]["operation_id"],
                control["reading"]["external_id"]) == ("seen", done.operation_id,
                                                       done.external_id)
    assert any("may still be in flight" in e.reason for e in lost.events.all())
    text = metrics.render().decode()
    assert "ledger_reconciler_blind{" not in text
    assert "ledger_unproven_blind_operations{" not in text


def test_with_no_control_yet_a_listing_proves_nothing_unless_it_declares_why(service):
    lost = send(service, "each.listing", "First on this target", fault="lose_request")
    declared = READERS["each.listing"].replace(
        'match=("title", "body"))',
        'match=("title", "body"), trusted_absence="the listing is complete by contract")')

    first = reconcile_as_reconciler(READERS["each.listing"], service.url)
    assert first == [[lost.operation_id, "verifier_blind", State.OUTCOME_UNKNOWN]]
    ev = Evidence.objects.get(operation=lost)
    assert control_of(ev) == {"status": "none"}
    assert "no operation on this target has succeeded yet" in ev.detail

    second = reconcile_as_reconciler(declared, service.url, first_after=timedelta(minutes=10))
    assert second == [[lost.operation_id, "proven_absent", State.SAFE_TO_RETRY]]
    ev = Evidence.objects.filter(operation=lost).latest("id")
    assert control_of(ev) == {"status": "declared",
                              "trusted_absence": "the listing is complete by contract"}
    assert "declares its absence trustworthy: the listing is complete by contract" in ev.detail


def test_a_purged_control_is_replaced_by_the_next_one(service):
    from ledger import obligations, runs

    pending = runs.start("a run still waiting on an obligation")
    obligations.open(pending, "report.send", "report-1")
    older = send(service, "each.listing", "Older", run=pending)  # kept by the obligation
    newer = send(service, "each.listing", "Newer")
    complete_days_ago(older, 33)
    complete_days_ago(newer, 31)
    retention.set_policy("each.*", purge_after_days=30, redact_after_days=None,
                         user=retention_admin())

    first = send(service, "each.listing", "Lost first", fault="lose_request")
    reconcile_as_reconciler(READERS["each.listing"], service.url)
    ev = Evidence.objects.get(operation=first)
    assert (ev.verdict, control_of(ev)["control"]["operation_id"]) == ("proven_absent",
                                                                      newer.operation_id)

    call_command("purge", actor="cron")
    assert not Operation.objects.filter(pk=newer.pk).exists()
    second = send(service, "each.listing", "Lost second", fault="lose_request")
    reconcile_as_reconciler(READERS["each.listing"], service.url)
    ev = Evidence.objects.get(operation=second)
    assert (ev.verdict, control_of(ev)["control"]["operation_id"]) == ("proven_absent",
                                                                      older.operation_id)

    # The last control purged too: no control, nothing proven; the next success serves.
    obligations.commit("report-1", {"sent": True})
    call_command("purge", actor="cron")
    assert not Operation.objects.filter(pk=older.pk).exists()
    third = send(service, "each.listing", "Lost third", fault="lose_request")
    assert reconcile_as_reconciler(READERS["each.listing"], service.url) == [
        [third.operation_id, "verifier_blind", State.OUTCOME_UNKNOWN]]
    latest = send(service, "each.listing", "Latest")
    assert reconcile_as_reconciler(READERS["each.listing"], service.url,
                                   first_after=timedelta(minutes=10)) == [
        [third.operation_id, "proven_absent", State.SAFE_TO_RETRY]]
    ev = Evidence.objects.filter(operation=third).latest("id")
    assert control_of(ev)["control"]["operation_id"] == latest.operation_id


# --- each kit, and a reconciler of your own ------------------------------------------------


@pytest.mark.parametrize("account", ["the operation's", "another"])
def test_each_kit_and_a_hand_written_reconciler_prove_absence_only_when_they_see(
        service, other_account, account):
    controls, lost = {}, {}
    for operation in READERS:
        controls[operation] = send(service, operation, f"Control {operation}")
        lost[operation] = send(service, operation, f"Lost {operation}", fault="lose_request")
    base = service.url if account == "the operation's" else other_account.url

    verdicts = reconcile_as_reconciler("".join(READERS.values()), base)

    seeing = account == "the operation's"
    assert sorted(verdicts) == sorted(
        [lost[name].operation_id, "proven_absent" if seeing else "verifier_blind",
         State.SAFE_TO_RETRY if seeing else State.OUTCOME_UNKNOWN] for name in READERS)
    for operation, op in lost.items():
        control = control_of(Evidence.objects.get(operation=op))
        assert (control["status"], control["control"]["operation_id"]) == (
            "seen" if seeing else "not_seen", controls[operation].operation_id), operation
    assert len(service.side_effects()) == len(READERS)  # the controls; nothing sent again


# --- a canary ------------------------------------------------------------------------------


def test_a_canary_is_the_control_when_one_is_configured(service, other_account):
    pinned = ArticlesClient(service.url).create(title="Canary", idempotency_key="canary-1")
    lost = send(service, "each.canary", "First on this target", fault="lose_request")
    readers = """
reconcilers.http_lookup("each.canary", url=BASE + "/articles/by-key/{idempotency_key}",
                        external_id="article.id", canary=CANARY)
"""
    canary = f'CANARY = {json.dumps({"idempotency_key": "canary-1", "external_id": pinned["id"]})}'
    blind = reconcile_as_reconciler(f"{canary}\n{readers}", other_account.url)
    assert blind == [[lost.operation_id, "verifier_blind", State.OUTCOME_UNKNOWN]]
    ev = Evidence.objects.get(operation=lost)
    assert control_of(ev)["control"] == {"kind": "canary", "idempotency_key": "canary-1",
                                         "external_id": pinned["id"]}
    assert "could not find the canary (idempotency key canary-1" in ev.detail

    seeing = reconcile_as_reconciler(f"{canary}\n{readers}", service.url,
                                     first_after=timedelta(minutes=10))
    assert seeing == [[lost.operation_id, "proven_absent", State.SAFE_TO_RETRY]]
    assert control_of(Evidence.objects.filter(operation=lost).latest("id"))["status"] == "seen"
