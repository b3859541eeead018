"""The ledger's JSON shapes (`ledger.shapes`) held to the OpenAPI document.

Every shape function's output, for real rows written through the ledger, has exactly the
properties of its component in /api/v1/openapi.json and validates against it; each
component is its pydantic model's schema (the document is generated from the shapes);
and the endpoints answer with those components.
"""

from __future__ import annotations

import json
from datetime import timedelta

import jsonschema
import pytest
from django.test import Client
from django.utils import timezone

from ledger import agent_keys, facts, obligations, receipts, runs, selectors, shapes
from ledger.models import Evidence, OperationEvent
from tests.factories import UserFactory, add_evidence

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def openapi() -> dict:
    """The document as /api/v1/openapi.json serves it."""
    from api.http import api

    return json.loads(json.dumps(api.get_openapi_schema()))


def _hold(openapi: dict, component: str, data: dict) -> None:
    """`data` has exactly the properties of `component` and validates against it."""
    schema = openapi["components"]["schemas"][component]
    assert set(data) == set(schema["properties"]), component
    jsonschema.validate(
        data, {"$ref": f"#/components/schemas/{component}", "components": openapi["components"]}
    )


@pytest.fixture
def records():
    """A run with a step, an operation in it (with evidence), an obligation, a fact and a
    fact conflict; the run's hand-off view."""
    run = runs.start("Publish the quarterly report", run_id="run-shapes")
    runs.add_step(run, "draft")
    runs.add_step(run, "publish", depends_on=["draft"])
    view = runs.resume(run, worker="worker-1")
    op = receipts.record_intent("articles.create", "https://cms.example/api", {"title": "Q3"},
                                run=run, step="draft")
    receipts.mark_submitted(op, fencing_token=view.token)
    receipts.mark_outcome_unknown(op, error_code="TimeoutError", fencing_token=view.token)
    add_evidence(op, verdict="not_yet", observed={"listing": []})
    obligation = obligations.open(run, "email", "email-q3",
                                  deadline=timezone.now() + timedelta(hours=1),
                                  fencing_token=view.token)
    fact = facts.assert_fact("report:q3", "status", "draft", source="worker-1", run=run,
                             fencing_token=view.token)
    candidate = facts.assert_fact("report:q3", "status", "final", source="worker-1",
                                  run=run, fencing_token=view.token)
    return {"run": run, "op": op, "obligation": obligation, "fact": fact,
            "candidate": candidate, "view": runs.resume(run, worker="worker-1")}


def test_every_shape_has_exactly_its_components_properties_and_validates(openapi, records):
    op, run = records["op"], records["run"]
    op.refresh_from_db()
    status = selectors.approval_status(op)
    events = list(OperationEvent.objects.filter(operation=op).order_by("version"))
    evidence_rows = list(Evidence.objects.filter(operation=op))
    committed = obligations.commit("email-q3", {"sent": True},
                                   fencing_token=records["view"].token)
    step = run.steps.get(step_id="publish")
    assert events and evidence_rows and records["candidate"].is_candidate

    _hold(openapi, "OperationOut", shapes.operation(op))
    _hold(openapi, "RecordedOut", shapes.recorded(op, submitted_now=False))
    for row in events:
        _hold(openapi, "EventOut", shapes.event(row))
    _hold(openapi, "EvidenceOut", shapes.evidence(evidence_rows[0]))
    _hold(openapi, "ApprovalOut", shapes.approval(status))
    _hold(openapi, "OperationDetailOut", shapes.operation_detail(
        op, events=events, evidence_rows=evidence_rows, approval_status=status))
    _hold(openapi, "OperationPage", shapes.operation_page([op], op.operation_id))
    _hold(openapi, "OperationPage", shapes.operation_page([], ""))
    _hold(openapi, "FactOut", shapes.fact(records["fact"]))
    _hold(openapi, "FactOut", shapes.fact(records["candidate"]))
    _hold(openapi, "RunOut", shapes.run(run))
    _hold(openapi, "StepOut", shapes.step(step, run=run, depends_on=["draft"]))
    _hold(openapi, "ObligationOut", shapes.obligation(records["obligation"]))
    _hold(openapi, "ObligationOut", shapes.obligation(committed, run=run))
    view = shapes.hand_off(records["view"])
    _hold(openapi, "ResumeOut", view)
    # Every list of the hand-off view holds rows, so each nested shape was checked too.
    assert all(view[name] for name in ("steps", "open_operations", "pending_obligations",
                                       "facts", "open_conflicts")), view
    assert records["view"].as_dict() == view


