"""Over HTTP and MCP, a leased run takes no step or obligation without its lease's current
token: without one, or with an older one, the write is refused (409 stale-fencing-token,
an MCP tool error naming StaleFencingToken) and nothing is written; the holder's writes
with its token are taken."""

from __future__ import annotations

import anyio
import pytest

from ledger.models import Obligation, Step
from tests.api.test_http import assert_problem
from tests.api.test_mcp import over_http

pytestmark = pytest.mark.django_db(transaction=True)


def leased_over_http(agent, run_id: str) -> tuple[int, int]:
    """Start `run_id` and resume it twice: (old, new) tokens."""
    assert agent.post("/api/v1/runs", json={"objective": "refunds",
                                            "run_id": run_id}).status_code == 200
    old = agent.post(f"/api/v1/runs/{run_id}/resume", json={}).json()["token"]
    new = agent.post(f"/api/v1/runs/{run_id}/resume", json={}).json()["token"]
    assert new > old
    return old, new


def test_http_refuses_a_leased_run_s_step_and_obligation_without_the_current_token(
        make_key, client_for):
    agent = client_for(make_key("crm-bot"))
    old, new = leased_over_http(agent, "run-h")
    for token in ({}, {"fencing_token": old}):
        step = agent.post("/api/v1/runs/run-h/steps", json={"step_id": "pack", **token})
        body = assert_problem(step, 409, detail_has="run:default:run-h")
        assert (body["error"], body["current_token"]) == ("StaleFencingToken", new)
        opened = agent.post("/api/v1/obligations", json={
            "run": "run-h", "kind": "refund", "key": "refund-h", **token})
        body = assert_problem(opened, 409, detail_has="run:default:run-h")
        assert (body["error"], body["current_token"]) == ("StaleFencingToken", new)
    assert not Step.objects.exists() and not Obligation.objects.exists()

    step = agent.post("/api/v1/runs/run-h/steps", json={"step_id": "pack",
                                                        "fencing_token": new})
    assert step.status_code == 200, step.text
    assert step.json()["state"] == "pending"
    opened = agent.post("/api/v1/obligations", json={
        "run": "run-h", "kind": "refund", "key": "refund-h", "fencing_token": new})
    assert opened.status_code == 200, opened.text
    assert (Step.objects.get().added_token, Obligation.objects.get().opened_token) == (new, new)
    refused = agent.post("/api/v1/obligations/refund-h/commit", json={"result": {"id": 1}})
    assert assert_problem(refused, 409)["error"] == "StaleFencingToken"
    won = agent.post("/api/v1/obligations/refund-h/commit",
                     json={"result": {"id": 1}, "fencing_token": new})
    assert won.status_code == 200 and won.json()["state"] == "committed"


def test_http_adds_a_step_to_a_run_never_leased_without_a_token(make_key, client_for):
    agent = client_for(make_key("crm-bot"))
    agent.post("/api/v1/runs", json={"objective": "refunds", "run_id": "run-free"})
    step = agent.post("/api/v1/runs/run-free/steps", json={"step_id": "pack"})
    assert step.status_code == 200, step.text
    # A token names a lease this run never had.
    named = agent.post("/api/v1/runs/run-free/steps", json={"step_id": "ship",
                                                            "fencing_token": 1})
    assert_problem(named, 409, detail_has="no lease at all")
    assert list(Step.objects.values_list("step_id", "added_token")) == [("pack", None)]


def test_mcp_refuses_a_leased_run_s_step_and_obligation_without_the_current_token(
        make_key, api_server):
    secret = make_key("mcp-bot")

    async def main():
        http, client = over_http(api_server, secret)
        async with http, client:
            await client.call_tool("run_start", {"objective": "refunds", "run_id": "run-m"})
            old = (await client.call_tool("run_resume", {"run_id": "run-m"})
                   ).structured_content["token"]
            new = (await client.call_tool("run_resume", {"run_id": "run-m"})
                   ).structured_content["token"]
            refusals = {}
            for label, token in (("none", {}), ("old", {"fencing_token": old})):
                step = await client.call_tool("run_add_step", {
                    "run_id": "run-m", "step_id": "pack", **token})
                opened = await client.call_tool("state_open_obligation", {
                    "run": "run-m", "kind": "refund", "key": "refund-m", **token})
                refusals[label] = [(result.is_error, "StaleFencingToken" in
                                    result.content[0].text) for result in (step, opened)]
            step = await client.call_tool("run_add_step", {
                "run_id": "run-m", "step_id": "pack", "fencing_token": new})
            opened = await client.call_tool("state_open_obligation", {
                "run": "run-m", "kind": "refund", "key": "refund-m", "fencing_token": new})
            return new, refusals, step, opened

    new, refusals, step, opened = anyio.run(main)
    assert refusals == {"none": [(True, True), (True, True)],
                        "old": [(True, True), (True, True)]}
    assert not step.is_error, step.content
    assert not opened.is_error, opened.content
    assert step.structured_content["state"] == "pending"
    assert opened.structured_content["state"] == "open"
    assert (Step.objects.get().added_token, Obligation.objects.get().opened_token) == (new, new)
