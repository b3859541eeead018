"""The web process logs in as its own login (agent and desk) and serves the HTTP API and MCP
as ledger_agent: an agent key cannot make it decide as a person."""

from __future__ import annotations

import threading

import pytest

from ledger.models import Operation
from tests.conftest import TEST_LOGINS
from tests.support.retention import raw_connection

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_api_is_served_by_the_web_login_as_the_agent(make_key, client_for):
    client = client_for(make_key("web-bot"))
    # Hold the operations table so that the server's statement waits where we can see it.
    with raw_connection() as holder, raw_connection() as watcher:
        holder.execute("BEGIN")
        holder.execute("LOCK TABLE ledger_operation IN ACCESS EXCLUSIVE MODE")
        answers = []
        request = threading.Thread(target=lambda: answers.append(client.post(
            "/api/v1/operations", json={"operation": "articles.create",
                                        "target": "https://cms.example/a",
                                        "intent": {"title": "t"}})))
        request.start()
        waiting = None
        for _ in range(300):
            waiting = watcher.execute(
                "SELECT usename FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()").fetchone()
            if waiting:
                break
            threading.Event().wait(0.1)
        holder.execute("ROLLBACK")
        request.join(timeout=60)
    assert waiting == (TEST_LOGINS["web"],)
    assert answers and answers[0].status_code == 201, answers
    assert Operation.objects.get().state == "planned"


def test_the_web_login_starts_every_session_as_the_agent(db):
    with raw_connection() as conn:
        row = conn.execute("SELECT setconfig FROM pg_db_role_setting s JOIN pg_roles r "
                           "ON r.oid = s.setrole WHERE r.rolname = %s AND s.setdatabase = 0",
                           [TEST_LOGINS["web"]]).fetchone()
    assert row == (["role=ledger_agent"],)


def test_a_desk_decision_through_the_web_process_runs_as_the_desk(api_server):
    import re

    import httpx

    from tests.factories import OperationFactory, UserFactory

    UserFactory(username="web-reviewer", role="reviewer", password="served as the desk 1")
    op = OperationFactory(state="outcome_unknown")
    with httpx.Client(base_url=api_server, timeout=30) as browser:
        page = browser.get("/accounts/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
        logged_in = browser.post("/accounts/login/", data={
            "username": "web-reviewer", "password": "served as the desk 1",
            "csrfmiddlewaretoken": token}, headers={"Referer": f"{api_server}/accounts/login/"})
        assert logged_in.status_code == 302, logged_in.text[:500]
        detail = browser.get(f"/operations/{op.operation_id}/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', detail.text).group(1)
        decided = browser.post(f"/operations/{op.operation_id}/resolve/", data={
            "to_state": "succeeded", "reason": "seen in the CMS", "external_id": "w-1",
            "version": op.version, "csrfmiddlewaretoken": token},
            headers={"Referer": f"{api_server}/operations/{op.operation_id}/"})
    assert decided.status_code in (200, 302), decided.text[:500]
    op.refresh_from_db()
    assert (op.state, op.external_id) == ("succeeded", "w-1")
    assert op.events.order_by("-version").first().actor_id == "web-reviewer"
