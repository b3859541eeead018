"""Approvals over the network: an agent asks (HTTP, MCP), polls the operation's approval
status, and is refused sending until a person approved; a denial carries its reason. A
real uvicorn process on loopback, real PostgreSQL."""

from __future__ import annotations

import anyio
import pytest

from ledger import approvals
from ledger.models import ApprovalRequest, Operation
from tests.api.test_mcp import over_http
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)

PROBLEM = "application/problem+json"


@pytest.fixture
def payments_policy(admin):
    return approvals.set_policy("payments.*", user=admin)


def record_payment(agent, key="pay-7"):
    response = agent.post("/api/v1/operations", json={
        "operation": "payments.send", "target": "https://bank.example/transfers",
        "intent": {"to": "acct-1", "amount": 100}, "idempotency_key": key})
    assert response.status_code == 201, response.text
    return response.json()


def test_an_agent_asks_polls_and_sends_once_approved(payments_policy, make_key, client_for):
    agent = client_for(make_key("billing-bot"))
    op = record_payment(agent)
    url = f"/api/v1/operations/{op['operation_id']}"

    refused = agent.post(f"{url}/submitted", json={})
    assert refused.status_code == 409 and refused.headers["content-type"] == PROBLEM
    problem = refused.json()
    assert problem["error"] == "ApprovalRequired"
    assert (problem["approvals_needed"], problem["approvals_live"]) == (1, 0)

    asked = agent.post(f"{url}/approval-request", json={"note": "invoice 7, checked"})
    assert asked.status_code == 200, asked.text
    body = asked.json()
    assert body["state"] == "planned" and body["operation_id"] == op["operation_id"]
    assert body["approval"] == {
        "status": "awaiting", "needed": 1, "live": 0, "policies": "payments.*",
        "denied_reason": None, "intent_fingerprint": op["intent_fingerprint"],
        "requested": True, "note": "invoice 7, checked",
        "requested_at": body["approval"]["requested_at"]}
    request = ApprovalRequest.objects.get(operation__operation_id=op["operation_id"])
    assert (request.requested_by, request.status) == ("billing-bot", "pending")

    reviewer = UserFactory(username="ada", role="reviewer")
    approvals.approve(Operation.objects.get(operation_id=op["operation_id"]), user=reviewer,
                      reason="invoice matches")
    polled = agent.get(url).json()["approval"]
    assert (polled["status"], polled["live"]) == ("approved", 1)
    sent = agent.post(f"{url}/submitted", json={})
    assert sent.status_code == 200 and sent.json()["state"] == "submitted"


def test_a_denial_reaches_the_agent_with_its_reason(payments_policy, make_key, client_for):
    agent = client_for(make_key("billing-bot"))
    op = record_payment(agent)
    url = f"/api/v1/operations/{op['operation_id']}"
    agent.post(f"{url}/approval-request", json={})
    reviewer = UserFactory(username="ada", role="reviewer")
    approvals.deny(Operation.objects.get(operation_id=op["operation_id"]), user=reviewer,
                   reason="wrong account")
    approval = agent.get(url).json()["approval"]
    assert (approval["status"], approval["denied_reason"]) == ("denied", "wrong account")
    refused = agent.post(f"{url}/submitted", json={})
    assert refused.status_code == 409
    assert refused.json()["error"] in ("ApprovalDenied", "IllegalTransition")
    again = agent.post(f"{url}/approval-request", json={"note": "please"})
    assert again.status_code == 409 and "expected operation" in again.json()["detail"]


def test_an_operation_nothing_asks_about_is_not_required(make_key, client_for):
    agent = client_for(make_key("billing-bot"))
    op = record_payment(agent)
    approval = agent.get(f"/api/v1/operations/{op['operation_id']}").json()["approval"]
    assert (approval["status"], approval["needed"], approval["requested"]) == (
        "not_required", 0, False)


def test_another_tenants_operation_is_not_found(payments_policy, make_key, client_for):
    owner = client_for(make_key("billing-bot"))
    op = record_payment(owner)
    outsider = client_for(make_key("acme-bot", tenants=["acme"]))
    response = outsider.post(f"/api/v1/operations/{op['operation_id']}/approval-request",
                             json={"note": "mine?"})
    assert response.status_code == 404
    assert not ApprovalRequest.objects.exists()


def test_mcp_request_approval_then_poll(payments_policy, make_key, api_server, client_for):
    secret = make_key("http-bot")
    op = record_payment(client_for(secret))

    async def main():
        http, client = over_http(api_server, secret)
        async with http, client:
            tools = {tool.name: tool for tool in (await client.list_tools()).tools}
            assert "denied" in tools["ledger_request_approval"].description
            asked = await client.call_tool("ledger_request_approval", {
                "operation_id": op["operation_id"], "note": "refund for order 9"})
            assert not asked.is_error, asked.content
            assert asked.structured_content["approval"]["status"] == "awaiting"
            refused = await client.call_tool("ledger_mark_submitted",
                                             {"operation_id": op["operation_id"]})
            assert refused.is_error and "ApprovalRequired" in refused.content[0].text
            await anyio.to_thread.run_sync(approve)
            polled = await client.call_tool("ledger_get_operation",
                                            {"operation_id": op["operation_id"]})
            assert polled.structured_content["approval"]["status"] == "approved"

    def approve():
        from django.db import connection
        try:
            approvals.approve(Operation.objects.get(operation_id=op["operation_id"]),
                              user=UserFactory(username="ada", role="reviewer"), reason="ok")
        finally:
            connection.close()

    anyio.run(main)
    assert ApprovalRequest.objects.get().note == "refund for order 9"
