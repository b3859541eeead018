"""How many SQL statements each endpoint of a receipt's lifecycle runs, pinned.

In process through Django's test client (the API's middleware runs no query), under
`transaction=True` so that, as when served, each statement outside a transaction commits
on its own and no test savepoint is counted. An endpoint that names an operation reads
the key and the operation in one statement (`agent_keys.authenticate_with_operation`).
"""

from __future__ import annotations

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


def test_get_operation_runs_five_statements(agent):
    operation_id = agent.post("/api/v1/operations", {
        "operation": "mail.send", "target": "smtp://mail.example", "intent": INTENT},
        content_type="application/json").json()["operation_id"]

    with CaptureQueriesContext(connection) as queries:
        response = agent.get(f"/api/v1/operations/{operation_id}")

    assert response.status_code == 200, response.content
    assert [e["to_state"] for e in response.json()["events"]] == ["planned"]
    # The key with the operation; the approval gate; the approval request; events; evidence.
    assert len(queries) == 5, _sql(queries)


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
