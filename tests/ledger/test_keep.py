"""`keep=`: only the listed fields of an intent are stored and fingerprinted; the rest never
reach the database (DESIGN "A receipt you can prove")."""

import pytest

from ledger import receipts
from ledger.errors import IdempotencyKeyReused, InvalidInput
from ledger.models import Operation, OperationEvent
from tests.ledger.test_secrets import stored_text

pytestmark = pytest.mark.django_db

PAYMENT = {"amount": 1200, "currency": "EUR",
           "customer": {"id": "cus_7", "name": "Ada Lovelace", "address": "12 Secret Lane"},
           "items": [{"sku": "A-1", "note": "gift for Unkept1"},
                     {"sku": "B-2", "note": "Unkept2"}],
           "free_text": "Unkept3 whatever the agent wrote"}
KEEP = ["amount", "currency", "customer.id", "items.sku"]


def test_only_the_kept_fields_are_stored_and_fingerprinted():
    op = receipts.record_intent("payments.charge", "https://pay.example", PAYMENT,
                                idempotency_key="charge-1", keep=KEEP)
    assert op.intent == {"amount": 1200, "currency": "EUR", "customer": {"id": "cus_7"},
                         "items": [{"sku": "A-1"}, {"sku": "B-2"}]}
    assert Operation.objects.get(pk=op.pk).intent == op.intent
    leaks = {(table, word) for table, text in stored_text().items()
             for word in ("Unkept1", "Unkept2", "Unkept3", "Secret Lane", "Lovelace")
             if word in text}
    assert leaks == set()

    # What is not kept is not fingerprinted: another note is the same intent...
    again = receipts.record_intent(
        "payments.charge", "https://pay.example",
        {**PAYMENT, "free_text": "other", "customer": {"id": "cus_7", "name": "A. L."}},
        idempotency_key="charge-1", keep=KEEP)
    assert again.pk == op.pk and again.recorded_now is False
    # ...and another kept value is another intent.
    with pytest.raises(IdempotencyKeyReused):
        receipts.record_intent("payments.charge", "https://pay.example",
                               {**PAYMENT, "amount": 1300}, idempotency_key="charge-1",
                               keep=KEEP)
    assert OperationEvent.objects.filter(operation=op).count() == 1


def test_kept_fields_are_still_redacted():
    op = receipts.record_intent(
        "payments.charge", "https://pay.example",
        {"amount": 5, "payer": {"token": "KeptTok9"}, "memo": "my password is KeptPw9"},
        idempotency_key="charge-2", keep=["amount", "payer", "memo"])
    assert op.intent == {"amount": 5, "payer": {"token": "[redacted]"},
                         "memo": "my password is [redacted]"}


def test_keep_is_checked_before_anything_is_written():
    for bad in ("amount", [""], ["a..b"], [3]):
        with pytest.raises(InvalidInput, match="keep"):
            receipts.record_intent("payments.charge", "https://pay.example", PAYMENT,
                                   idempotency_key="charge-3", keep=bad)
    assert not Operation.objects.exists()


def test_the_decorator_stores_only_the_kept_arguments():
    calls = []

    @receipts.action("payments.charge", target="https://pay.example",
                     key=lambda payment, card: payment["ref"], keep=["payment.amount"])
    def charge(payment: dict, card: str) -> dict:
        calls.append(card)
        return {"id": "ch_1"}

    assert charge({"ref": "r-1", "amount": 9, "memo": "Unkept4"}, "4000 0000 0000 0002") \
        == {"id": "ch_1"}
    op = Operation.objects.get()
    assert op.intent == {"payment": {"amount": 9}} and op.state == "succeeded"
    assert calls == ["4000 0000 0000 0002"]
    text = "\n".join(stored_text().values())
    assert "Unkept4" not in text and "4000 0000 0000 0002" not in text
