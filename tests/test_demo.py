"""`make demo`'s processes (Procfile.demo under honcho): the reconciler beside the server
settles an operation an agent left outcome_unknown over the HTTP API, by reading the
simulated articles service the demo runs, within its interval; and `demo_seed --reset`
puts the demo back as it first was."""

from __future__ import annotations

import http.client
import io
import json
import os
import re
import time
from unittest.mock import ANY

import pytest
from django.core.management import call_command

from tests.conftest import DEMO_LOGINS
from tests.support.honcho import (
    ROOT,
    Honcho,
    connected_logins,
    database_url,
    process_names,
    procfile_for_tests,
    wait_for_port,
)
from tests.support.servers import free_port

INTERVAL = float(re.search(r"reconcile --interval (\S+)",
                           (ROOT / "Procfile.demo").read_text())[1])


def call(port: int, method: str, path: str, body: dict | None = None,
         headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    sent = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers=sent)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, json.loads(data or b"{}")


def test_the_demo_runs_a_reconciler_and_the_articles_service_beside_the_server():
    assert process_names("Procfile.demo") == ["web", "reconcile", "notify", "seal", "articles",
                                              "ready"]
    demo = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "manage.py demo_seed" in demo
    assert "honcho start -f Procfile.demo -p $(PORT)" in demo


@pytest.mark.django_db(transaction=True)
def test_the_demos_reconciler_settles_an_outcome_unknown_created_over_the_api(tmp_path):
    out = io.StringIO()
    call_command("agent_key", "create", "demo-agent", "--tenant", "default", stdout=out)
    key = re.search(r"alk_\S+", out.getvalue())[0]
    auth = {"Authorization": f"Bearer {key}"}
    port, articles_port = free_port(), free_port()
    # What the seed's agents left the demo's service (demo/operations.py): it starts with it.
    seeded = {"id": "art-00001", "title": "Weekly digest", "body": "Weekly digest: the full "
              "text.", "idempotency_key": "demo-newsroom:digest", "fingerprint": "f",
              "committed_at": "2026-01-05T09:00:00+00:00"}
    articles_file = tmp_path / "demo-articles.json"
    articles_file.write_text(json.dumps([seeded]))
    env = {k: v for k, v in os.environ.items()
           if k not in {"LEDGER_DATABASE_NAME", "DJANGO_ALLOW_ASYNC_UNSAFE", "PORT"}}
    # LEDGER_DB_POOL=1: each process keeps a connection, so its login shows in
    # pg_stat_activity (below)
    env.update(DATABASE_URL=database_url(), PYTHONUNBUFFERED="1", LEDGER_DB_POOL="1",
               LEDGER_DESK_URL=f"http://127.0.0.1:{port}", DEMO_ARTICLES_PORT=str(articles_port),
               DEMO_ARTICLES_FILE=str(articles_file))
    procfile = procfile_for_tests("Procfile.demo", tmp_path)
    honcho = Honcho(procfile, port=port, env=env)
    try:
        wait_for_port(port, honcho)
        honcho.read_until(r"reconcile\.1\s+\| reconcile: started")
        honcho.read_until(r"articles\.1\s+\| demo_articles: started with 1 article\(s\)")
        assert call(articles_port, "GET", "/articles/by-key/demo-newsroom:digest") == (
            200, {"article": seeded, "consistent_as_of": ANY})
        # once the desk answers, the last process says where to go and who to be
        honcho.read_until(rf"ready\.1\s+\| Open http://127\.0\.0\.1:{port}/ and log in")
        honcho.read_until(r"ready\.1\s+\|\s+reviewer\s+/ reviewer-demo-pass")

        # The agent's call reached the service and committed, but its answer was lost.
        articles = f"http://127.0.0.1:{articles_port}/articles"
        status, article = call(articles_port, "POST", "/articles",
                               {"title": "Harbour reopens", "body": "After the storm"},
                               {"Idempotency-Key": "harbour-1"})
        assert status == 201, article
        status, op = call(port, "POST", "/api/v1/operations", {
            "operation": "articles.create", "target": articles, "idempotency_key": "harbour-1",
            "intent": {"title": "Harbour reopens", "body": "After the storm"}}, auth)
        assert status == 201, op
        path = f"/api/v1/operations/{op['operation_id']}"
        status, op = call(port, "POST", f"{path}/submitted", {"expected_version": 1}, auth)
        assert status == 200, op
        status, op = call(port, "POST", f"{path}/outcome-unknown",
                          {"error_code": "TimeoutError", "expected_version": 2}, auth)
        assert (status, op["state"]) == (200, "outcome_unknown"), op

        # The demo's reconciler reads the service and settles it: within a few of its
        # intervals (bounded: the loop sleeps INTERVAL when nothing is due).
        deadline = time.monotonic() + 10 * INTERVAL + 30
        while time.monotonic() < deadline:
            status, op = call(port, "GET", path, headers=auth)
            if op["state"] not in ("outcome_unknown", "reconciling"):
                break
            time.sleep(0.5)
        assert op["state"] == "succeeded", op
        assert op["external_id"] == article["id"]
        assert [e["verdict"] for e in op["evidence"]] == ["found"]
        honcho.read_until(rf"{op['operation_id']} articles\.create found -> succeeded")

        # Each process of the demo logged in as its own kind (Procfile.demo, `make demo`'s
        # db_roles --login), none of the four as the owner.
        logins = {login for login, _ in DEMO_LOGINS}
        deadline = time.monotonic() + 60
        while not connected_logins() >= logins and time.monotonic() < deadline:
            time.sleep(0.25)
        assert connected_logins() >= logins, connected_logins()
    finally:
        honcho.stop()
    # Stopped, the service left what it holds for its next start.
    assert [a["id"] for a in json.loads(articles_file.read_text())] == [seeded["id"],
                                                                        article["id"]]
