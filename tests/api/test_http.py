"""The HTTP API end to end: a real uvicorn process on loopback, real PostgreSQL."""

from __future__ import annotations

import json
from datetime import timedelta

import httpx
import pytest

from ledger import access, leases
from ledger.models import AgentKey, Fact, Operation, OperationEvent
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)

PROBLEM = "application/problem+json"
INTENT = {"to": "ada@example.com", "subject": "Invoice 42",
          "headers": {"Authorization": "Bearer sk-live-123"}}


def record(client, **overrides) -> httpx.Response:
    body = {"operation": "mail.send", "target": "smtp://mail.example", "intent": INTENT,
            "idempotency_key": "invoice-42"}
    body.update(overrides)
    return client.post("/api/v1/operations", json=body)


def assert_problem(response: httpx.Response, status: int, *, detail_has: str = "") -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body = response.json()
    assert body["status"] == status
    assert body["type"].startswith("urn:agent-ledger:problem:")
    assert body["title"]
    assert detail_has in body["detail"]
    return body


def test_receipt_lifecycle_is_recorded_with_the_keys_agent_as_actor(make_key, client_for):
    agent = client_for(make_key("billing-bot"))

    created = record(agent, actor="someone-else")
    assert created.status_code == 201
    op = created.json()
    assert op["state"] == "planned" and op["version"] == 1 and op["tenant"] == "default"
    assert op["intent"]["headers"]["Authorization"] == "[redacted]"
    assert op["intent_fingerprint"].startswith("sha256:")

    url = f"/api/v1/operations/{op['operation_id']}"
    early = agent.post(f"{url}/succeeded", json={"external_id": "msg-0"})
    detail = assert_problem(early, 409, detail_has="one of abandoned, submitted")["detail"]
    assert "State." not in detail
    submitted = agent.post(f"{url}/submitted", json={"expected_version": 1})
    assert submitted.status_code == 200 and submitted.json()["state"] == "submitted"
    succeeded = agent.post(f"{url}/succeeded",
                           json={"external_id": "msg-1", "evidence": {"smtp": "250 OK"},
                                 "expected_version": 2})
    assert succeeded.status_code == 200
    assert succeeded.json()["state"] == "succeeded"
    assert succeeded.json()["external_id"] == "msg-1"

    receipt = agent.get(url).json()
    assert [(e["from_state"], e["to_state"]) for e in receipt["events"]] == [
        ("", "planned"), ("planned", "submitted"), ("submitted", "succeeded")]
    assert {e["actor_id"] for e in receipt["events"]} == {"billing-bot"}
    assert receipt["events"][2]["evidence"] == {"smtp": "250 OK"}
    # The database agrees: the key's name, never a name from the request.
    assert set(OperationEvent.objects.values_list("actor_id", flat=True)) == {"billing-bot"}


def test_rejected_and_outcome_unknown_record_the_error(make_key, client_for):
    agent = client_for(make_key("billing-bot"))
    rejected = record(agent, idempotency_key="a").json()
    unknown = record(agent, idempotency_key="b").json()
    for op in (rejected, unknown):
        agent.post(f"/api/v1/operations/{op['operation_id']}/submitted", json={})
    r = agent.post(f"/api/v1/operations/{rejected['operation_id']}/rejected",
                   json={"error_code": "HTTP 422", "detail": "bad address"})
    assert r.json()["state"] == "rejected" and r.json()["error_code"] == "HTTP 422"
    r = agent.post(f"/api/v1/operations/{unknown['operation_id']}/outcome-unknown",
                   json={"error_code": "TimeoutError"})
    assert r.json()["state"] == "outcome_unknown"


def test_same_key_and_intent_returns_the_existing_operation_with_200(make_key, client_for):
    agent = client_for(make_key("billing-bot"))
    first = record(agent).json()
    agent.post(f"/api/v1/operations/{first['operation_id']}/submitted", json={})

    replay = record(agent)

    assert replay.status_code == 200
    assert replay.json()["operation_id"] == first["operation_id"]
    assert replay.json()["state"] == "submitted"  # the agent sees it must not send again
    assert Operation.objects.count() == 1


def test_same_key_with_another_intent_is_409_key_reused(make_key, client_for):
    agent = client_for(make_key("billing-bot"))
    first = record(agent).json()

    reused = record(agent, intent={"to": "grace@example.com"})

    body = assert_problem(reused, 409, detail_has="expected idempotency key 'invoice-42'")
    assert body["error"] == "IdempotencyKeyReused"
    assert body["operation"]["operation_id"] == first["operation_id"]
    assert Operation.objects.count() == 1


