"""The agent door's model-returning functions, which the MCP gateway writes through
(`api.service.record`, `mark_operation`, `earlier_call`, `call_between`): the key is the
principal and its name the actor, another tenant's operation is not found, and the earlier
call is found by the fingerprint `record` gives the intent."""

import pytest

from api import service
from api.agent import Principal
from ledger import receipts
from ledger.errors import InFlight, InvalidInput, NotFound
from ledger.models import Operation

pytestmark = pytest.mark.django_db


def intent(n: int, caller: str = "door-bot") -> dict:
    return {"tool": "create_invoice", "arguments": {"n": n, "api_key": "sk-not-kept"},
            "mcp": {"gateway": "g", "caller": caller, "connection": f"stdio-{n}"}}


def test_a_call_is_recorded_and_settled_as_its_key(make_key):
    key = Principal(make_key("door-bot")).current()
    op = service.record(key, operation="invoices.create", target="mcp://g/create_invoice",
                        intent=intent(1), idempotency_key="k-1", submit=True,
                        fingerprint_fields=["tool", "arguments"], in_flight_seconds=30)
    assert op.recorded_now and op.submitted_now and op.state == "submitted"
    done = service.mark_operation(key, op, "succeeded", external_id="inv-1",
                                  result={"content": [], "id": "inv-1"})
    assert done.state == "succeeded" and done.result == {"content": [], "id": "inv-1"}
    assert [(e.to_state, e.actor_id) for e in done.events.order_by("version")] == [
        ("planned", "door-bot"), ("submitted", "door-bot"), ("succeeded", "door-bot")]


def test_another_tenants_operation_is_not_found_and_not_written(make_key):
    mine = Principal(make_key("acme-bot", tenants=["acme"])).current()
    other = Principal(make_key("globex-bot", tenants=["globex"])).current()
    op = service.record(mine, operation="invoices.create", target="mcp://g/create_invoice",
                        intent=intent(2), idempotency_key="k-2", submit=True)
    with pytest.raises(NotFound, match="among the tenants you may see"):
        service.mark_operation(other, op, "outcome_unknown", error_code="timeout")
    assert Operation.objects.get(pk=op.pk).state == "submitted"


def test_the_earlier_call_is_found_by_the_fingerprint_record_gives(make_key):
    key = Principal(make_key("door-bot")).current()
    fields = ["tool", "arguments"]
    first = service.record(key, operation="invoices.create", target="mcp://g/x",
                           intent=intent(3), idempotency_key="k-3", redact=["arguments.n"],
                           fingerprint_fields=fields)
    # Another session, the same arguments: the same fingerprint (the session is not in it).
    again = {**intent(3), "mcp": {**intent(3)["mcp"], "connection": "stdio-other"}}
    found = service.earlier_call(key, "default", "invoices.create", again,
                                 redact=["arguments.n"], fingerprint_fields=fields)
    assert found is not None and found.operation_id == first.operation_id
    assert service.earlier_call(key, "default", "invoices.create", intent(4),
                                fingerprint_fields=fields) is None
    assert service.call_between(key, "default", found, gateway="g") is None
    between = service.record(key, operation="invoices.create", target="mcp://g/x",
                             intent=intent(5), idempotency_key="k-5")
    assert service.call_between(key, "default", found, gateway="g").operation_id == \
        between.operation_id
    # Calls through another gateway are not its calls.
    assert service.call_between(key, "default", found, gateway="other") is None


@pytest.mark.parametrize("seconds", [8 * 24 * 3600, -1, float("nan"), True, "30"])
def test_an_in_flight_window_the_door_does_not_take_is_refused_before_anything_is_written(
        make_key, seconds):
    key = Principal(make_key("door-bot")).current()
    with pytest.raises(InvalidInput, match="expected in_flight_seconds to be a number of "
                                           "seconds from 0 to 604800, found"):
        service.record(key, operation="invoices.create", target="mcp://g/create_invoice",
                       intent=intent(4), idempotency_key="k-4", submit=True,
                       in_flight_seconds=seconds)
    assert not Operation.objects.filter(idempotency_key="k-4").exists()


def test_a_key_in_flight_is_refused_in_the_same_words_by_the_door_and_the_agent_kit(make_key):
    """One sentence for "another caller is sending this key": an agent over the network and
    a decorated action in process finding the same submitted operation read the same."""
    key = Principal(make_key("door-bot")).current()
    call = {"operation": "invoices.create", "target": "https://billing.example/invoices",
            "intent": {"invoice": {"n": 7}}, "idempotency_key": "k-7"}
    sent, _ = service.record_intent(key, submit=True, **call)
    assert sent["submitted_now"] and sent["state"] == "submitted"

    @receipts.action("invoices.create", target="https://billing.example/invoices",
                     key=lambda invoice: "k-7")
    def create(invoice):
        raise AssertionError(f"expected no call while the key is in flight, found {invoice}")

    with pytest.raises(InFlight) as in_process:
        create({"n": 7})
    with pytest.raises(InFlight) as over_the_network:
        service.record_intent(key, submit=True, **call)
    op = Operation.objects.get(idempotency_key="k-7")
    assert str(in_process.value) == str(over_the_network.value) == (
        f"expected operation {op.operation_id} (invoices.create, key k-7) planned or "
        f"safe_to_retry to send it, found it submitted since {op.submitted_at.isoformat()}: "
        "another caller is sending it now (or stopped before reporting; the sweep then hands "
        "it to reconciliation); it is not sent again, ask again in 1 s for its outcome")
    assert in_process.value.retry_after == over_the_network.value.retry_after == 1.0
    assert in_process.value.operation.pk == over_the_network.value.operation.pk == op.pk
    assert over_the_network.value.operation_recorded["operation_id"] == str(op.operation_id)
