"""`wait=`: a call that finds its key in flight (another caller is sending it) waits for
that caller's outcome and returns it, without sending, against a real ledger server."""

from __future__ import annotations

import threading
import time

import pytest

from ledger.models import Operation, OperationEvent
from tests.support.loops import run_coroutine


def start_holding(fn, *args) -> tuple[threading.Thread, dict]:
    """Call `fn(*args)` in a thread; its answer (or exception) lands in the dict."""
    answer: dict = {}

    def run():
        try:
            answer["value"] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            answer["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, answer


def until(condition, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_waiting_returns_the_other_callers_result_without_sending(ledger):
    from ledger_client import InFlight, InvalidInput

    release = threading.Event()
    calls: list[str] = []

    def charge(ref: str) -> dict:
        calls.append(ref)
        release.wait(30)
        return {"charged": ref}

    first = ledger.action("payments.charge", target="https://psp", key=lambda ref: ref)(charge)
    patient = ledger.action("payments.charge", target="https://psp", key=lambda ref: ref,
                            wait=30)(charge)
    hasty = ledger.action("payments.charge", target="https://psp", key=lambda ref: ref,
                          wait=0.3)(charge)
    holder, held = start_holding(first, "r1")
    until(lambda: calls == ["r1"])
    with pytest.raises(InFlight):  # waited 0.3 s, still in flight: said so
        hasty("r1")
    waiter, waited = start_holding(patient, "r1")
    time.sleep(1.5)  # it asks again meanwhile, and is told in flight each time
    assert waiter.is_alive() and "value" not in waited
    release.set()
    holder.join(30)
    waiter.join(30)
    assert held == {"value": {"charged": "r1"}}
    assert waited == {"value": {"charged": "r1"}}  # the other's outcome, not a second send
    assert calls == ["r1"]
    [op] = Operation.objects.all()
    assert OperationEvent.objects.filter(operation=op, to_state="submitted").count() == 1
    with pytest.raises(InvalidInput, match="wait"):
        ledger.action("x.y", target="t", key=lambda v: v, wait=-1)


def test_waiting_in_the_async_client_gets_the_outcome_and_its_error(ledger):
    from ledger_client import OutcomeUnknown

    release = threading.Event()
    calls: list[str] = []

    def fail(ref: str) -> None:
        calls.append(ref)
        release.wait(30)
        raise TimeoutError("the provider did not answer")

    first = ledger.action("payments.charge", target="https://psp", key=lambda ref: ref)(fail)

    @ledger.action("payments.charge", target="https://psp", key=lambda ref: ref, wait=30)
    async def patient(ref: str) -> None:
        calls.append(ref)

    holder, _ = start_holding(first, "r2")
    until(lambda: calls == ["r2"])

    async def main():
        try:
            return await patient("r2")
        finally:
            await ledger.aclose()

    threading.Timer(1.0, release.set).start()
    with pytest.raises(OutcomeUnknown) as caught:  # the other's outcome: not proven
        run_coroutine(main())
    holder.join(30)
    assert type(caught.value) is OutcomeUnknown
    assert caught.value.operation.state == "outcome_unknown"
    assert calls == ["r2"]
