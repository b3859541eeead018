"""The HTTP API's `"submit": true` records a new intent and its submission in one
transaction (`receipts.record_intent(submit=True)`), and keeps its refusals: the intent
recorded, the problem carrying it."""

from __future__ import annotations

import pytest
from django.db import connection

from ledger import approvals
from ledger.models import Operation
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"operation": "mail.send", "target": "smtp://mail.example",
        "intent": {"to": "ada@example.com"}, "idempotency_key": "invoice-42", "submit": True}


def event_transactions(op) -> list[tuple[str, int]]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_state, xmin::text::bigint FROM ledger_operationevent "
                       "WHERE operation_id = %s ORDER BY version", [op.pk])
        return cursor.fetchall()


def test_submit_true_writes_the_intent_and_its_submission_in_one_transaction(make_key,
                                                                              client_for):
    agent = client_for(make_key("mailer"))
    first = agent.post("/api/v1/operations", json=BODY)
    assert first.status_code == 201, first.text
    assert (first.json()["state"], first.json()["submitted_now"]) == ("submitted", True)
    op = Operation.objects.get(operation_id=first.json()["operation_id"])
    (planned, one), (submitted, other) = event_transactions(op)
    assert (planned, submitted) == ("planned", "submitted") and one == other
    # the same key again: in flight, not submitted again
    again = agent.post("/api/v1/operations", json=BODY)
    assert again.status_code == 409, again.text
    assert len(event_transactions(op)) == 2


def test_a_refused_submission_leaves_the_intent_recorded_and_says_so(make_key, client_for):
    approvals.set_policy("payments.*", user=UserFactory(username="boss", role="admin"))
    agent = client_for(make_key("payer"))
    refused = agent.post("/api/v1/operations", json={**BODY, "operation": "payments.send"})
    assert refused.status_code == 409, refused.text
    body = refused.json()
    assert body["type"].endswith("approval-required") and body["approvals_needed"] == 1
    op = Operation.objects.get(operation="payments.send")
    assert (op.state, op.version) == ("planned", 1)
    assert body["operation"]["operation_id"] == op.operation_id, body
