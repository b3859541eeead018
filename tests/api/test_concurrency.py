"""Many HTTP agents at once on one key, through the real server."""

from __future__ import annotations

import threading

import httpx
import pytest

from ledger.models import Operation, OperationEvent

pytestmark = pytest.mark.django_db(transaction=True)

AGENTS = 20


def test_twenty_concurrent_agents_recording_one_key_get_one_operation(make_key, api_server):
    secret = make_key("fleet")
    barrier = threading.Barrier(AGENTS)
    answers: list[tuple[int, str]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def agent():
        try:
            with httpx.Client(base_url=api_server, timeout=60,
                              headers={"Authorization": f"Bearer {secret}"}) as client:
                barrier.wait(timeout=30)
                r = client.post("/api/v1/operations", json={
                    "operation": "payments.charge", "target": "https://pay.example/charges",
                    "intent": {"amount": 4200, "currency": "EUR"},
                    "idempotency_key": "order-42"})
            with lock:
                answers.append((r.status_code, r.json()["operation_id"]))
        except BaseException as exc:  # reported below, with the answers
            with lock:
                failures.append(exc)

    threads = [threading.Thread(target=agent) for _ in range(AGENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert failures == []
    assert len(answers) == AGENTS  # nothing lost
    assert sorted(status for status, _ in answers) == [200] * (AGENTS - 1) + [201]
    assert len({operation_id for _, operation_id in answers}) == 1
    assert Operation.objects.count() == 1
    assert OperationEvent.objects.count() == 1


def test_twenty_concurrent_agents_with_distinct_keys_lose_nothing(make_key, api_server):
    secret = make_key("fleet")
    answers: list[int] = []
    lock = threading.Lock()

    def agent(n: int):
        with httpx.Client(base_url=api_server, timeout=60,
                          headers={"Authorization": f"Bearer {secret}"}) as client:
            for i in range(5):
                r = client.post("/api/v1/operations", json={
                    "operation": "mail.send", "target": "smtp://mail.example",
                    "intent": {"n": n, "i": i}, "idempotency_key": f"mail-{n}-{i}"})
                with lock:
                    answers.append(r.status_code)

    threads = [threading.Thread(target=agent, args=(n,)) for n in range(AGENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert answers == [201] * (AGENTS * 5)
    assert Operation.objects.count() == AGENTS * 5
    assert set(OperationEvent.objects.values_list("actor_id", flat=True)) == {"fleet"}
