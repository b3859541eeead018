"""Effects no receipt explains: a target's listing, read against the receipts.

Against the simulated articles service on 127.0.0.1 (real HTTP); the readings are taken in
a child process logged in as the reconciler's role, as `manage.py coverage` runs in a
deployment.
"""

from __future__ import annotations

import http.client
import json
import uuid
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction
from django.urls import reverse
from django.utils import timezone

from demo.simulated.articles import ArticleRejected, ArticlesClient, ArticlesService
from ledger import coverage, metrics, receipts, reconcile, reconcilers
from ledger.models import CoverageReading, Operation, OperationEvent
from ledger.states import State
from tests.conftest import TEST_LOGINS
from tests.support.processes import run_as

pytestmark = pytest.mark.django_db(transaction=True)

NAME = "cover.create"
READER = """
from datetime import datetime
from ledger import coverage, reconcilers
reconcilers.list_and_match("cover.create", url=BASE + "/articles?since={since}&limit={limit}",
                           items="items", match=("title", "body"), effect_time="committed_at")
"""


@pytest.fixture
def service():
    with ArticlesService() as running:
        yield running


def send(service, title, *, fault=None):
    client = ArticlesClient(service.url)
    op = receipts.record_intent(NAME, client.articles_url, {"title": title, "body": "text"},
                                idempotency_key=f"{NAME}-{uuid.uuid4().hex[:12]}")
    try:
        with receipts.submit(op, rejections=(ArticleRejected,)) as attempt:
            answer = client.create(title=title, body="text", idempotency_key=op.idempotency_key,
                                   fault=fault)
            attempt.succeeded(external_id=answer["id"])
    except (ArticleRejected, OSError, http.client.HTTPException):
        pass
    return Operation.objects.get(pk=op.pk)


def read_as(login: str, base: str, target: str, since) -> dict:
    """One coverage reading of `target` in a child logged in as `login`, reading `base`."""
    return run_as(TEST_LOGINS[login], f"BASE = {base!r}\n" + READER + f"""
try:
    [summary] = coverage.read({target!r}, since=datetime.fromisoformat({since.isoformat()!r}),
                              actor="cron")
    r = summary.reading
    result = {{"listed": r.listed, "explained": r.explained, "complete": r.complete,
              "unexplained": r.unexplained, "count": r.unexplained_count, "error": r.error,
              "blind_suspect": summary.blind_suspect, "query": r.query}}
except Exception as exc:
    result = {{"refused": type(exc).__name__, "message": str(exc).splitlines()[0]}}
""")


def operations_written():
    return (Operation.objects.count(), OperationEvent.objects.count(),
            list(Operation.objects.order_by("id").values_list("state", "version")))


@pytest.fixture
def world(service):
    since = timezone.now() - timedelta(minutes=5)
    done = send(service, "Through the ledger")
    landed = send(service, "Answer lost", fault="drop_response")
    assert (done.state, landed.state) == (State.SUCCEEDED, State.OUTCOME_UNKNOWN)
    around = ArticlesClient(service.url)
    by_hand = around.create(title="Posted by hand", body="text", idempotency_key="manual-1")
    keyless = around.create(title="A script's post", body="text")
    return {"since": since, "done": done, "landed": landed, "by_hand": by_hand,
            "keyless": keyless, "target": done.target}


def test_a_reading_lists_the_effects_no_receipt_explains_and_writes_no_operation(
        service, world):
    before = operations_written()
    found = read_as("reconciler", service.url, world["target"], world["since"])

    assert (found["listed"], found["explained"], found["count"], found["complete"]) == (
        4, 2, 2, True), found
    assert {e["external_id"] for e in found["unexplained"]} == {
        world["by_hand"]["id"], world["keyless"]["id"]}
    assert {e["idempotency_key"] for e in found["unexplained"]} == {"manual-1", ""}
    assert found["query"]["request"].startswith(f"GET {service.url}/articles?since=")
    assert not found["blind_suspect"]
    # The receipt whose answer was lost explains its effect by key; nothing was written
    # for the others.
    assert operations_written() == before
    reading = CoverageReading.objects.get()
    assert (reading.read_by, reading.operation, reading.target) == (
        "cron", NAME, world["target"])

    text = metrics.render().decode()
    assert (f'ledger_unexplained_effects{{operation="{NAME}",target="{world["target"]}",'
            f'tenant="default"}} 2.0') in text, text


def test_a_blind_reader_finds_nothing_unexplained_and_says_it_may_be_blind(service, world):
    with ArticlesService() as other_account:
        found = read_as("reconciler", other_account.url, world["target"], world["since"])
    assert (found["listed"], found["count"], found["blind_suspect"]) == (0, 0, True), found


def test_only_the_reconciler_writes_readings_and_none_is_ever_changed(service, world):
    for login in ("agent", "desk"):
        refused = read_as(login, service.url, world["target"], world["since"])
        assert refused["refused"] == "DatabaseRefusedByRole", (login, refused)
        assert "permission denied for table ledger_coveragereading" in refused["message"]
    assert not CoverageReading.objects.exists()
    read_as("reconciler", service.url, world["target"], world["since"])
    reading = CoverageReading.objects.get()
    for sql in ("UPDATE ledger_coveragereading SET unexplained_count = 0",
                "DELETE FROM ledger_coveragereading"):
        with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql)
    assert CoverageReading.objects.get().unexplained_count == reading.unexplained_count == 2


def test_the_command_prints_the_reading_and_fails_when_an_effect_is_unexplained(
        service, world, capsys):
    reconcilers.list_and_match(NAME, url=service.url + "/articles?since={since}&limit={limit}",
                               items="items", match=("title", "body"),
                               effect_time="committed_at")
    try:
        with pytest.raises(SystemExit) as exited:
            call_command("coverage", "--target", world["target"],
                         "--since", world["since"].isoformat())
        out = capsys.readouterr().out
        assert exited.value.code == 1
        assert "4 effect(s) listed, 2 explained by a receipt, 2 unexplained" in out, out
        assert f"unexplained: {world['by_hand']['id']} key=manual-1" in out
        assert f"unexplained: {world['keyless']['id']} (no idempotency key)" in out

        later = timezone.now() + timedelta(minutes=1)
        call_command("coverage", "--target", world["target"], "--since", later.isoformat(),
                     "--until", (later + timedelta(minutes=1)).isoformat(), "--json")
        quiet = json.loads(capsys.readouterr().out)
        assert (quiet["listed"], quiet["unexplained_count"]) == (0, 0)
    finally:
        reconcile.unregister(NAME)


def test_the_desk_lists_the_readings_with_the_reading_that_found_them(
        service, world, client, reviewer, django_assert_num_queries):
    for _ in range(2):  # the query count does not grow with the readings
        read_as("reconciler", service.url, world["target"], world["since"])
    client.force_login(reviewer)
    url = reverse("review:coverage")
    client.get(url)  # sessions, permissions and templates warm
    with django_assert_num_queries(6):
        body = client.get(url, {"target": world["target"]}).content.decode()
    assert world["by_hand"]["id"] in body and world["keyless"]["id"] in body
    assert "2 unexplained" in body and "GET " in body
    assert world["done"].external_id not in body
    assert "No coverage reading" in client.get(url, {"target": "https://nowhere.example"}
                                               ).content.decode()


def test_read_refuses_a_range_that_is_not_one():
    now = timezone.now()
    with pytest.raises(ValueError, match="expected since before until"):
        coverage.read("https://x.example", since=now, until=now)
