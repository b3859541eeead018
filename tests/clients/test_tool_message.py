"""`ledger_client.tool_message`: what a model reads as a tool's answer when a
`ledger.action` call did not simply return, against a real ledger server process."""

from __future__ import annotations

import pytest

from ledger.models import Operation
from tests.clients.test_python_client import Calls


def test_an_unknown_outcome_tells_the_model_not_to_retry_on_the_call_and_on_its_retry(ledger):
    from ledger_client import OutcomeUnknown, tool_message

    send = Calls(raises=TimeoutError("read timed out"))
    act = ledger.action("mail.send", target="smtp://mail", key=lambda to: to)(send)
    with pytest.raises(TimeoutError) as first:
        act("ann@example.com")
    with pytest.raises(OutcomeUnknown) as retry:
        act("ann@example.com")
    [op] = Operation.objects.all()
    assert first.value.ledger_operation.operation_id == op.operation_id
    assert tool_message(first.value) == (
        f"Outcome unknown: mail.send (operation {op.operation_id}) was sent and whether it "
        "took effect is not proven (TimeoutError: read timed out). Do not retry; the ledger "
        f"is reconciling operation {op.operation_id}.")
    assert retry.value.tool_message == tool_message(retry.value) == (
        f"Outcome unknown: mail.send (operation {op.operation_id}) was sent and whether it "
        "took effect is not proven (its state is outcome_unknown). Do not retry; the ledger "
        f"is reconciling operation {op.operation_id}.")
    assert send.count == 1


def test_a_rejection_tells_the_model_not_to_retry_the_same_arguments(ledger):
    from ledger_client import Rejected, tool_message

    class ClientError(Exception):
        pass

    send = Calls(raises=ClientError("422 title taken"))
    act = ledger.action("articles.create", target="https://cms.example", key=lambda s: s,
                        rejections=(ClientError,))(send)
    with pytest.raises(ClientError) as first:
        act("a")
    with pytest.raises(Rejected) as again:
        act("a")
    [op] = Operation.objects.all()
    assert tool_message(first.value) == (
        f"Rejected: articles.create (operation {op.operation_id}) was rejected (ClientError: "
        "422 title taken). It was not carried out; do not retry it with the same arguments.")
    assert again.value.tool_message.startswith(
        f"Rejected: articles.create (operation {op.operation_id}) was rejected (Rejected: ")


def test_an_unreachable_ledger_tells_the_model_nothing_was_sent():
    from ledger_client import Ledger, LedgerUnavailable, tool_message

    send = Calls(result="sent")
    with Ledger("http://127.0.0.1:1", key="alk_x", timeout=1) as ledger:
        act = ledger.action("x.y", target="https://x", key=lambda v: v)(send)
        with pytest.raises(LedgerUnavailable) as caught:
            act("k")
    assert send.count == 0
    message = tool_message(caught.value)
    assert message.startswith("Not sent: the ledger could not be reached (")
    assert message.endswith("nothing was sent. You may try again later.")


def test_manual_review_approvals_and_foreign_errors_each_say_what_to_do():
    from ledger_client import (
        ApprovalDenied,
        ApprovalRequired,
        OutcomeUnknown,
        Receipt,
        tool_message,
    )

    review = Receipt({"operation_id": "op-7", "operation": "wire.send", "state": "manual_review"})
    assert tool_message(OutcomeUnknown("x", operation=review)).endswith(
        "a person is reviewing it. Do not retry; a person decides operation op-7.")
    pending = Receipt({"operation_id": "op-8", "operation": "wire.send", "state": "planned"})
    asked = ApprovalRequired("x", status=409, problem={}, operation=pending)
    assert tool_message(asked).startswith(
        "Waiting for approval: wire.send (operation op-8) needs a person's approval")
    denied = ApprovalDenied("x", status=409, problem={"reason": "too large"}, operation=pending)
    assert tool_message(denied) == ("Denied: a person denied wire.send (operation op-8): too "
                                    "large. It was not sent; do not retry it.")
    assert tool_message(ValueError("bad\nline " + "x" * 400)).startswith(
        "The tool failed (ValueError: bad line xxx")
    assert len(tool_message(ValueError("x" * 5000))) < 400
