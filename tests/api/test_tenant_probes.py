"""Probing another tenant through the API: naming a tenant the key is not granted is
refused (403), and an id of another tenant's operation, run or obligation is answered
exactly as an id that exists nowhere."""

from __future__ import annotations

import pytest

from ledger import obligations, runs
from tests.api.test_http import assert_problem, record

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def agents(make_key, client_for):
    return client_for(make_key("ours-bot", ["default"])), client_for(
        make_key("theirs-bot", ["acme"]))


@pytest.mark.parametrize("path", ["/api/v1/operations?tenant=acme",
                                  "/api/v1/operations?tenant=nobody-has-this",
                                  "/api/v1/facts?subject=s&tenant=acme"])
def test_a_tenant_the_key_is_not_granted_is_403(agents, path):
    ours, _ = agents
    problem = assert_problem(ours.get(path), 403, detail_has="to be granted tenant")
    assert problem["error"] == "PermissionDenied"


def test_listing_a_granted_tenant_still_works(agents):
    ours, _ = agents
    record(ours)
    page = ours.get("/api/v1/operations?tenant=default")
    assert page.status_code == 200 and len(page.json()["items"]) == 1


def _same_answer(existing, missing, their_id: str, no_id: str) -> None:
    assert existing.status_code == missing.status_code == 404, (existing.text, missing.text)
    a, b = existing.json(), missing.json()
    assert a["detail"].replace(their_id, "ID") == b["detail"].replace(no_id, "ID")
    assert {k: v for k, v in a.items() if k != "detail"} == {
        k: v for k, v in b.items() if k != "detail"}
    assert existing.headers["content-type"] == missing.headers["content-type"]


def test_another_tenants_operation_looks_like_none(agents):
    ours, theirs = agents
    their_id = record(theirs, tenant="acme").json()["operation_id"]
    no_id = "20990101T000000Z-0000000000"
    for suffix, method, body in [("", "GET", None), ("/submitted", "POST", {}),
                                 ("/approval-request", "POST", {})]:
        existing = ours.request(method, f"/api/v1/operations/{their_id}{suffix}", json=body)
        missing = ours.request(method, f"/api/v1/operations/{no_id}{suffix}", json=body)
        _same_answer(existing, missing, their_id, no_id)


def test_another_tenants_run_and_obligation_look_like_none(agents):
    ours, _ = agents
    run = runs.start("theirs", tenant="acme", run_id="their-run")
    obligations.open(run, "invoice", "their-obligation")
    for path, body in [("/runs/{}/steps", {"step_id": "s"}), ("/runs/{}/resume", {})]:
        existing = ours.post("/api/v1" + path.format("their-run"), json=body)
        missing = ours.post("/api/v1" + path.format("no-run"), json=body)
        _same_answer(existing, missing, "their-run", "no-run")
    existing = ours.post("/api/v1/obligations/their-obligation/commit", json={"result": 1})
    missing = ours.post("/api/v1/obligations/no-obligation/commit", json={"result": 1})
    _same_answer(existing, missing, "their-obligation", "no-obligation")
    existing = ours.post("/api/v1/obligations", json={"run": "their-run", "kind": "k",
                                                      "key": "k1"})
    missing = ours.post("/api/v1/obligations", json={"run": "no-run", "kind": "k",
                                                     "key": "k1"})
    _same_answer(existing, missing, "their-run", "no-run")
