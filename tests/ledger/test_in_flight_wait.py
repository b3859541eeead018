"""@receipts.action(wait=): a call that finds its key in flight in another process waits
for that process's outcome and returns it, never sending a second time."""

import asyncio

import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from ledger import receipts
from ledger.errors import InFlight, InvalidInput, OutcomeUnknown
from ledger.models import Operation
from tests.support.loops import run_coroutine
from tests.support.processes import spawn, wait_for_line

SENDER = """
import sys
from ledger import receipts

@receipts.action("payments.charge", target="t", key=lambda ref: ref)
def charge(ref):
    print("SENT", flush=True)
    sys.stdin.readline()   # held until the test lets it answer
    if ref == "fail":
        raise TimeoutError("no answer")
    return {"charged": ref}

try:
    charge(sys.argv[-1] if len(sys.argv) > 1 else "{ref}")
except TimeoutError:
    pass
print("DONE", flush=True)
"""


def hold(ref: str):
    import subprocess

    child = spawn(SENDER.replace("{ref}", ref), stdin=subprocess.PIPE)
    wait_for_line(child, "SENT")
    return child


def let_go(child) -> None:
    child.stdin.write("\n")
    child.stdin.flush()


@pytest.mark.django_db(transaction=True)
def test_waiting_returns_the_other_processes_result_and_never_sends():
    sent = []

    def charge(ref):
        sent.append(ref)
        return {"charged": "again"}

    hasty = receipts.action("payments.charge", target="t", key=lambda ref: ref,
                            wait=0.3)(charge)
    patient = receipts.action("payments.charge", target="t", key=lambda ref: ref,
                              wait=30)(charge)
    child = hold("r1")
    with pytest.raises(InFlight):  # 0.3 s were not enough: still in flight, said so
        hasty("r1")
    import threading

    threading.Timer(1.5, let_go, args=(child,)).start()
    assert patient("r1") == {"charged": "r1"}  # the other's result, from its receipt
    wait_for_line(child, "DONE")
    child.wait(timeout=30)
    assert sent == []
    assert Operation.objects.get(idempotency_key="r1").state == "succeeded"
    with pytest.raises(InvalidInput, match="wait"):
        receipts.action("x.y", target="t", key=lambda v: v, wait=float("inf"))


@pytest.mark.django_db(transaction=True)
def test_waiting_in_an_async_action_gets_the_other_processes_error():
    sent = []

    @receipts.action("payments.charge", target="t", key=lambda ref: ref, wait=30)
    async def charge(ref):
        sent.append(ref)

    child = hold("fail")

    async def main():
        asyncio.get_running_loop().call_later(1.0, let_go, child)
        try:
            return await charge("fail")
        finally:  # the worker thread's connection, closed for the test database
            await sync_to_async(connections.close_all)()

    with pytest.raises(OutcomeUnknown) as caught:
        run_coroutine(main())
    wait_for_line(child, "DONE")
    child.wait(timeout=30)
    assert not isinstance(caught.value, InFlight)
    assert caught.value.operation.state == "outcome_unknown" and sent == []