def test_stale_expected_version_is_409_and_changes_nothing(make_key, client_for):
    agent = client_for(make_key("billing-bot"))
    op = record(agent).json()
    url = f"/api/v1/operations/{op['operation_id']}"
    agent.post(f"{url}/submitted", json={"expected_version": 1})

    stale = agent.post(f"{url}/succeeded", json={"expected_version": 1})

    body = assert_problem(stale, 409, detail_has="at version 1")
    assert body["error"] == "StaleVersion"
    assert body["current_version"] == 2
    assert Operation.objects.get().state == "submitted"


def test_a_write_with_a_superseded_fencing_token_is_409(make_key, client_for):
    agent = client_for(make_key("billing-bot"))
    run = agent.post("/api/v1/runs", json={"objective": "invoices", "run_id": "run-1"})
    assert run.status_code == 200
    old = agent.post("/api/v1/runs/run-1/resume", json={"ttl_seconds": 300}).json()["token"]
    op = record(agent, run="run-1").json()
    assert op["run_id"] == "run-1"
    new = agent.post("/api/v1/runs/run-1/resume", json={}).json()["token"]
    assert new > old

    refused = agent.post(f"/api/v1/operations/{op['operation_id']}/submitted",
                         json={"fencing_token": old})

    body = assert_problem(refused, 409)
    assert body["error"] == "StaleFencingToken"
    assert Operation.objects.get().state == "planned"
    accepted = agent.post(f"/api/v1/operations/{op['operation_id']}/submitted",
                          json={"fencing_token": new})
    assert accepted.status_code == 200
    assert OperationEvent.objects.get(to_state="submitted").fencing_token == new
    assert leases.check_run(Operation.objects.get().run_id, new) is None


def test_a_write_without_a_token_to_a_leased_run_is_409(make_key, client_for):
    agent = client_for(make_key("billing-bot"))
    agent.post("/api/v1/runs", json={"objective": "invoices", "run_id": "run-1"})
    op = record(agent, run="run-1").json()
    token = agent.post("/api/v1/runs/run-1/resume", json={}).json()["token"]

    refused = agent.post(f"/api/v1/operations/{op['operation_id']}/submitted", json={})

    body = assert_problem(refused, 409, detail_has=f"current fencing token ({token})")
    assert body["error"] == "StaleFencingToken"
    assert Operation.objects.get().state == "planned"


def test_a_steps_operation_takes_the_key_derived_from_run_and_step(make_key, client_for):
    agent = client_for(make_key("billing-bot"))
    agent.post("/api/v1/runs", json={"objective": "invoices", "run_id": "run-1"})
    agent.post("/api/v1/runs/run-1/steps", json={"step_id": "charge"})
    body = {"operation": "payments.charge", "target": "https://pay.example",
            "intent": {"amount": 5}, "run": "run-1", "step": "charge"}

    first = agent.post("/api/v1/operations", json=body)
    again = agent.post("/api/v1/operations", json=body)
    second_call = agent.post("/api/v1/operations", json={**body, "call": "2"})

    assert (first.status_code, again.status_code, second_call.status_code) == (201, 200, 201)
    assert first.json()["idempotency_key"] == "run:run-1/step:charge"
    assert second_call.json()["idempotency_key"] == "run:run-1/step:charge/call:2"


def test_a_key_of_tenant_a_gets_404_for_tenant_b(make_key, client_for):
    acme = client_for(make_key("acme-bot", ["acme"]))
    globex = client_for(make_key("globex-bot", ["globex"]))
    op = record(globex).json()
    assert op["tenant"] == "globex"
    url = f"/api/v1/operations/{op['operation_id']}"

    missing = acme.get("/api/v1/operations/20260101T000000Z-0000000000")
    hidden = acme.get(url)

    assert_problem(hidden, 404)
    assert hidden.json()["detail"].replace(op["operation_id"], "X") == \
        missing.json()["detail"].replace("20260101T000000Z-0000000000", "X")
    assert_problem(acme.post(f"{url}/submitted", json={}), 404)
    assert acme.get("/api/v1/operations").json()["items"] == []
    assert_problem(record(acme, tenant="globex"), 403, detail_has="granted tenant 'globex'")
    assert Operation.objects.get().state == "planned"


