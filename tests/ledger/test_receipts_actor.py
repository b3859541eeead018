"""What the network surfaces need of receipts: who acted, on which version, and whether a
record_intent call recorded the operation or found it."""

from __future__ import annotations

import pytest

from ledger import receipts
from ledger.errors import StaleVersion
from ledger.models import OperationEvent

pytestmark = pytest.mark.django_db


def record(key="k-1", intent=None):
    return receipts.record_intent("mail.send", "smtp://mail.example",
                                  intent or {"to": "ada@example.com"}, idempotency_key=key,
                                  actor="billing-bot")


def test_recorded_now_tells_a_new_operation_from_a_found_one():
    first = record()
    again = record()
    assert first.recorded_now is True
    assert again.recorded_now is False and again.pk == first.pk


def test_every_mark_records_its_actor_on_the_event():
    submitted = record("a")
    receipts.mark_submitted(submitted, actor="billing-bot")
    receipts.mark_succeeded(submitted, actor="billing-bot")
    rejected = record("b", {"to": "b"})
    receipts.mark_submitted(rejected, actor="billing-bot")
    receipts.mark_rejected(rejected, error_code="HTTP 422", actor="billing-bot")
    unknown = record("c", {"to": "c"})
    receipts.mark_submitted(unknown, actor="billing-bot")
    receipts.mark_outcome_unknown(unknown, error_code="TimeoutError", actor="billing-bot")

    assert set(OperationEvent.objects.values_list("actor_id", flat=True)) == {"billing-bot"}
    assert OperationEvent.objects.count() == 9


def test_a_mark_on_a_version_that_moved_on_is_stale_and_writes_nothing():
    op = record()
    receipts.mark_submitted(op, expected_version=1, actor="billing-bot")
    with pytest.raises(StaleVersion, match="expected operation .* at version 1"):
        receipts.mark_succeeded(op, expected_version=1, actor="billing-bot")
    op.refresh_from_db()
    assert (op.state, op.version) == ("submitted", 2)
    assert OperationEvent.objects.count() == 2
