"""The answer to a write is lost between PostgreSQL and the application (tests/ha/faultproxy.py:
the statement runs and commits, the reply never arrives, the connection is cut), at each
point of an action's lifecycle, in a real child process logged in as the agent, or in a
real web server the Python client talks to. The ledger retries its own write on a new
connection and finds what its first try did: record_intent finds its row by key, a move
finds its own event; the external call is made once, never again because an answer was
lost."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from django.db import connection

from ledger import receipts
from ledger.errors import StaleVersion
from ledger.models import Operation, OperationEvent
from tests.conftest import TEST_LOGINS
from tests.ha.faultproxy import FaultProxy
from tests.support.processes import PRELUDE, ROOT, child_env

pytestmark = pytest.mark.django_db(transaction=True)

RECORD = b"INSERT INTO ledger_operation "  # record_intent's statement (with submit=True,
                                           # its submission's in the same commit)
SUBMITTED = b'"submitted_at" = '          # mark_submitted's move
SUCCEEDED = b'"completed_at" = '          # mark_succeeded's move

AGENT = """
import json, os
from ledger import receipts

calls = os.environ["CALLS_FILE"]

@receipts.action("articles.create", target="https://cms.example/a",
                 key=lambda slug: slug, submit=os.environ["SUBMIT"] == "one commit")
def create(slug):
    with open(calls, "a") as f:
        f.write(slug + "\\n")
    return {"id": "art-" + slug}

slug = os.environ["SLUG"]
value = create(slug)
op = create.receipt(slug)
print("RESULT " + json.dumps({"value": value, "state": op.state, "version": op.version}))
"""


@pytest.fixture
def proxy():
    settings = connection.settings_dict
    proxy = FaultProxy(settings["HOST"], settings["PORT"]).start()
    yield proxy
    proxy.stop()


def run_agent(proxy, tmp_path, slug, submit="one commit", timeout=120):
    calls = tmp_path / "calls.txt"
    calls.touch()
    env = child_env(TEST_LOGINS["agent"])
    env.pop("LEDGER_POOLER_URL", None)
    env["DATABASE_URL"] = f"postgres://postgres@127.0.0.1:{proxy.port}/unused"
    env.update(CALLS_FILE=str(calls), SLUG=slug, SUBMIT=submit)
    source = PRELUDE.format(root=str(ROOT)) + AGENT
    proc = subprocess.run([sys.executable, "-c", source], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"expected the agent to finish, found exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULT "):]), calls.read_text().splitlines()


def lifecycle(slug):
    op = Operation.objects.get(idempotency_key=slug)
    return [(e.version, e.from_state, e.to_state)
            for e in OperationEvent.objects.filter(operation=op).order_by("version")]


FULL = [(1, "", "planned"), (2, "planned", "submitted"), (3, "submitted", "succeeded")]


@pytest.mark.parametrize("submit, writes", [
    ("one commit", (RECORD, SUCCEEDED)),
    ("apart", (RECORD, SUBMITTED, SUCCEEDED)),
])
def test_the_answer_lost_at_each_write_of_the_decorator(proxy, tmp_path, submit, writes):
    """One action call each of whose writes loses its answer: the intent and its submission
    in one commit (the decorator's default) or apart (`submit=False`), then the move to
    succeeded (after the call)."""
    for where in writes:
        proxy.arm(where)
    result, calls = run_agent(proxy, tmp_path, "lost-1", submit=submit)
    assert proxy.cuts == list(writes), f"expected {len(writes)} answers lost"
    assert proxy.connections >= len(writes) + 1, "expected a reconnection after each cut"
    assert calls == ["lost-1"], "expected the external call made exactly once"
    assert result == {"value": {"id": "art-lost-1"}, "state": "succeeded", "version": 3}
    assert lifecycle("lost-1") == FULL
    assert Operation.objects.count() == 1


def test_another_caller_of_the_same_actor_at_the_same_version_stays_stale():
    """A move is found as one's own only by the time its first try chose: a second object
    of the same receipt, same actor, same from/to and version step, is refused."""
    first = receipts.record_intent("articles.create", "https://cms.example/a", {"n": 1},
                                   idempotency_key="same-actor", actor="bot")
    second = Operation.objects.get(pk=first.pk)
    receipts.mark_submitted(first, actor="bot")
    with pytest.raises(StaleVersion):
        receipts.mark_submitted(second, actor="bot")
    assert [e.to_state for e in OperationEvent.objects.filter(operation=first)
            .order_by("version")] == ["planned", "submitted"]


def test_record_intent_retried_after_a_lost_answer_says_it_recorded(proxy, tmp_path):
    """The retry finds the row its first try committed, by the operation id it generated:
    recorded_now stays true (201 over HTTP), and a second caller's replay is false."""
    proxy.arm(RECORD)
    env = child_env(TEST_LOGINS["agent"])
    env.pop("LEDGER_POOLER_URL", None)
    env["DATABASE_URL"] = f"postgres://postgres@127.0.0.1:{proxy.port}/unused"
    source = PRELUDE.format(root=str(ROOT)) + """
import json
from ledger import receipts
first = receipts.record_intent("articles.create", "https://cms.example/a", {"n": 1},
                               idempotency_key="rec-1")
again = receipts.record_intent("articles.create", "https://cms.example/a", {"n": 1},
                               idempotency_key="rec-1")
print("RESULT " + json.dumps([first.recorded_now, again.recorded_now,
                              first.operation_id == again.operation_id]))
"""
    proc = subprocess.run([sys.executable, "-c", source], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proxy.cuts == [RECORD]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    assert json.loads(line[7:]) == [True, False, True]
    assert Operation.objects.filter(idempotency_key="rec-1").count() == 1


def test_the_web_server_rides_through_and_the_python_client_sends_once(proxy, monkeypatch,
                                                                       tmp_path):
    """The web process's database answers lost (the intent with its submission, one commit
    for `"submit": true`, and the success): the server retries its own writes, the Python
    client's `@ledger.action` hears a normal answer each time and calls the service once."""
    from ledger_client import Ledger

    from ledger import agent_keys
    from tests.factories import UserFactory
    from tests.support.servers import LedgerServer

    admin = UserFactory(username="lost-admin", role="admin", tenants=[])
    admin.is_superuser = True
    admin.save(update_fields=["is_superuser"])
    secret = agent_keys.create("lost-bot", tenants=["default"], user=admin)[1]
    monkeypatch.delenv("LEDGER_POOLER_URL", raising=False)
    monkeypatch.setenv("DATABASE_URL", f"postgres://postgres@127.0.0.1:{proxy.port}/unused")
    server = LedgerServer(connection.settings_dict["NAME"], tmp_path / "server.log",
                          login=TEST_LOGINS["web"])
    server.start()
    sent = []
    try:
        for where in (RECORD, SUCCEEDED):
            proxy.arm(where)
        with Ledger(server.url, key=secret) as ledger:
            @ledger.action("articles.create", target="https://cms.example/a",
                           key=lambda slug: slug)
            def create(slug):
                sent.append(slug)
                return {"id": "art-" + slug}

            assert create("http-lost-1") == {"id": "art-http-lost-1"}
    finally:
        server.stop()
    assert proxy.cuts == [RECORD, SUCCEEDED], (
        "expected two answers lost:\n" + (tmp_path / "server.log").read_text()[-3000:])
    assert sent == ["http-lost-1"]
    assert lifecycle("http-lost-1") == FULL
    assert "Internal error" not in (tmp_path / "server.log").read_text()
