"""A check before sending: an operation kind's rules and validators run before the receipt
is submitted; a refusal is recorded (abandoned, validation_refused, the reason) and
nothing is sent."""

from __future__ import annotations

import os

import httpx
import pytest

from api import problems, service
from ledger import agent_keys, receipts, validation
from ledger.errors import InvalidInput, Rejected, ValidationRefused
from ledger.models import Operation, OperationEvent
from ledger.states import State
from tests.factories import UserFactory
from tests.support.servers import LedgerServer

REFUNDS = {"required": ["amount", "currency"], "ranges": {"amount": {"min": 1, "max": 500}},
           "one_of": {"currency": ["EUR", "USD"]},
           "targets": ["https://api.stripe.example/*"], "accounts": ["acct_*"]}
TARGET = "https://api.stripe.example/v1/refunds"


@pytest.fixture
def refund_rules(settings):
    settings.LEDGER_OPERATION_RULES = {"payments.*": REFUNDS}


class Calls:
    def __init__(self):
        self.count = 0

    def __call__(self, **intent):
        self.count += 1
        return {"id": f"re_{self.count}"}


def refund_action(send):
    return receipts.action("payments.refund", target=TARGET, account="acct_1",
                           key=lambda **intent: intent["charge"],
                           external_id=lambda result: result["id"])(send)


def events(op) -> list[tuple[str, str, str]]:
    return list(OperationEvent.objects.filter(operation=op).order_by("version")
                .values_list("from_state", "to_state", "reason"))


@pytest.mark.django_db
@pytest.mark.parametrize(("intent", "why"), [
    ({"charge": "ch_1", "currency": "EUR"}, "expected amount in the intent, found none"),
    ({"charge": "ch_2", "amount": 9000, "currency": "EUR"},
     "expected amount to be a number from 1 to 500, found 9000"),
    ({"charge": "ch_3", "amount": "12", "currency": "EUR"},
     "expected amount to be a number from 1 to 500, found '12'"),
    ({"charge": "ch_4", "amount": 12, "currency": "GBP"},
     "expected currency to be one of ['EUR', 'USD'], found 'GBP'"),
])
def test_a_refused_intent_is_recorded_abandoned_with_the_reason_and_never_sent(
        refund_rules, intent, why):
    send = Calls()
    refund = refund_action(send)
    with pytest.raises(ValidationRefused) as refused:
        refund(**intent)
    assert send.count == 0
    op = Operation.objects.get(idempotency_key=intent["charge"])
    assert (op.state, op.error_code, op.submitted_at) == (
        State.ABANDONED, "validation_refused", None)
    assert op.error_detail == f"{why} (rules of payments.*)"
    assert refused.value.reason == op.error_detail
    assert refused.value.operation.pk == op.pk
    assert events(op) == [("", State.PLANNED, "intent recorded"),
                          (State.PLANNED, State.ABANDONED,
                           f"refused before sending by the validator: {op.error_detail}")]
    # The same call again is not sent either: the key is settled.
    with pytest.raises(Rejected, match="found it abandoned with code validation_refused"):
        refund(**intent)
    assert send.count == 0


@pytest.mark.django_db
def test_an_intent_within_the_rules_is_sent_and_a_wrong_target_or_account_is_not(
        refund_rules):
    send = Calls()
    assert refund_action(send)(charge="ch_ok", amount=12, currency="EUR") == {"id": "re_1"}
    assert Operation.objects.get(idempotency_key="ch_ok").state == State.SUCCEEDED

    elsewhere = receipts.record_intent("payments.refund", "https://evil.example/refunds",
                                       {"amount": 5, "currency": "EUR"}, account="acct_1")
    with pytest.raises(ValidationRefused, match="expected the target to match one of"):
        receipts.mark_submitted(elsewhere)
    nobody = receipts.record_intent("payments.refund", TARGET,
                                    {"amount": 5, "currency": "EUR"}, account="")
    with pytest.raises(ValidationRefused, match="expected the provider account to match"):
        with receipts.submit(nobody):
            pytest.fail("the body of a refused submission never runs")
    assert {op.state for op in (Operation.objects.get(pk=elsewhere.pk),
                                Operation.objects.get(pk=nobody.pk))} == {State.ABANDONED}
    assert send.count == 1


@pytest.mark.django_db
def test_a_field_kept_out_of_the_receipt_cannot_satisfy_a_rule(refund_rules):
    op = receipts.record_intent("payments.refund", TARGET,
                                {"amount": 5, "currency": "EUR", "api_key": "sk_live_x"},
                                account="acct_1", keep=["amount"])
    with pytest.raises(ValidationRefused, match="expected currency in the intent, found none"):
        receipts.mark_submitted(op)


