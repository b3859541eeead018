"""How many SQL statements each endpoint of a receipt's lifecycle runs, pinned.

In process through Django's test client (the API's middleware runs no query), under
`transaction=True` so that, as when served, each statement outside a transaction commits
on its own and no test savepoint is counted. An endpoint that names an operation reads
the key and the operation in one statement (`agent_keys.authenticate_with_operation`); one
that names none reads the key unless this process verified it a moment ago
(`agent_keys.VerifiedKeys`).
"""

from __future__ import annotations

import time

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

pytestmark = pytest.mark.django_db(transaction=True)

INTENT = {"to": "ada@example.com", "subject": "Invoice 42"}


@pytest.fixture
def agent(make_key) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {make_key('billing-bot')}")


def _sql(queries) -> list[str]:
    return [q["sql"] for q in queries.captured_queries]


def test_record_intent_runs_three_statements(agent):
    # The key; the idempotency look-up; the insert of the row and its event.
    with CaptureQueriesContext(connection) as queries:
        response = agent.post("/api/v1/operations", {
            "operation": "mail.send", "target": "smtp://mail.example", "intent": INTENT,
            "idempotency_key": "invoice-42"}, content_type="application/json")

    assert response.status_code == 201, response.content
    assert len(queries) == 3, _sql(queries)


def test_a_replayed_key_runs_two_statements(agent):
    assert _record(agent, "invoice-42").status_code == 201

    with CaptureQueriesContext(connection) as queries:
        response = _record(agent, "invoice-42")

    assert response.status_code == 200, response.content
    assert response.headers["Idempotent-Replayed"] == "true"
    # The key; the look-up, which finds it (no insert).
    assert len(queries) == 2, _sql(queries)
    assert not any("INSERT" in sql for sql in _sql(queries))


def test_record_and_submit_runs_three_statements_and_a_replay_four(agent):
    body = {"operation": "mail.send", "target": "smtp://mail.example", "intent": INTENT,
            "idempotency_key": "invoice-43", "submit": True}
    with CaptureQueriesContext(connection) as queries:
        response = agent.post("/api/v1/operations", body, content_type="application/json")
    assert response.status_code == 201, response.content
    # The key; the insert and the submission, in one pipeline (one round trip, one commit):
    # no look-up first.
    assert len(queries) == 3, _sql(queries)
    assert "INSERT INTO ledger_operation" in _sql(queries)[1]
    assert "UPDATE ledger_operation" in _sql(queries)[2]

    with CaptureQueriesContext(connection) as queries:
        response = agent.post("/api/v1/operations", body, content_type="application/json")
    assert response.status_code == 409, response.content  # submitted a moment ago: in flight
    # The key; the pipeline, which finds the key taken and writes nothing; the look-up.
    assert len(queries) == 4, _sql(queries)
    assert "INSERT INTO ledger_operation" in _sql(queries)[1]
    assert "idempotency_key = " in _sql(queries)[3]


def test_marks_run_two_statements_the_key_and_operation_read_together(agent):
    operation_id = agent.post("/api/v1/operations", {
        "operation": "mail.send", "target": "smtp://mail.example", "intent": INTENT},
        content_type="application/json").json()["operation_id"]

    for outcome, body in (("submitted", {}), ("succeeded", {"external_id": "msg-1"})):
        with CaptureQueriesContext(connection) as queries:
            response = agent.post(f"/api/v1/operations/{operation_id}/{outcome}", body,
                                  content_type="application/json")

        assert response.status_code == 200, response.content
        assert response.json()["state"] == outcome
        # The key with the operation; the compare-and-set of the row with its event.
        assert len(queries) == 2, _sql(queries)
        first = queries.captured_queries[0]["sql"]
        assert "ledger_agentkey" in first and "ledger_operation" in first


def test_get_operation_runs_two_statements(agent):
    operation_id = agent.post("/api/v1/operations", {
        "operation": "mail.send", "target": "smtp://mail.example", "intent": INTENT},
        content_type="application/json").json()["operation_id"]

    with CaptureQueriesContext(connection) as queries:
        response = agent.get(f"/api/v1/operations/{operation_id}")

    assert response.status_code == 200, response.content
    assert [e["to_state"] for e in response.json()["events"]] == ["planned"]
    # The key with the operation; its approval status (the gate with the request), events
    # and evidence in one statement (`selectors.operation_receipt`).
    assert len(queries) == 2, _sql(queries)
    first, second = _sql(queries)
    assert "ledger_agentkey" in first and "ledger_operation" in first
    assert all(table in second for table in (
        "ledger_approvalpolicy", "ledger_approvalrequest", "ledger_operationevent",
        "ledger_evidence"))


