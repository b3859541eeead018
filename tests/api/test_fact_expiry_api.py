"""Facts that expire over HTTP and MCP: `expires_at` / `ttl_seconds` beside the other
parameters, an expired fact left out of reads (or marked with include_expired), and an
action relying on it refused like a stale one (409 stale-fact / StaleFact)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import anyio
import pytest

from ledger.models import Fact, Operation
from tests.api.test_http import assert_problem, record
from tests.api.test_mcp import stdio

pytestmark = pytest.mark.django_db(transaction=True)


def test_http_takes_an_expiry_reads_leave_the_expired_out_and_relying_on_it_is_refused(
        make_key, client_for):
    agent = client_for(make_key("expiry-bot"))
    at = (datetime.now(UTC) + timedelta(hours=2)).replace(microsecond=0)
    lasting = agent.post("/api/v1/facts", json={
        "subject": "order:8", "predicate": "carrier", "value": "dhl",
        "expires_at": at.isoformat()})
    assert lasting.status_code == 200, lasting.text
    returned = lasting.json()
    assert datetime.fromisoformat(returned["expires_at"].replace("Z", "+00:00")) == at
    assert returned["expired"] is False
    short = agent.post("/api/v1/facts", json={
        "subject": "order:8", "predicate": "status", "value": "paid", "ttl_seconds": 0.5})
    assert short.status_code == 200, short.text
    assert short.json()["expires_at"] is not None
    created = record(agent, idempotency_key="ship-8", relies_on=[
        {"subject": "order:8", "predicate": "status", "version": 1}])
    assert created.status_code == 201, created.text
    time.sleep(0.6)
    current = agent.get("/api/v1/facts", params={"subject": "order:8"}).json()
    assert [f["predicate"] for f in current] == ["carrier"]
    everything = agent.get("/api/v1/facts", params={"subject": "order:8",
                                                    "include_expired": "true"}).json()
    assert [(f["predicate"], f["expired"]) for f in everything] == [
        ("carrier", False), ("status", True)]
    refused = agent.post(f"/api/v1/operations/{created.json()['operation_id']}/submitted",
                         json={})
    assert_problem(refused, 409, detail_has="expired at")
    assert Operation.objects.get(idempotency_key="ship-8").state == "planned"


@pytest.mark.parametrize("body, says", [
    ({"ttl_seconds": 0}, "ttl_seconds"),
    ({"ttl_seconds": "soon"}, "ttl_seconds"),
    ({"ttl_seconds": 60, "expires_at": "2099-01-01T00:00:00Z"}, "not both"),
    ({"expires_at": "2001-01-01T00:00:00Z"}, "expected expires_at after"),
])
def test_http_refuses_a_bad_expiry_as_a_problem(make_key, client_for, body, says):
    agent = client_for(make_key("expiry-bad-bot"))
    refused = agent.post("/api/v1/facts", json={
        "subject": "order:9", "predicate": "status", "value": "paid", **body})
    problem = assert_problem(refused, 422)
    assert says in refused.text, problem
    assert not Fact.objects.exists()


def test_mcp_takes_an_expiry_and_an_action_relying_on_the_expired_fact_is_refused(make_key):
    secret = make_key("expiry-mcp-bot")

    async def main():
        async with stdio(secret) as client:
            asserted = await client.call_tool("state_assert_fact", {
                "subject": "order:78", "predicate": "status", "value": "paid",
                "ttl_seconds": 0.5})
            assert not asserted.is_error, asserted.content
            recorded = await client.call_tool("ledger_record_intent", {
                "operation": "parcels.ship", "target": "https://carrier.example",
                "intent": {"order": 78}, "idempotency_key": "ship-78",
                "relies_on": [{"subject": "order:78", "predicate": "status", "version": 1}]})
            assert not recorded.is_error, recorded.content
            await anyio.sleep(0.6)
            read = await client.call_tool("state_read_facts", {"subject": "order:78"})
            marked = await client.call_tool("state_read_facts", {
                "subject": "order:78", "include_expired": True})
            refused = await client.call_tool("ledger_mark_submitted", {
                "operation_id": recorded.structured_content["operation"]["operation_id"]})
            return asserted.structured_content, read, marked, refused

    asserted, read, marked, refused = anyio.run(main)
    assert asserted["expires_at"] and asserted["expired"] is False
    assert read.structured_content["facts"] == []
    assert [f["expired"] for f in marked.structured_content["facts"]] == [True]
    assert refused.is_error and "StaleFact" in refused.content[0].text
    assert "expired at" in refused.content[0].text
    assert Operation.objects.get().state == "planned"