def test_no_key_a_wrong_key_and_a_revoked_key_get_401(make_key, client_for, admin):
    secret = make_key("billing-bot")
    agent = client_for(secret)
    op = record(agent).json()
    url = f"/api/v1/operations/{op['operation_id']}"

    assert_problem(client_for(None).get(url), 401, detail_has="found none")
    assert_problem(client_for("alk_" + "x" * 43).get(url), 401)
    from ledger import agent_keys

    agent_keys.revoke("billing-bot", user=admin)
    revoked = agent.get(url)
    assert_problem(revoked, 401, detail_has="revoked")
    assert revoked.headers["www-authenticate"].startswith("Bearer")
    assert_problem(agent.post(f"{url}/submitted", json={}), 401)
    assert Operation.objects.get().state == "planned"


def test_a_viewers_session_cookie_does_not_open_the_api(make_key, client_for, api_server):
    agent = client_for(make_key("billing-bot"))
    op = record(agent).json()
    viewer = UserFactory(username="viewer", role="viewer")
    access.grant(viewer, "default")
    browser = client_for(None)
    login_page = browser.get("/accounts/login/")
    csrf = login_page.cookies["csrftoken"]
    logged_in = browser.post("/accounts/login/", data={
        "username": "viewer", "password": "correct horse battery staple",
        "csrfmiddlewaretoken": csrf}, headers={"Referer": f"{api_server}/accounts/login/"})
    assert logged_in.status_code == 302 and "sessionid" in browser.cookies
    assert browser.get("/").status_code == 200  # the session works on the desk

    assert_problem(browser.get(f"/api/v1/operations/{op['operation_id']}"), 401)
    assert_problem(browser.get("/api/v1/operations"), 401)
    # Not a redirect to the login page, and no CSRF refusal either: the key is what counts.
    assert_problem(browser.post("/api/v1/operations", json={}), 401)