def test_a_key_revoked_between_two_requests_is_refused_on_the_next(agent, admin):
    from ledger import agent_keys

    operation_id = agent.post("/api/v1/operations", {
        "operation": "mail.send", "target": "smtp://mail.example", "intent": INTENT},
        content_type="application/json").json()["operation_id"]
    assert agent.get(f"/api/v1/operations/{operation_id}").status_code == 200

    agent_keys.revoke("billing-bot", user=admin)

    response = agent.post(f"/api/v1/operations/{operation_id}/submitted", {},
                          content_type="application/json")
    assert response.status_code == 401
    assert agent.get(f"/api/v1/operations/{operation_id}").status_code == 401


def _record(agent, key: str):
    return agent.post("/api/v1/operations", {
        "operation": "mail.send", "target": "smtp://mail.example", "intent": INTENT,
        "idempotency_key": key}, content_type="application/json")


def test_a_key_verified_a_moment_ago_is_not_asked_for_again(agent, settings):
    # With the cache on (off by default: a revoked key is refused from its next request).
    settings.LEDGER_AGENT_KEY_CACHE_SECONDS = 2
    assert _record(agent, "first").status_code == 201

    with CaptureQueriesContext(connection) as queries:
        response = _record(agent, "second")

    assert response.status_code == 201, response.content
    # The idempotency look-up; the insert of the row and its event: no key read.
    assert len(queries) == 2, _sql(queries)
    assert not any("ledger_agentkey" in sql for sql in _sql(queries))


def test_a_key_revoked_in_this_process_is_refused_at_once_even_when_verified(agent, admin):
    from ledger import agent_keys

    assert _record(agent, "before").status_code == 201

    agent_keys.revoke("billing-bot", user=admin)

    assert _record(agent, "after").status_code == 401


def test_a_key_revoked_elsewhere_is_refused_within_the_cache_seconds(agent, settings):
    # Revoked by another process: this one's verified keys are not told.
    from django.utils import timezone

    from ledger.models import AgentKey

    settings.LEDGER_AGENT_KEY_CACHE_SECONDS = 1
    assert _record(agent, "before").status_code == 201
    AgentKey.objects.filter(name="billing-bot").update(revoked_at=timezone.now())

    believed_until = time.monotonic() + 1
    early = _record(agent, "meanwhile")
    if time.monotonic() < believed_until:  # (a slow machine may already be past it)
        assert early.status_code == 201, early.content
    time.sleep(max(0.0, believed_until - time.monotonic()) + 0.05)

    assert _record(agent, "after").status_code == 401


def test_a_request_naming_an_operation_reads_the_key_and_forgets_a_revoked_one(agent):
    from django.utils import timezone

    from ledger.models import AgentKey

    operation_id = _record(agent, "before").json()["operation_id"]
    AgentKey.objects.filter(name="billing-bot").update(revoked_at=timezone.now())

    # The key is read with the operation, whatever was verified before: refused at once,
    assert agent.get(f"/api/v1/operations/{operation_id}").status_code == 401
    # and no longer believed on requests that name none.
    assert _record(agent, "after").status_code == 401


def test_no_key_is_believed_again_with_the_cache_off(agent, settings):
    settings.LEDGER_AGENT_KEY_CACHE_SECONDS = 0
    assert _record(agent, "first").status_code == 201

    with CaptureQueriesContext(connection) as queries:
        assert _record(agent, "second").status_code == 201

    # The key, read again; the look-up; the insert.
    assert len(queries) == 3, _sql(queries)
    assert "ledger_agentkey" in _sql(queries)[0]


def test_a_key_of_two_tenants_acts_on_an_operation_of_its_second(make_key):
    from ledger import receipts

    agent = Client(HTTP_AUTHORIZATION=f"Bearer {make_key('two-bot', ['acme', 'globex'])}")
    mine = receipts.record_intent("mail.send", "smtp://x", {"n": 1}, tenant="globex")
    theirs = receipts.record_intent("mail.send", "smtp://x", {"n": 1}, tenant="initech")

    response = agent.post(f"/api/v1/operations/{mine.operation_id}/submitted", {},
                          content_type="application/json")
    assert response.status_code == 200, response.content
    assert response.json()["tenant"] == "globex"
    hidden = agent.post(f"/api/v1/operations/{theirs.operation_id}/submitted", {},
                        content_type="application/json")
    assert hidden.status_code == 404
    theirs.refresh_from_db()
    assert theirs.state == "planned"
