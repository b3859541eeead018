"""The ledger's JSON shapes (`ledger.shapes`) held to their models and the OpenAPI document.

Every shape function's output, for real rows written through the ledger, has exactly the
properties of its component in /api/v1/openapi.json and validates against it; each
component is its pydantic model's schema (the document is generated from the shapes);
and the endpoints answer with those components. Each function is derived from its model:
its keys are the model's fields, in order, and for rows in every state it answers byte for
byte what the hand-written functions it replaced answered.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import get_args

import jsonschema
import pytest
from django.test import Client
from django.utils import timezone
from pydantic import BaseModel

from ledger import (
    agent_keys,
    approvals,
    facts,
    obligations,
    receipts,
    runs,
    selectors,
    shapes,
)
from ledger.models import ApprovalRequest, Evidence, Operation, OperationEvent
from tests.api import shapes_by_hand as _ByHand
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


# --- each function derived from its model ------------------------------------------------


def _every_state() -> dict:
    """Rows in every state a shape tells apart: operations planned (no run, and under an
    approval policy, asked for, denied), submitted with an in-flight window, succeeded with
    a result and an external id, succeeded with an unstorable result, failed, in doubt with
    evidence, relying on a fact since superseded; facts current, candidate (with its
    conflict), expiring, expired, without a run; obligations open with and without a
    deadline and committed with a result; steps pending and committed; the hand-off view
    with and without a lease."""
    admin = UserFactory(username="shapes-admin", role="admin")
    approvals.set_policy("payments.*", user=admin, approvals_needed=2)
    run = runs.start("Settle the invoices", run_id="run-states")
    runs.add_step(run, "prepare")
    runs.add_step(run, "pay", depends_on=["prepare"])
    runs.add_step(run, "notify", depends_on=["prepare", "pay"])
    view = runs.resume(run, worker="worker-1")
    token = view.token
    runs.commit_step(run, "prepare", fencing_token=token)

    address = facts.assert_fact("customer:7", "address", "1 Old Road", source="crm", run=run,
                                fencing_token=token)
    plan = facts.assert_fact("customer:7", "plan", "gold", source="crm", run=run,
                             fencing_token=token, ttl=timedelta(hours=1))
    short = facts.assert_fact("customer:7", "trial", True, source="crm", run=run,
                              fencing_token=token, ttl=timedelta(milliseconds=50))
    no_run = facts.assert_fact("customer:7", "email", "c7@x.example", source="crm")
    candidate = facts.assert_fact("customer:7", "plan", "silver", source="billing", run=run,
                                  fencing_token=token)

    def record(name, n, **kwargs):
        if "idempotency_key" not in kwargs:
            kwargs.update(run=run, step="pay", call=f"call-{n}")
        return receipts.record_intent(name, "https://psp.example/v1", {"n": n, "at": "x"},
                                      **kwargs)

    planned = record("payments.refund", 1)
    asked = approvals.request(record("payments.refund", 2), note="customer waiting")
    denied = approvals.deny(record("payments.refund", 3), user=admin, reason="not this one")
    loose = record("mail.send", 4, idempotency_key="loose-4")
    in_flight = record("mail.send", 5)
    receipts.mark_submitted(in_flight, fencing_token=token, in_flight_for=timedelta(minutes=5))
    paid = record("mail.send", 6)
    receipts.mark_submitted(paid, fencing_token=token)
    receipts.mark_succeeded(paid, external_id="msg-6", result={"id": "msg-6", "n": [1, None]},
                            evidence={"smtp": 250}, fencing_token=token)
    unstorable = record("mail.send", 7)
    receipts.mark_submitted(unstorable, fencing_token=token)
    receipts.mark_succeeded(unstorable, result_unstorable="too large", fencing_token=token)
    failed = record("mail.send", 8)
    receipts.mark_submitted(failed, fencing_token=token)
    receipts.mark_rejected(failed, error_code="HTTP 422", detail="bad address",
                           fencing_token=token)
    doubt = record("mail.send", 9)
    receipts.mark_submitted(doubt, fencing_token=token)
    receipts.mark_outcome_unknown(doubt, error_code="TimeoutError", fencing_token=token)
    add_evidence(doubt, verdict="not_yet", observed={"listing": []})
    stale = record("parcels.ship", 10, relies_on=[address])
    record("parcels.ship", 11, relies_on=[plan])
    facts.assert_fact("customer:7", "address", "2 New Road", source="crm", run=run,
                      expected_version=1, fencing_token=token)

    pending = obligations.open(run, "email", "email-7", fencing_token=token,
                               deadline=timezone.now() + timedelta(hours=1))
    obligations.open(run, "invoice", "invoice-7", fencing_token=token)
    committed = obligations.commit("invoice-7", {"sent": True, "pages": 2},
                                   fencing_token=token)
    time.sleep(0.1)  # `short` has expired

    operations = list(Operation.objects.select_related("run", "step").filter(
        pk__in=[o.pk for o in (planned, asked, denied, loose, in_flight, paid, unstorable,
                               failed, doubt, stale)]).order_by("pk"))
    events = list(OperationEvent.objects.select_related("operation")
                  .filter(operation__in=operations).order_by("operation", "version"))
    assert {o.state for o in operations} >= {"planned", "submitted", "succeeded", "rejected",
                                             "outcome_unknown", "abandoned"}
    return {
        "run": run, "admin": admin,
        "operations": operations,
        "statuses": [selectors.approval_status(o) for o in operations],
        "events": events,
        "evidence": list(Evidence.objects.filter(operation__in=operations)),
        "facts": [address, plan, short, no_run, candidate],
        "steps": list(run.steps.prefetch_related("depends_on").order_by("step_id")),
        "obligations": [pending, committed],
        "views": [runs.resume(run, worker="worker-1"), runs.hand_off(run),
                  runs.hand_off(runs.start("Nothing yet", run_id="run-empty"))],
    }


def _calls(rows: dict, shaped) -> list[tuple[str, object]]:
    """Every shape function of `shaped` (the module, or the functions by hand) called on
    every row it takes: (what was called, its output)."""
    ops, run = rows["operations"], rows["run"]
    calls = []
    for op, status in zip(ops, rows["statuses"], strict=True):
        op_events = [e for e in rows["events"] if e.operation_id == op.pk]
        op_evidence = [e for e in rows["evidence"] if e.operation_id == op.pk]
        calls += [
            (f"operation {op.state}", shaped.operation(op)),
            (f"recorded {op.state}", shaped.recorded(op, submitted_now=op.state == "submitted")),
            (f"recorded repeat {op.state}", shaped.recorded(op, submitted_now=True,
                                                            request_repeated=True)),
            (f"approval {op.state}", shaped.approval(status)),
            (f"operation_detail {op.state}", shaped.operation_detail(
                op, events=op_events, evidence_rows=op_evidence, approval_status=status)),
            (f"hand_off_operation {op.state}", shaped.hand_off_operation(op)),
        ]
    calls += [("operation_page", shaped.operation_page(ops, ops[-1].operation_id)),
              ("operation_page last", shaped.operation_page([], ""))]
    calls += [(f"event {e.to_state}", shaped.event(e)) for e in rows["events"]]
    calls += [(f"audit_event {e.to_state}", shaped.audit_event(e)) for e in rows["events"]]
    calls += [("evidence", shaped.evidence(e)) for e in rows["evidence"]]
    for f in rows["facts"]:
        calls += [(f"fact {f.status}", shaped.fact(f)), (f"hand_off_fact {f.status}",
                                                          shaped.hand_off_fact(f))]
    calls += [("run", shaped.run(run))]
    for s in rows["steps"]:
        calls += [(f"step {s.step_id}", shaped.step(s, run=run, depends_on=["z", "a"])),
                  (f"hand_off_step {s.step_id}", shaped.hand_off_step(s))]
    for o in rows["obligations"]:
        calls += [(f"obligation {o.state}", shaped.obligation(o)),
                  (f"obligation run {o.state}", shaped.obligation(o, run=run)),
                  (f"hand_off_obligation {o.state}", shaped.hand_off_obligation(o))]
    calls += [(f"hand_off {v.run.run_id} {v.token}", shaped.hand_off(v)) for v in rows["views"]]
    return calls


def test_each_function_answers_byte_for_byte_what_the_hand_written_one_did():
    rows = _every_state()
    derived, by_hand = _calls(rows, shapes), _calls(rows, _ByHand)
    view = rows["views"][0]
    assert all(view.as_dict()[name] for name in (
        "steps", "open_operations", "pending_obligations", "facts", "open_conflicts",
        "blocked_by_stale_facts")), view.as_dict()
    assert any(o["approval"] for o in view.as_dict()["open_operations"])
    assert any(o["relied_on"] for o in view.as_dict()["open_operations"])

    for (what, new), (_, old) in zip(derived, by_hand, strict=True):
        assert json.dumps(new) == json.dumps(old), what


def test_each_function_answers_exactly_its_models_fields_in_order():
    rows = _every_state()
    models = {"operation": shapes.OperationOut, "recorded": shapes.RecordedOut,
              "approval": shapes.ApprovalOut, "operation_detail": shapes.OperationDetailOut,
              "hand_off_operation": shapes.HandOffOperation,
              "operation_page": shapes.OperationPage, "event": shapes.EventOut,
              "audit_event": shapes.AuditEventOut, "evidence": shapes.EvidenceOut,
              "fact": shapes.FactOut, "hand_off_fact": shapes.HandOffFact, "run": shapes.RunOut,
              "step": shapes.StepOut, "hand_off_step": shapes.HandOffStep,
              "obligation": shapes.ObligationOut, "hand_off_obligation": shapes.HandOffObligation,
              "hand_off": shapes.ResumeOut}

    def held(data, model):
        """`data` has the model's fields as its keys, in order, and so has each nested
        shape (a model, a list of models, or a model or None)."""
        assert list(data) == list(model.model_fields), (model.__name__, list(data))
        for name, field in model.model_fields.items():
            for inner in (field.annotation, *get_args(field.annotation)):
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    value = data[name]
                    for item in value if isinstance(value, list) else [value]:
                        if item is not None:
                            held(item, inner)

    calls = _calls(rows, shapes)
    for what, data in calls:
        held(data, models[what.split()[0]])
    # Every model is some function's, or nested in one's (checked through it above).
    checked = set(models.values()) | {shapes.OperationApprovalOut, shapes.NextMove,
                                      shapes.HandOffApproval, shapes.HandOffReliedFact,
                                      shapes.HandOffConflict}
    assert checked == {v for v in vars(shapes).values() if isinstance(v, type)
                       and issubclass(v, BaseModel) and v is not BaseModel}
    op, status = rows["operations"][0], rows["statuses"][0]
    held(shapes.operation_approval(op, approval_status=status), shapes.OperationApprovalOut)
    assert shapes.operation_approval(op, approval_status=status) == {
        **shapes.operation(op), "approval": shapes.approval(status)}


def test_a_receipt_read_in_one_statement_holds_what_the_orm_and_the_gate_read():
    # `operation_receipt` reads the approval status, events and evidence in one UNION;
    # each value must come back as the ORM decodes it (repr: type, time zone, JSON).
    rows = _every_state()
    root = UserFactory(username="receipt-root", tenants=[])
    root.is_superuser = True
    doubt = next(o for o in rows["operations"] if o.state == "outcome_unknown")
    add_evidence(doubt, verdict="absent", observed={"at": None, "n": [1.5, "x"]},
                 query={"q": "é"}, detail="")
    add_evidence(doubt, verdict="not_yet", observed={}, matched_by="external_id")

    def values(instances) -> list[list[tuple[str, str]]]:
        return [[(f.attname, repr(getattr(i, f.attname))) for f in i._meta.concrete_fields]
                for i in instances]

    for op in rows["operations"]:
        found = selectors.operation_receipt(root, op.operation_id)
        events = OperationEvent.objects.filter(operation=op).order_by("version")
        evidence = Evidence.objects.filter(operation=op).order_by("created_at", "id")
        assert values(found.events) == values(events), op.state
        assert values(found.evidence) == values(evidence), op.state
        gate = approvals.gate(op)
        request = ApprovalRequest.objects.filter(operation=op).first()
        assert repr(found.approval) == repr(selectors.ApprovalStatus(
            status=found.approval.status, needed=gate.needed, live=gate.have,
            policies=gate.patterns, denied_reason=gate.denial,
            intent_fingerprint=gate.intent_fingerprint, requested=request is not None,
            note=request.note if request else "",
            requested_at=request.requested_at if request else None)), op.state
        assert found.approval == selectors.approval_status(op), op.state
    assert len(Evidence.objects.filter(operation=doubt)) == 3
    assert {selectors.approval_status(o).status for o in rows["operations"]} == {
        "not_required", "awaiting", "denied"}
    assert any(selectors.approval_status(o).requested for o in rows["operations"])


def test_a_source_for_a_field_the_model_lacks_is_refused_when_the_shape_is_derived():
    with pytest.raises(TypeError, match=r"expected sources for fields of RunOut, found "
                       r"\['run'\] \(its fields: run_id, tenant, objective\)"):
        shapes._shape(shapes.RunOut, run="run.run_id")
    with pytest.raises(TypeError, match="expected a dotted attribute path for RunOut.tenant"):
        shapes._shape(shapes.RunOut, tenant="run[0]")

    class Wrapper(BaseModel):
        inner: shapes.NextMove

    with pytest.raises(TypeError, match="expected the shape of .*NextMove.* derived before"):
        shapes._shape(Wrapper)

    def declared(run, *, objective, note=""):
        """A keyword that names no field of the model."""

    with pytest.raises(TypeError, match=r"expected sources for fields of RunOut, found "
                       r"\['note'\]"):
        shapes._shaped(shapes.RunOut)(declared)

    def two_rows(run, other):
        """Two rows."""

    with pytest.raises(TypeError, match=r"expected two_rows to take its row and keyword-only "
                       r"fields, found \(run, other\)"):
        shapes._shaped(shapes.RunOut)(two_rows)


def test_a_declared_shape_keeps_its_name_signature_and_docstring_and_reads_its_row():
    import inspect

    assert shapes.recorded.__name__ == "recorded"
    assert str(inspect.signature(shapes.recorded)) == (
        "(op: 'Operation', *, submitted_now: 'bool', request_repeated: 'bool' = False) "
        "-> 'dict[str, Any]'")
    assert shapes.recorded.__doc__.startswith("An operation as a request that recorded")
    assert shapes.recorded.code.startswith(
        "def recorded(op, *, submitted_now, request_repeated):\n    return {\n"
        "        'operation_id': op.operation_id,\n")
    assert "'run_id': _get_run_id(op)," in shapes.recorded.code
    assert "'created_at': iso(op.created_at)," in shapes.recorded.code