def test_list_is_keyset_paged_newest_first_and_filtered(make_key, client_for):
    agent = client_for(make_key("billing-bot"))
    ids = [record(agent, idempotency_key=f"k{i}").json()["operation_id"] for i in range(5)]
    agent.post(f"/api/v1/operations/{ids[0]}/submitted", json={})

    seen, cursor = [], None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = agent.get("/api/v1/operations", params=params).json()
        seen += [op["operation_id"] for op in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(ids, reverse=True)
    planned = agent.get("/api/v1/operations", params={"state": "planned"}).json()["items"]
    assert {op["operation_id"] for op in planned} == set(ids[1:])
    assert_problem(agent.get("/api/v1/operations", params={"limit": 0}), 422)


def test_errors_are_problem_json_never_html(make_key, client_for):
    agent = client_for(make_key("billing-bot"))
    assert_problem(agent.get("/api/v1/no-such-route"), 404)
    assert_problem(agent.post("/api/v1/no-such-route", json={}), 404)  # not a CSRF 403
    assert_problem(agent.delete("/api/v1/operations"), 405)
    bad_json = agent.post("/api/v1/operations", content=b"{not json",
                          headers={"Content-Type": "application/json"})
    assert_problem(bad_json, 400)
    deep = agent.post("/api/v1/operations", content=b"[" * 100_000,
                      headers={"Content-Type": "application/json"})
    assert deep.status_code in (400, 422) and deep.headers["content-type"] == PROBLEM
    missing = assert_problem(agent.post("/api/v1/operations", json={"operation": "x"}), 422)
    assert "body.intent" in missing["detail"]
    assert_problem(record(agent, operation="not a name!"), 422,
                   detail_has="expected operation to be a name")
    assert_problem(agent.post("/api/v1/operations/nope/submitted",
                              json={"expected_version": "x"}), 422)


def test_requests_after_a_body_over_the_servers_read_buffer_are_served(make_key, client_for):
    # uvicorn stops reading a connection whose unread body passes 64 KiB and resumes when
    # the response is sent. Sent from a worker thread through async_to_sync (asgiref's
    # WsgiToAsgi, tried once), the resumed reader ran in a context holding a finished
    # CurrentThreadExecutor, and the connection's next request failed with a 500.
    agent = client_for(make_key("billing-bot"))
    for i in range(10):
        big = agent.post("/api/v1/operations", content=b'{"a": ' + b"[" * 100_000,
                         headers={"Content-Type": "application/json"})
        assert big.status_code == 400 and big.headers["content-type"] == PROBLEM
        padded = record(agent, idempotency_key=f"padded-{i}", intent={"pad": "x" * 80_000})
        assert padded.headers["content-type"] in (PROBLEM, "application/json; charset=utf-8")
        after = record(agent, idempotency_key=f"after-{i}")
        assert after.status_code == 201, after.text


def test_facts_obligations_and_runs(make_key, client_for):
    agent = client_for(make_key("crm-bot"))
    first = agent.post("/api/v1/facts", json={"subject": "customer:42", "predicate": "email",
                                               "value": "ada@example.com", "source": "crm"})
    assert first.status_code == 200
    assert first.json()["version"] == 1 and first.json()["source"] == "crm-bot/crm"
    conflict = agent.post("/api/v1/facts", json={"subject": "customer:42",
                                                  "predicate": "email", "value": "x@y"})
    assert conflict.json()["is_candidate"] is True and conflict.json()["conflict_id"]
    superseded = agent.post("/api/v1/facts", json={"subject": "customer:42",
                                                    "predicate": "email", "value": "a@b",
                                                    "expected_version": 1})
    assert superseded.json()["version"] == 2
    current = agent.get("/api/v1/facts", params={"subject": "customer:42"}).json()
    assert [(f["predicate"], f["value"], f["version"]) for f in current] == [
        ("email", "a@b", 2)]

    agent.post("/api/v1/runs", json={"objective": "refunds", "run_id": "run-r"})
    step = agent.post("/api/v1/runs/run-r/steps", json={"step_id": "refund"})
    assert step.json() == {"run_id": "run-r", "step_id": "refund", "state": "pending",
                           "depends_on": []}
    opened = agent.post("/api/v1/obligations", json={"run": "run-r", "kind": "refund",
                                                      "key": "refund-42"})
    assert opened.json()["state"] == "open"
    won = agent.post("/api/v1/obligations/refund-42/commit", json={"result": {"id": "r-1"}})
    assert won.status_code == 200 and won.json()["result"] == {"id": "r-1"}
    lost = agent.post("/api/v1/obligations/refund-42/commit", json={"result": {"id": "r-2"}})
    body = assert_problem(lost, 409)
    assert body["error"] == "AlreadyCommitted" and body["result"] == {"id": "r-1"}
    resumed = agent.post("/api/v1/runs/run-r/resume", json={}).json()
    assert resumed["holder"] == "crm-bot" and resumed["token"] >= 1
    assert [s["step_id"] for s in resumed["steps"]] == ["refund"]


def test_the_docs_page_loads_nothing_from_another_origin(api_server):
    page = httpx.get(f"{api_server}/api/v1/docs")
    assert page.status_code == 200
    assert "/static/ninja/swagger-ui-bundle.js" in page.text
    assert "cdn" not in page.text.lower() and "https://" not in page.text
    assert "http://" not in page.text
    schema = httpx.get(f"{api_server}/api/v1/openapi.json").json()
    assert "/api/v1/operations/{operation_id}/outcome-unknown" in schema["paths"]


def test_the_secret_is_never_stored(make_key):
    secret = make_key("billing-bot")
    row = AgentKey.objects.values().get()
    assert secret not in repr(row)


def test_in_flight_seconds_reaches_the_ledger_only_where_it_has_the_window(make_key, client_for):
    from api import service

    agent = client_for(make_key("billing-bot"))
    op = record(agent).json()
    answer = agent.post(f"/api/v1/operations/{op['operation_id']}/submitted",
                        json={"in_flight_seconds": 30})
    if service.HAS_IN_FLIGHT_WINDOW:
        assert answer.status_code == 200
        stored = Operation.objects.get()
        assert stored.in_flight_until - stored.submitted_at == timedelta(seconds=30)
        assert answer.json()["in_flight_until"] == stored.in_flight_until.isoformat()
    else:
        assert_problem(answer, 422, detail_has="no in-flight window")
        assert Operation.objects.get().state == "planned"


def test_a_nul_or_a_lone_surrogate_in_a_field_is_refused_as_a_problem_not_a_500(
        make_key, client_for):
    """A JSON escape can carry what PostgreSQL cannot store; the ledger's gate refuses it in
    a name or an intent (422 invalid-input, naming the field), and records free text."""
    agent = client_for(make_key("billing-bot"))

    def post(path, body):  # as JSON escapes (\u0000, \ud800), the way a client sends them
        return agent.post(path, content=json.dumps(body).encode("ascii"),
                          headers={"Content-Type": "application/json"})

    def record(client, **overrides):
        return post("/api/v1/operations", {
            "operation": "mail.send", "target": "smtp://mail.example", "intent": INTENT,
            "idempotency_key": "invoice-42", **overrides})

    assert_problem(record(agent, idempotency_key="invoice\u0000-42"), 422,
                   detail_has="idempotency_key")
    assert_problem(record(agent, tenant="default\u0000"), 422, detail_has="tenant")
    assert_problem(record(agent, intent={"items": [0, {"n": "a\ud800"}]}), 422,
                   detail_has="intent.items[1].n")
    assert_problem(agent.get("/api/v1/facts", params={"subject": "order\x001"}), 422,
                   detail_has="subject")
    assert_problem(agent.get("/api/v1/operations/x%00y"), 422, detail_has="operation_id")
    assert agent.get("/api/v1/operations").json()["items"] == []

    op = record(agent).json()
    agent.post(f"/api/v1/operations/{op['operation_id']}/submitted", json={})
    unknown = post(f"/api/v1/operations/{op['operation_id']}/outcome-unknown",
                   {"error_code": "ConnectionReset", "detail": "reset\u0000 \ud800"})
    assert unknown.status_code == 200, unknown.text
    assert unknown.json()["error_detail"] == "reset\ufffd \ufffd"


def test_a_submission_under_an_approval_policy_is_409_approval_required(make_key, client_for):
    from ledger import approvals

    admin = UserFactory(username="policy-admin", role="admin")
    approvals.set_policy("mail.*", user=admin)
    agent = client_for(make_key("billing-bot"))
    op = record(agent).json()
    refused = agent.post(f"/api/v1/operations/{op['operation_id']}/submitted", json={})
    body = assert_problem(refused, 409, detail_has="expected 1 live approval(s)")
    assert (body["error"], body["type"]) == ("ApprovalRequired",
                                             "urn:agent-ledger:problem:approval-required")
    assert (body["approvals_needed"], body["approvals_live"]) == (1, 0)
    assert Operation.objects.get().state == "planned"


def test_keep_stores_only_the_listed_fields_and_the_rest_never_reaches_the_database(
        make_key, client_for):
    agent = client_for(make_key("keep-bot"))
    created = record(agent, idempotency_key="keep-1", keep=["to", "subject"],
                     intent={**INTENT, "body": "UnkeptBodyQ9 for Ada"})
    assert created.status_code == 201, created.text
    assert created.json()["intent"] == {"to": "ada@example.com", "subject": "Invoice 42"}
    stored = Operation.objects.get(idempotency_key="keep-1")
    assert stored.intent == {"to": "ada@example.com", "subject": "Invoice 42"}
    assert "UnkeptBodyQ9" not in json.dumps(list(
        OperationEvent.objects.filter(operation=stored).values()), default=str)
    refused = record(agent, idempotency_key="keep-2", keep="to")
    assert_problem(refused, 422)


def test_relies_on_binds_the_operation_to_fact_versions_and_a_stale_one_refuses_the_send(
        make_key, client_for):
    agent = client_for(make_key("facts-bot"))
    fact = agent.post("/api/v1/facts", json={"subject": "order:5", "predicate": "status",
                                             "value": "paid"})
    assert fact.status_code in (200, 201), fact.text
    created = record(agent, idempotency_key="ship-5", relies_on=[
        {"subject": "order:5", "predicate": "status", "version": 1}])
    assert created.status_code == 201, created.text
    assert Operation.objects.get(idempotency_key="ship-5").relies_on == [
        Fact.objects.get(subject="order:5").pk]
    newer = agent.post("/api/v1/facts", json={"subject": "order:5", "predicate": "status",
                                              "value": "refunded", "expected_version": 1})
    assert newer.status_code in (200, 201), newer.text
    refused = agent.post(f"/api/v1/operations/{created.json()['operation_id']}/submitted",
                         json={})
    assert_problem(refused, 409, detail_has="order:5 status")
    missing = record(agent, idempotency_key="ship-6", relies_on=[
        {"subject": "order:5", "predicate": "status", "version": 9}])
    assert_problem(missing, 404)


def test_the_provider_account_is_recorded_returned_and_filtered(make_key, client_for):
    agent = client_for(make_key("account-bot"))
    ops = record(agent, account="ops@example.com")
    assert ops.status_code == 201, ops.text
    assert ops.json()["account"] == "ops@example.com"
    assert record(agent, account="ops@example.com").status_code == 200
    assert_problem(record(agent, account="sales@example.com"), 409,
                   detail_has="to come with account 'ops@example.com', found "
                              "'sales@example.com'")
    sales = record(agent, account="sales@example.com", idempotency_key="invoice-43")
    assert sales.status_code == 201
    plain = record(agent, idempotency_key="invoice-44")
    assert plain.json()["account"] == ""

    listed = agent.get("/api/v1/operations", params={"account": "sales@example.com"})
    assert [op["operation_id"] for op in listed.json()["items"]] == [
        sales.json()["operation_id"]]
    assert_problem(record(agent, account="x" * 201, idempotency_key="invoice-45"), 422)
    assert Operation.objects.filter(idempotency_key="invoice-45").count() == 0
