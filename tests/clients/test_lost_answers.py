"""A lost answer to the intent request, through a real TCP proxy between the client and a
real ledger server that drops it after the server committed: the client sends the request
again with the same Request-Id and gets the same answer, so the external call happens once
and nothing it did not send is left looking sent."""

from __future__ import annotations

import httpx
import pytest

from ledger import agent_keys
from ledger.models import Operation, OperationEvent
from tests.clients.tcp_fault_proxy import TcpFaultProxy
from tests.support.loops import run_coroutine

INTENT = b"POST /api/v1/operations "


@pytest.fixture
def proxy(server):
    found = TcpFaultProxy(("127.0.0.1", server.port), drop_answers={INTENT: 1})
    yield found
    found.close()


def submissions(op: Operation) -> int:
    return OperationEvent.objects.filter(operation=op, to_state="submitted").count()


def test_a_lost_answer_to_the_intent_is_asked_again_and_the_call_is_made_once(proxy,
                                                                              secret):
    from ledger_client import Ledger

    effects: list[str] = []
    with Ledger(proxy.url, key=secret, timeout=10) as ledger:
        @ledger.action("mail.send", target="smtp://mail", key=lambda to: to)
        def send(to: str) -> dict:
            effects.append(to)
            return {"sent": to}

        assert send("a@example.com") == {"sent": "a@example.com"}
        assert proxy.dropped == [INTENT]  # the first answer was lost after the commit
        # A second call is a replay of what was sent, not "an attempt was sent" of nothing.
        assert send("a@example.com") == {"sent": "a@example.com"}
    assert effects == ["a@example.com"]
    [op] = Operation.objects.all()
    assert (op.state, submissions(op)) == ("succeeded", 1)


def test_the_async_client_asks_again_too(proxy, secret):
    from ledger_client import Ledger

    effects: list[str] = []
    ledger = Ledger(proxy.url, key=secret, timeout=10)

    @ledger.action("mail.send", target="smtp://mail", key=lambda to: to)
    async def send(to: str) -> dict:
        effects.append(to)
        return {"sent": to}

    async def main():
        try:
            return await send("b@example.com")
        finally:
            await ledger.aclose()

    assert run_coroutine(main()) == {"sent": "b@example.com"}
    ledger.close()
    assert proxy.dropped == [INTENT] and effects == ["b@example.com"]
    [op] = Operation.objects.all()
    assert (op.state, submissions(op)) == ("succeeded", 1)


def test_over_http_only_the_same_request_id_of_the_same_key_gets_the_same_answer(
        proxy, server, secret, admin):
    body = {"operation": "mail.send", "target": "smtp://mail", "intent": {"to": "c"},
            "idempotency_key": "c", "submit": True}
    rid = "req-0123456789abcdef-lost"
    auth = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=proxy.url, headers=auth, timeout=10) as raw:
        with pytest.raises(httpx.HTTPError):
            raw.post("/api/v1/operations", json=body, headers={"Request-Id": rid})
        again = raw.post("/api/v1/operations", json=body, headers={"Request-Id": rid})
        other = raw.post("/api/v1/operations", json=body,
                         headers={"Request-Id": "req-another-one-0123456789"})
        none = raw.post("/api/v1/operations", json=body)
        malformed = raw.post("/api/v1/operations", json=body, headers={"Request-Id": "short"})
    assert again.status_code == 200, again.text
    data = again.json()
    assert (data["submitted_now"], data["request_repeated"], data["state"]) == (
        True, True, "submitted")
    assert "Idempotent-Replayed" not in again.headers  # the submission is this request's
    for refused in (other, none):  # another caller: in flight, never the same answer
        assert refused.status_code == 409, refused.text
        assert refused.json()["type"] == "urn:agent-ledger:problem:idempotency-in-flight"
    assert malformed.status_code == 422
    assert "Request-Id" in malformed.json()["detail"]
    # Another key granted the same tenant, holding the id, is not the one that submitted.
    stranger = agent_keys.create("other-bot", tenants=["default"], user=admin)[1]
    with httpx.Client(base_url=server.url, timeout=10,
                      headers={"Authorization": f"Bearer {stranger}"}) as raw:
        theirs = raw.post("/api/v1/operations", json=body, headers={"Request-Id": rid})
    assert theirs.status_code == 409
    [op] = Operation.objects.all()
    assert submissions(op) == 1
    event = op.events.get(to_state="submitted")
    assert rid not in event.reason and event.reason.startswith("request sent (request sha256:")
    # Once the outcome is recorded, the same id is an ordinary replay: do not send.
    with httpx.Client(base_url=server.url, headers=auth, timeout=10) as raw:
        raw.post(f"/api/v1/operations/{op.operation_id}/succeeded",
                 json={"expected_version": op.version})
        later = raw.post("/api/v1/operations", json=body, headers={"Request-Id": rid})
    assert later.status_code == 200
    assert later.json()["submitted_now"] is False and later.json()["request_repeated"] is False
    assert later.headers["Idempotent-Replayed"] == "true"
