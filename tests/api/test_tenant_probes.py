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


def test_an_id_another_tenant_holds_is_ours_to_take_and_each_lease_fences_its_own_run(agents):
    ours, theirs = agents
    assert theirs.post("/api/v1/runs", json={"objective": "theirs", "run_id": "run-1",
                                             "tenant": "acme"}).status_code == 200
    assert theirs.post("/api/v1/obligations", json={"run": "run-1", "kind": "refund",
                                                    "key": "refund-1"}).status_code == 200
    # The same run id and obligation key are ours to take: nothing says they exist elsewhere.
    run = ours.post("/api/v1/runs", json={"objective": "ours", "run_id": "run-1"})
    assert run.status_code == 200 and run.json()["tenant"] == "default", run.text
    opened = ours.post("/api/v1/obligations", json={"run": "run-1", "kind": "invoice",
                                                    "key": "refund-1"})
    assert opened.status_code == 200 and opened.json()["kind"] == "invoice", opened.text
    # Each run has its own lease: theirs taken twice, ours once.
    theirs.post("/api/v1/runs/run-1/resume", json={})
    their_token = theirs.post("/api/v1/runs/run-1/resume", json={}).json()["token"]
    our_token = ours.post("/api/v1/runs/run-1/resume", json={}).json()["token"]
    assert (their_token, our_token) == (2, 1)
    assert runs.as_run("run-1", tenant="acme").lease_resource == "run:acme:run-1"
    committed = ours.post("/api/v1/obligations/refund-1/commit",
                          json={"result": {"ours": True}, "fencing_token": our_token})
    assert committed.status_code == 200 and committed.json()["state"] == "committed"
    stale = theirs.post("/api/v1/obligations/refund-1/commit",
                        json={"result": {"theirs": True}, "fencing_token": 1})
    assert_problem(stale, 409, detail_has="run:acme:run-1")
    assert obligations.commit("refund-1", {"theirs": True}, fencing_token=their_token,
                              tenant="acme").result == {"theirs": True}


def test_a_tenant_with_a_colon_never_shares_a_lease_with_another_tenant_s_run(db):
    # Without escaping, both runs' leases would be called run:a:b:c.
    one = runs.start("one", tenant="a", run_id="b:c")
    two = runs.start("two", tenant="a:b", run_id="c")
    assert (one.lease_resource, two.lease_resource) == ("run:a:b:c", "run:a%3Ab:c")
    runs.resume(one, worker="w1")
    assert runs.resume(two, worker="w2").token == 1


def test_a_key_of_two_tenants_names_the_tenant_of_an_id_both_use(make_key, client_for):
    both = client_for(make_key("both-bot", ["default", "acme"]))
    for tenant in ("default", "acme"):
        assert both.post("/api/v1/runs", json={"objective": tenant, "run_id": "shared",
                                               "tenant": tenant}).status_code == 200
    assert_problem(both.post("/api/v1/runs/shared/resume", json={}), 422,
                   detail_has="tenant")
    assert_problem(both.post("/api/v1/runs/shared/resume?tenant=nobody", json={}), 403,
                   detail_has="to be granted tenant")
    resumed = both.post("/api/v1/runs/shared/resume?tenant=acme", json={})
    assert resumed.status_code == 200 and resumed.json()["tenant"] == "acme", resumed.text
    token = resumed.json()["token"]
    step = both.post("/api/v1/runs/shared/steps?tenant=acme", json={"step_id": "s",
                                                                    "fencing_token": token})
    assert step.status_code == 200, step.text
    opened = both.post("/api/v1/obligations", json={"run": "shared", "kind": "refund",
                                                    "key": "o-1", "tenant": "acme",
                                                    "fencing_token": token})
    assert opened.status_code == 200, opened.text
    committed = both.post("/api/v1/obligations/o-1/commit?tenant=acme",
                          json={"result": 1, "fencing_token": token})
    assert committed.status_code == 200 and committed.json()["state"] == "committed"
    assert runs.as_run("shared", tenant="default").objective == "default"