@pytest.mark.django_db
def test_a_validator_function_refuses_by_reason_by_refused_or_by_failing():
    seen = []

    @validation.validator("mail.*")
    def no_all_staff(op):
        seen.append(op.operation_id)
        if op.intent.get("to") == "all-staff@example.com":
            return "a message to every employee needs a person"
        if op.intent.get("to") == "boom":
            raise RuntimeError("the directory is down")
        if op.intent.get("to") == "":
            raise validation.Refused("no recipient")
        return None

    try:
        fine = receipts.record_intent("mail.send", "smtp://mail.example", {"to": "ada"})
        assert receipts.mark_submitted(fine).state == State.SUBMITTED
        for to, why in (("all-staff@example.com", "a message to every employee needs a person"),
                        ("boom", "the validator raised RuntimeError: the directory is down"),
                        ("", "no recipient")):
            op = receipts.record_intent("mail.send", "smtp://mail.example", {"to": to})
            with pytest.raises(ValidationRefused) as refused:
                receipts.mark_submitted(op)
            assert refused.value.reason.startswith(why), refused.value.reason
            assert "no_all_staff" in refused.value.reason
            op.refresh_from_db()
            assert (op.state, op.error_code) == (State.ABANDONED, "validation_refused")
        assert len(seen) == 4
        other = receipts.record_intent("articles.create", "https://cms.example", {"to": ""})
        assert receipts.mark_submitted(other).state == State.SUBMITTED
        assert len(seen) == 4  # only its kind's operations
    finally:
        validation.forget("mail.*")


def test_malformed_rules_are_refused_where_they_are_declared(settings):
    for rules in ({"required": "amount"}, {"ranges": {"amount": {"min": "1"}}},
                  {"ranges": {"amount": {}}}, {"one_of": {"currency": []}},
                  {"maximum": 3}, ["amount"]):
        with pytest.raises(InvalidInput):
            validation.set_rules("payments.*", rules)
    from ledger import conf

    for rules in ({"required": "amount"}, {"ranges": {"amount": {"low": 1}}}):
        settings.LEDGER_OPERATION_RULES = {"payments.*": rules}
        assert conf.check_settings() == []  # its shape is right: a mapping of rule lists
        [error] = validation.check_rule_setting()
        assert error.id == "ledger.E001"
        assert "LEDGER_OPERATION_RULES['payments.*']" in error.msg


@pytest.mark.django_db
def test_the_api_s_submission_is_refused_as_a_problem_with_the_recorded_operation(
        refund_rules, admin_user):
    admin_user.is_superuser = True
    admin_user.save()
    agent_keys.create("refund-bot", tenants=["default"], user=admin_user)
    from ledger.models import AgentKey

    key = AgentKey.objects.get(name="refund-bot")
    with pytest.raises(ValidationRefused) as refused:
        service.record_intent(key, operation="payments.refund", target=TARGET,
                              account="acct_1", intent={"amount": 9000, "currency": "EUR"},
                              idempotency_key="api-1", submit=True)
    body = problems.from_ledger_error(refused.value)
    assert (body["status"], body["type"]) == (409, "urn:agent-ledger:problem:validation-refused")
    assert body["operation"]["state"] == State.ABANDONED
    assert body["reason"].startswith("expected amount to be a number from 1 to 500")
    assert "nothing was sent" in body["detail"]


@pytest.mark.django_db(transaction=True)
def test_rules_from_the_environment_refuse_over_http(monkeypatch, tmp_path):
    import json

    from django.db import connection

    admin = UserFactory(username="rules-admin", role="admin", tenants=[])
    admin.is_superuser = True
    admin.save(update_fields=["is_superuser"])
    secret = agent_keys.create("http-refund-bot", tenants=["default"], user=admin)[1]
    monkeypatch.setitem(os.environ, "LEDGER_OPERATION_RULES", json.dumps({"payments.*": REFUNDS}))
    server = LedgerServer(connection.settings_dict["NAME"], tmp_path / "server.log")
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=30,
                          headers={"Authorization": f"Bearer {secret}"}) as client:
            refused = client.post("/api/v1/operations", json={
                "operation": "payments.refund", "target": TARGET, "account": "acct_1",
                "intent": {"amount": 0, "currency": "EUR"}, "idempotency_key": "http-1",
                "submit": True})
            sent = client.post("/api/v1/operations", json={
                "operation": "payments.refund", "target": TARGET, "account": "acct_1",
                "intent": {"amount": 10, "currency": "EUR"}, "idempotency_key": "http-2",
                "submit": True})
    finally:
        server.stop()
    assert refused.status_code == 409, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    body = refused.json()
    assert body["type"] == "urn:agent-ledger:problem:validation-refused"
    assert body["operation"]["state"] == "abandoned"
    assert body["operation"]["error_code"] == "validation_refused"
    assert sent.status_code == 201 and sent.json()["submitted_now"] is True