@pytest.mark.parametrize("model", [
    shapes.OperationOut, shapes.EventOut, shapes.EvidenceOut, shapes.ApprovalOut,
    shapes.OperationApprovalOut, shapes.OperationDetailOut, shapes.OperationPage,
    shapes.FactOut, shapes.RunOut, shapes.StepOut, shapes.ObligationOut, shapes.ResumeOut,
    shapes.HandOffStep, shapes.HandOffOperation, shapes.HandOffObligation,
    shapes.HandOffFact, shapes.HandOffConflict, shapes.RecordedOut, shapes.NextMove,
    shapes.HandOffApproval,
])
def test_each_component_of_the_document_is_generated_from_its_shape(openapi, model):
    component = openapi["components"]["schemas"][model.__name__]
    generated = model.model_json_schema(ref_template="#/components/schemas/{model}")
    generated.pop("$defs", None)
    # The document leaves out a response field's default of None (a response carries each).
    for field in generated["properties"].values():
        if "default" in field and field["default"] is None:
            del field["default"]
    assert component == generated


@pytest.mark.parametrize(("method", "path", "component"), [
    ("post", "/api/v1/operations", "RecordedOut"),
    ("post", "/api/v1/operations/{operation_id}/submitted", "OperationOut"),
    ("post", "/api/v1/operations/{operation_id}/approval-request", "OperationApprovalOut"),
    ("get", "/api/v1/operations/{operation_id}", "OperationDetailOut"),
    ("get", "/api/v1/operations", "OperationPage"),
    ("post", "/api/v1/facts", "FactOut"),
    ("post", "/api/v1/runs", "RunOut"),
    ("post", "/api/v1/runs/{run_id}/steps", "StepOut"),
    ("post", "/api/v1/runs/{run_id}/resume", "ResumeOut"),
    ("post", "/api/v1/obligations", "ObligationOut"),
    ("post", "/api/v1/obligations/{key}/commit", "ObligationOut"),
])
def test_the_endpoints_answer_with_the_shapes(openapi, method, path, component):
    content = openapi["paths"][path][method]["responses"]["200"]["content"]
    assert content["application/json"]["schema"] == {"$ref": f"#/components/schemas/{component}"}


def test_the_api_answers_with_the_shapes_functions_output(openapi, records):
    root = UserFactory(username="shapes-root", tenants=[])
    root.is_superuser = True
    _, secret = agent_keys.create("shapes-bot", tenants=["default"], user=root)
    op = records["op"]
    found = selectors.operation_receipt(root, op.operation_id)
    expected = shapes.operation_detail(found.operation, events=found.events,
                                       evidence_rows=found.evidence,
                                       approval_status=found.approval)

    response = Client(HTTP_AUTHORIZATION=f"Bearer {secret}").get(
        f"/api/v1/operations/{op.operation_id}")

    assert response.status_code == 200, response.content
    assert response.json() == expected
    _hold(openapi, "OperationDetailOut", response.json())


def test_the_audit_export_row_is_its_shape_with_the_csv_columns_in_order(records):
    event = (OperationEvent.objects.select_related("operation")
             .filter(operation=records["op"]).order_by("version").last())
    row = shapes.audit_event(event)

    assert tuple(row) == shapes.AUDIT_COLUMNS == tuple(shapes.AuditEventOut.model_fields)
    assert shapes.AuditEventOut.model_validate(row).model_dump() == row
    assert row["operation_id"] == records["op"].operation_id
    assert row["to_state"] == "outcome_unknown"
