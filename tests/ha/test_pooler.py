"""The ledger behind a real PgBouncer (Debian's package) in transaction mode, started by the
test on a loopback port in front of the test database: the web login's per-request role
never leaks to another client of the same server connection, and the receipt lifecycle
(the decorator, the sealer, a reconciler pass, the HTTP API with the Python client) runs
through it. `make test-pooler` runs more of the suite's process tests through one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from django.db import connection

from ledger import agent_keys
from ledger.models import Operation, OperationEvent
from tests.conftest import DEMO_LOGINS, TEST_LOGINS
from tests.factories import UserFactory
from tests.ha.pooler import PgBouncer, available
from tests.support.processes import PRELUDE, ROOT, child_env
from tests.support.servers import LedgerServer

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not available(), reason="pgbouncer (Debian's package) is not installed"),
]


@pytest.fixture
def bouncer():
    settings = connection.settings_dict
    owner = settings["USER"] or "postgres"
    pooler = PgBouncer(settings["HOST"], settings["PORT"],
                       [owner, *TEST_LOGINS.values(), *(n for n, _ in DEMO_LOGINS)],
                       pool_size=1).start()
    yield pooler
    pooler.stop()


def run_child(bouncer, code: str, *, login: str, timeout: float = 120) -> object:
    env = child_env(login)
    env["LEDGER_POOLER_URL"] = bouncer.url(connection.settings_dict["NAME"])
    env["LEDGER_DB_POOL"] = "0"
    source = PRELUDE.format(root=str(ROOT)) + code + (
        "\nimport json\nfrom django.conf import settings as _s\n"
        "print('RESULT ' + json.dumps({'result': result, "
        "'port': _s.DATABASES['default']['PORT'], "
        "'prepare': _s.DATABASES['default']['OPTIONS'].get('prepare_threshold')}))\n")
    proc = subprocess.run([sys.executable, "-c", source], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"expected the child as {login} to finish, found exit {proc.returncode}:\n"
        f"{proc.stderr[-3000:]}\npgbouncer:\n{bouncer.log()}")
    out = json.loads(lines[0][len("RESULT "):])
    assert (int(out["port"]), out["prepare"]) == (bouncer.port, None), (
        "expected the child connected through pgbouncer, prepared statements off")
    return out["result"]


LEAK = """
import json, threading, time
from django.db import connection, transaction
from django.http import HttpResponse
from django.test import RequestFactory
from ledger.db_roles import RequestRoleMiddleware

seen = {"desk": [], "agent": [], "after": None}
stop = threading.Event()

def user():
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_user")
        return cursor.fetchone()[0]

def agent():  # another client of the same (single) server connection
    while not stop.is_set():
        seen["agent"].append(user())
        time.sleep(0.001)
    connection.close()

def desk_view(request):
    for _ in range(25):
        seen["desk"].append(user())            # autocommit: a transaction of its own
        time.sleep(0.002)
        with transaction.atomic():             # Django's transaction: the role for all of it
            seen["desk"].append(user())
            time.sleep(0.002)
            seen["desk"].append(user())
    return HttpResponse("ok")

thread = threading.Thread(target=agent)
thread.start()
time.sleep(0.05)
RequestRoleMiddleware(desk_view)(RequestFactory().get("/operations/"))
time.sleep(0.05)
stop.set()
thread.join()
seen["after"] = user()
result = {k: (sorted(set(v)) if isinstance(v, list) else v) for k, v in seen.items()}
result["agent_count"] = len(seen["agent"])
"""


def test_the_desk_role_never_leaks_to_another_client_of_the_server_connection(bouncer):
    """pool_size 1: the desk request's statements and another thread's agent statements
    take turns on one server connection. A session-level SET ROLE would leave it
    ledger_desk for the agent; SET LOCAL ends with each transaction."""
    result = run_child(bouncer, LEAK, login=TEST_LOGINS["web"])
    assert result["desk"] == ["ledger_desk"]
    assert result["agent"] == ["ledger_agent"]
    assert result["agent_count"] > 10, "expected the agent's statements interleaved"
    assert result["after"] == "ledger_agent"


LIFECYCLE = """
import json, os
from django.core.management import call_command
from ledger import receipts

sent = []

@receipts.action("articles.create", target="https://cms.example/a", key=lambda slug: slug)
def create(slug):
    sent.append(slug)
    return {"id": "art-" + slug}

first = create("pooled-1")
again = create("pooled-1")  # a replay: the stored result, not sent again
planned = receipts.record_intent("articles.create", "https://cms.example/a", {"n": 2},
                                 idempotency_key="pooled-2")
receipts.mark_submitted(planned, actor="bot")
receipts.mark_outcome_unknown(planned, error_code="timeout", actor="bot")
result = {"sent": sent, "first": first, "again": again}
"""


def test_the_lifecycle_through_the_pooler(bouncer):
    result = run_child(bouncer, LIFECYCLE, login=TEST_LOGINS["agent"])
    assert result == {"sent": ["pooled-1"], "first": {"id": "art-pooled-1"},
                      "again": {"id": "art-pooled-1"}}
    op = Operation.objects.get(idempotency_key="pooled-1")
    assert (op.state, op.version) == ("succeeded", 3)
    assert Operation.objects.get(idempotency_key="pooled-2").state == "outcome_unknown"
    # A reconciler pass, then the sealer, as the reconciler's login, through the pooler.
    sealed = run_child(bouncer, """
from django.core.management import call_command
call_command("reconcile", "--once", "--no-seal")
call_command("seal", "--once")
from ledger.models import OperationEvent
result = OperationEvent.objects.filter(chain_hash__isnull=True).count()
""", login=TEST_LOGINS["reconciler"])
    assert sealed == 0, "expected every event sealed by the sealer behind the pooler"
    assert OperationEvent.objects.filter(chain_hash__isnull=True).count() == 0


def test_the_api_and_the_python_client_through_the_pooler(bouncer, monkeypatch, tmp_path):
    from ledger_client import Ledger

    admin = UserFactory(username="pool-admin", role="admin", tenants=[])
    admin.is_superuser = True
    admin.save(update_fields=["is_superuser"])
    secret = agent_keys.create("pooled-bot", tenants=["default"], user=admin)[1]
    monkeypatch.setenv("LEDGER_POOLER_URL", bouncer.url(connection.settings_dict["NAME"]))
    server = LedgerServer(connection.settings_dict["NAME"], tmp_path / "server.log",
                          login=TEST_LOGINS["web"])
    server.start()
    sent = []
    try:
        with Ledger(server.url, key=secret) as ledger:
            @ledger.action("articles.create", target="https://cms.example/a",
                           key=lambda slug: slug)
            def create(slug):
                sent.append(slug)
                return {"id": "art-" + slug}

            assert create("http-1") == {"id": "art-http-1"}
            assert create("http-1") == {"id": "art-http-1"}  # replayed, not sent again
            assert [create(f"http-{n}") for n in range(2, 6)] == [
                {"id": f"art-http-{n}"} for n in range(2, 6)]
    finally:
        server.stop()
    assert sent == ["http-1", "http-2", "http-3", "http-4", "http-5"]
    assert sorted(Operation.objects.values_list("state", flat=True)) == ["succeeded"] * 5
    assert "pooler error" not in bouncer.log()
