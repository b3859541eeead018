"""The real-system scenario with a blind reader: the gateway in front of the invoicing MCP
server, behind the fault proxy, with its read tool answered as a reader with the wrong
credentials would see it (every invoice "absent"). Nothing it reads proves an absence:
no unknown outcome becomes safe_to_retry, no retry is sent, all stay unproven."""

from __future__ import annotations

import json

import anyio
import pytest

from ledger import receipts
from ledger.models import Evidence, Operation
from ledger.states import State
from tests.api.test_gateway import invoice, invoices, reconcile_once, through_gateway, write_config

pytestmark = pytest.mark.django_db(transaction=True)

ABSENT = {"status": "absent", "invoice": None}
BLIND = {"blind_tool": "find_invoice",
         "blind_answer": {"content": [{"type": "text", "text": json.dumps(ABSENT)}],
                          "structuredContent": ABSENT, "isError": False,
                          "resultType": "complete"}}


def test_a_blind_reader_sends_no_retry_and_proves_nothing(make_key, tmp_path):
    secret = make_key("billing-bot")
    config = write_config(tmp_path, plan={"tool": "create_invoice", "drop_reply": [2],
                                          "drop_request": [3]},
                          extra="retry_window = 600")
    blind = write_config(tmp_path, plan=BLIND, extra="retry_window = 600", name="blind.toml")

    async def session():
        async with through_gateway(config, secret) as client:
            done = await client.call_tool("create_invoice", invoice("r-1"))  # the control
            assert not done.is_error, done.content
            lost_reply = await client.call_tool("create_invoice", invoice("r-2"))
            assert lost_reply.is_error and "not known yet" in lost_reply.content[0].text
            lost_request = await client.call_tool("create_invoice", invoice("r-3"))
            assert lost_request.is_error and "not known yet" in lost_request.content[0].text

            await anyio.sleep(1.2)  # past the in-flight window (1 s) of the lost calls
            out = await anyio.to_thread.run_sync(reconcile_once, blind)
            assert "safe_to_retry" not in out, out

    anyio.run(session)
    # r-1 and r-2 reached the service once each; r-3 never did, and nothing made it
    # retryable: no operation reached safe_to_retry, none was sent a second time.
    assert [i["reference"] for i in invoices(tmp_path)] == ["r-1", "r-2"]
    ops = {op.intent["arguments"]["reference"]: op for op in Operation.objects.all()}
    assert ops["r-1"].state == State.SUCCEEDED
    for reference in ("r-2", "r-3"):
        op = ops[reference]
        assert (op.state, op.attempt) == (State.OUTCOME_UNKNOWN, 1), reference
        assert State.SAFE_TO_RETRY not in op.events.values_list("to_state", flat=True)
        [reading] = Evidence.objects.filter(operation=op)
        assert reading.verdict == "verifier_blind", (reference, reading.verdict,
                                                    reading.detail, reading.observed)
        control = reading.observed["positive_control"]
        assert (reading.verdict, control["status"]) == ("verifier_blind", "not_seen")
        assert control["control"]["operation_id"] == ops["r-1"].operation_id
    assert list(receipts.retries_due()) == []
