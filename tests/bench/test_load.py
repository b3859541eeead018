"""bench/load.py: its HTTP agent against a real API server, and the whole load test run
small (gunicorn, reconcile processes, agents on both transports, a reviewer), its
invariants asserted from its JSON summary."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from urllib.parse import urlsplit

import psycopg
import pytest
from django.conf import settings
from psycopg import sql

from bench.load import ApiErrors, HttpLedger
from demo.simulated.articles import ArticlesClient, ArticlesService
from ledger import receipts
from ledger.models import Operation, OperationEvent
from ledger.states import State
from tests.support.processes import ROOT


@pytest.fixture
def service():
    with ArticlesService(dedupe_keys=False) as running:
        yield running


def article(n: int) -> dict:
    return {"title": f"Load article {n}", "body": "body"}


def stored(key: str) -> Operation:
    return Operation.objects.get(idempotency_key=key)


@pytest.mark.django_db(transaction=True)
def test_http_agent_records_sends_once_and_marks_succeeded_under_its_key(
        api_server, make_key, service):
    errors = ApiErrors()
    ledger = HttpLedger(api_server, make_key("load-agent"), errors)
    client = ArticlesClient(service.url)
    try:
        assert ledger.run("load-1-0", article(0), client, None) == State.SUCCEEDED
        assert ledger.run("load-1-0", article(0), client, None) == State.SUCCEEDED  # replayed
        assert ledger.look("load-1-0", article(0), client) == State.SUCCEEDED
    finally:
        ledger.close()

    op = stored("load-1-0")
    assert op.state == State.SUCCEEDED
    assert op.intent == article(0)  # the key and the fault never left the agent
    assert op.external_id == service.side_effects()[0]["id"]
    assert len(service.side_effects()) == 1
    assert set(OperationEvent.objects.filter(operation=op)
               .values_list("actor_id", flat=True)) == {"load-agent"}
    # record+submit, succeeded; then the replay (one request) and the look (one).
    assert errors.total == 0 and errors.requests == 4


@pytest.mark.django_db(transaction=True)
def test_http_agent_marks_a_dropped_response_outcome_unknown_never_failed(
        api_server, make_key, service):
    errors = ApiErrors()
    ledger = HttpLedger(api_server, make_key("load-agent"), errors)
    client = ArticlesClient(service.url, timeout=2.0)
    try:
        assert (ledger.run("load-1-0", article(0), client, "drop_response")
                == State.OUTCOME_UNKNOWN)
        # Sent again by the agent: the ledger says not to, and the service is not called.
        assert ledger.run("load-1-0", article(0), client, None) == State.OUTCOME_UNKNOWN
    finally:
        ledger.close()

    op = stored("load-1-0")
    assert op.state == State.OUTCOME_UNKNOWN
    assert op.error_code  # why it is unknown: the transport error's name
    assert len(service.side_effects()) == 1  # it landed; only the ledger knows not to resend
    assert errors.counts == {"OutcomeUnknown": 1}


@pytest.mark.django_db(transaction=True)
def test_http_agent_counts_a_refused_submission_and_sends_nothing(api_server, make_key, service):
    errors = ApiErrors()
    ledger = HttpLedger(api_server, make_key("load-agent"), errors)
    client = ArticlesClient(service.url)
    try:
        op = receipts.record_intent("articles.create", client.articles_url, article(0),
                                    idempotency_key="load-1-0")
        receipts.mark_submitted(op)  # someone else sent it first
        assert ledger.run("load-1-0", article(0), client, None) == State.SUBMITTED
    finally:
        ledger.close()

    assert service.side_effects() == []
    # another caller is sending it: "in flight", never "outcome unknown"
    assert list(errors.counts) == ["409 idempotency-in-flight"]
    assert "expected" in errors.examples[0] and "found it submitted" in errors.examples[0]


class AnswerCutter:
    """A loopback TCP proxy in front of the API that, once, lets a request whose first
    bytes contain `marker` reach the server and then cuts the client's connection as the
    answer comes back: the request landed, the agent never hears so."""

    def __init__(self, upstream: str, marker: bytes):
        self.upstream = urlsplit(upstream)
        self.marker, self.cut = marker, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection((self.upstream.hostname, self.upstream.port))
            cutting = threading.Event()
            threading.Thread(target=self._pump, args=(client, server, cutting, True),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, cutting, False),
                             daemon=True).start()

    def _pump(self, source, sink, cutting, is_request: bool) -> None:
        try:
            while data := source.recv(65536):
                if is_request and self.marker in data and not self.cut.is_set():
                    self.cut.set()
                    cutting.set()
                elif not is_request and cutting.is_set():  # the answer: drop it, hang up
                    sink.shutdown(socket.SHUT_RDWR)
                    return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                sock.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.django_db(transaction=True)
def test_http_agent_whose_answer_is_lost_sends_the_mark_again_and_it_applies_once(
        api_server, make_key, service):
    cutter = AnswerCutter(api_server, b"/succeeded")
    errors = ApiErrors()
    ledger = HttpLedger(cutter.url, make_key("load-agent"), errors)
    client = ArticlesClient(service.url)
    try:
        assert ledger.run("load-1-0", article(0), client, None) == State.SUCCEEDED
    finally:
        ledger.close()
        cutter.close()

    assert cutter.cut.is_set()
    assert list(errors.counts) == ["transport"]  # then sent again, refused, then read
    op = stored("load-1-0")
    assert (op.state, op.version) == (State.SUCCEEDED, 3)
    assert list(OperationEvent.objects.filter(operation=op).order_by("version")
                .values_list("to_state", flat=True)) == ["planned", "submitted", "succeeded"]
    assert len(service.side_effects()) == 1


@pytest.mark.django_db(transaction=True)
def test_http_agent_counts_an_unknown_key_and_goes_on(api_server, service):
    errors = ApiErrors()
    ledger = HttpLedger(api_server, "alk_" + "x" * 43, errors)
    try:
        assert ledger.run("load-1-0", article(0), ArticlesClient(service.url), None) is None
    finally:
        ledger.close()

    assert errors.counts == {"401 unauthenticated": 1}
    assert not Operation.objects.exists()
    assert service.side_effects() == []


@pytest.fixture
def load_database():
    """A database of this test's own for load.py (it drops and recreates it), dropped after."""
    name = f"{settings.DATABASES['default']['NAME']}_loadtest"
    yield name
    db = settings.DATABASES["default"]
    params = {"dbname": "postgres", "user": db.get("USER"), "password": db.get("PASSWORD"),
              "host": db.get("HOST"), "port": db.get("PORT")}
    with psycopg.connect(**{k: v for k, v in params.items() if v}, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                     .format(sql.Identifier(name)))


def test_load_test_small_run_holds_its_invariants_on_both_transports(load_database,
                                                                       tmp_path):
    summary_path = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k != "LEDGER_DATABASE_NAME"}
    env["LEDGER_BENCH_DATABASE"] = load_database
    done = subprocess.run(
        [sys.executable, "bench/load.py", "--agents", "4", "--reviewers", "1",
         "--web-workers", "2", "--operations", "12", "--seconds", "30", "--drain", "5",
         "--summary", str(summary_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    summary = json.loads(summary_path.read_text())

    assert summary["invariants_hold"] and summary["problems"] == [], report
    in_process, http = summary["transports"]["in process"], summary["transports"]["http"]
    assert in_process["operations"] > 0 and http["operations"] > 0, report
    assert summary["http_requests"] >= 2 * http["operations"]  # record+submit, outcome
    assert not [kind for kind in summary["http_errors"] if kind[0] == "5"], report
    for line in ("operations http", "every agent transition by 'load-http-agents'",
                 "no key twice", "every transition evidenced exactly once",
                 "invariants hold"):
        assert line in done.stdout, report
    assert re.search(r"^verify_audit +clean$", done.stdout, re.MULTILINE), report
