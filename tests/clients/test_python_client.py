"""clients/python (`ledger_client`) against a real ledger server process: the decorator's
promises over HTTP, and what happens when the ledger dies before or after the call."""

from __future__ import annotations

import asyncio
import http.server
import subprocess
import sys
import threading
import time
from datetime import timedelta

import httpx
import pytest

from ledger import agent_keys, approvals, receipts, reconcile
from ledger.models import ApprovalRequest, Operation, Step
from tests.clients.conftest import CLIENT_SRC
from tests.factories import UserFactory


def ops(**filters):
    return list(Operation.objects.filter(**filters).order_by("id"))


class Calls:
    """A function with an external effect: it counts its calls."""

    def __init__(self, result=None, raises: BaseException | None = None):
        self.count = 0
        self.result = result
        self.raises = raises

    def __call__(self, *args, **kwargs):
        self.count += 1
        if self.raises is not None:
            raise self.raises
        return self.result


# --- without Django --------------------------------------------------------------------------


def test_the_client_imports_without_django():
    code = ("import sys, ledger_client; from ledger_client import Ledger, OutcomeUnknown; "
            "assert 'django' not in sys.modules, sorted(m for m in sys.modules "
            "if m.startswith('django')); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd="/", env={"PYTHONPATH": str(CLIENT_SRC), "PATH": "/usr/bin"},
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_every_problem_type_of_the_api_has_its_error_class():
    import ledger_client
    from ledger_client.errors import PROBLEM_TYPES

    from api import problems

    slugs = {slug for _, _, slug, _ in problems.KINDS}
    slugs |= {"invalid-request", "unauthenticated", "malformed-body", "http-error",
              "internal-error"}
    assert slugs <= set(PROBLEM_TYPES), slugs - set(PROBLEM_TYPES)
    for slug in slugs:
        assert issubclass(PROBLEM_TYPES[slug], ledger_client.LedgerError)


def test_no_url_or_key_is_a_configuration_error(monkeypatch):
    from ledger_client import ConfigurationError, Ledger

    monkeypatch.delenv("LEDGER_URL", raising=False)
    monkeypatch.delenv("LEDGER_AGENT_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="LEDGER_URL"):
        Ledger()
    with pytest.raises(ConfigurationError, match="LEDGER_AGENT_KEY"):
        Ledger("http://127.0.0.1:1")


def test_the_environment_names_the_ledger_and_the_key(monkeypatch, server, secret):
    from ledger_client import Ledger

    monkeypatch.setenv("LEDGER_URL", server.url)
    monkeypatch.setenv("LEDGER_AGENT_KEY", secret)
    with Ledger() as ledger:
        send = Calls(result={"id": 1})
        act = ledger.action("env.test", target="https://x.example", key=lambda n: n)(send)
        assert act("k1") == {"id": 1}
        assert secret not in repr(ledger)


# --- the decorator's promises ----------------------------------------------------------------


def test_one_send_per_key_and_the_stored_result_without_calling(ledger):
    send = Calls(result={"id": 42, "title": "Hello"})

    @ledger.action("articles.create", target="https://cms.example/api/articles",
                   key=lambda article: article["slug"], external_id=lambda r: r["id"])
    def create_article(article: dict) -> dict:
        return send(article)

    assert create_article({"slug": "hello", "title": "Hello"}) == {"id": 42, "title": "Hello"}
    assert create_article({"slug": "hello", "title": "Hello"}) == {"id": 42, "title": "Hello"}
    assert send.count == 1
    [op] = ops(operation="articles.create")
    assert (op.state, op.external_id, op.result, op.idempotency_key) == (
        "succeeded", "42", {"id": 42, "title": "Hello"}, "hello")
    assert [e.actor_id for e in op.events.all()] == ["client-bot"] * 3


def test_a_rejection_is_recorded_reraised_and_later_calls_raise_rejected(ledger):
    from ledger_client import Rejected

    class ClientError(Exception):
        pass

    send = Calls(raises=ClientError("422 title taken"))
    act = ledger.action("articles.create", target="https://cms.example", key=lambda s: s,
                        rejections=(ClientError,))(send)
    with pytest.raises(ClientError):
        act("a")
    with pytest.raises(Rejected) as caught:
        act("a")
    assert send.count == 1
    assert caught.value.operation.state == "rejected"
    [op] = ops()
    assert (op.state, op.error_code, op.error_detail) == ("rejected", "ClientError",
                                                           "422 title taken")


def test_any_other_exception_is_outcome_unknown_and_later_calls_are_not_made(ledger):
    from ledger_client import OutcomeUnknown

    send = Calls(raises=TimeoutError("read timed out"))
    act = ledger.action("mail.send", target="smtp://mail", key=lambda to: to)(send)
    with pytest.raises(TimeoutError):
        act("ann@example.com")
    with pytest.raises(OutcomeUnknown) as caught:
        act("ann@example.com")
    assert send.count == 1
    assert caught.value.operation.state == "outcome_unknown"


def test_the_receipt_is_read_without_recording_or_sending(ledger):
    send = Calls(result="ok")
    act = ledger.action("mail.send", target="smtp://mail", key=lambda to: to)(send)
    assert act.receipt("bob@example.com") is None
    assert ops() == []
    act("bob@example.com")
    receipt = act.receipt("bob@example.com")
    assert (receipt.state, receipt.attempt, receipt.result) == ("succeeded", 1, "ok")
    assert receipt.operation_id == ops()[0].operation_id
    assert send.count == 1


def test_tenant_and_target_may_be_functions_of_the_call(server, admin):
    from ledger_client import Ledger

    secret = agent_keys.create("two-tenants", tenants=["acme", "globex"], user=admin)[1]
    with Ledger(server.url, key=secret) as ledger:
        send = Calls(result=1)
        act = ledger.action("nats.publish", target=lambda tenant, subject: f"nats://{subject}",
                            tenant=lambda tenant, subject: tenant,
                            key=lambda tenant, subject: subject)(send)
        act("acme", "orders.1")
        act("globex", "orders.1")
        assert act.receipt("acme", "orders.1").tenant == "acme"
    assert [(op.tenant, op.target) for op in ops()] == [("acme", "nats://orders.1"),
                                                          ("globex", "nats://orders.1")]
    assert send.count == 2


def test_the_provider_account_is_a_value_or_a_function_of_the_call(ledger):
    send = Calls(result={"id": "re_1"})
    refund = ledger.action("payments.refund", target="https://api.stripe.example/v1/refunds",
                           account=lambda shop, charge: f"acct_{shop}",
                           key=lambda shop, charge: charge)(send)
    refund("acme", "ch_1")
    assert refund.receipt("acme", "ch_1").account == "acct_acme"
    recorded = ledger.record("mail.send", target="smtp://mail.example", intent={"to": "a"},
                             idempotency_key="mail-1", account="ops@example.com")
    assert recorded.account == "ops@example.com"
    assert [(op.operation, op.account) for op in ops()] == [
        ("payments.refund", "acct_acme"), ("mail.send", "ops@example.com")]


def test_keep_sends_only_the_kept_fields(ledger):
    send = Calls(result=None)

    @ledger.action("payments.charge", target="https://pay.example", key=lambda c: c["id"],
                   keep=["card.last4", "amount"])
    def charge(c: dict):
        return send(c)

    charge({"id": "c1", "amount": 5, "card": {"number": "4242424242424242", "last4": "4242"}})
    [op] = ops()
    assert op.intent == {"amount": 5, "card": {"last4": "4242"}}


def test_arguments_that_are_not_json_are_refused_before_anything_is_sent(ledger):
    from ledger_client import InvalidInput

    send = Calls()
    act = ledger.action("x.y", target="https://x", key=lambda v: "k")(send)
    with pytest.raises(InvalidInput, match=r"intent\.args\[0\]\[1\]: a set"):
        act([1, {2}])
    with pytest.raises(InvalidInput, match="nan"):
        act(float("nan"))
    assert send.count == 0 and ops() == []


def test_a_result_that_is_not_json_is_succeeded_without_it(ledger):
    from ledger_client import UnstorableResult

    value = {1, 2}
    send = Calls(result=value)
    act = ledger.action("x.y", target="https://x", key=lambda v: v)(send)
    with pytest.raises(UnstorableResult) as caught:
        act("k")
    assert caught.value.value is value
    with pytest.raises(UnstorableResult):
        act("k")
    assert send.count == 1
    [op] = ops()
    assert op.state == "succeeded" and "a set" in op.result_unstorable


def test_a_key_is_required_outside_a_step(ledger):
    from ledger_client import InvalidInput

    act = ledger.action("x.y", target="https://x")(Calls())
    with pytest.raises(InvalidInput, match="generated key would send again"):
        act()


def test_a_wrong_or_revoked_key_is_unauthenticated_and_nothing_is_called(server, admin,
                                                                           secret):
    from ledger_client import Ledger, Unauthenticated

    send = Calls()
    for key in ("alk_wrong", secret):
        if key == secret:
            agent_keys.revoke("client-bot", user=admin)
        with Ledger(server.url, key=key) as ledger:
            act = ledger.action("x.y", target="https://x", key=lambda v: v)(send)
            with pytest.raises(Unauthenticated) as caught:
                act("k")
            assert caught.value.status == 401
    assert send.count == 0 and ops() == []


def test_retries_due_lists_safe_to_retry_and_the_next_call_sends_attempt_two(ledger,
                                                                             reviewer):
    send = Calls(raises=ConnectionResetError("reset"))
    act = ledger.action("x.y", target="https://x", key=lambda v: v)(send)
    with pytest.raises(ConnectionResetError):
        act("k")
    [op] = ops()
    receipts.resolve(op, "safe_to_retry", user=reviewer, reason="proven absent by hand")
    [due] = ledger.retries_due(operation="x.y")
    assert (due.operation_id, due.state) == (op.operation_id, "safe_to_retry")
    send.raises, send.result = None, "sent"
    assert act("k") == "sent"
    assert send.count == 2
    op.refresh_from_db()
    assert (op.state, op.attempt) == ("succeeded", 2)
    assert ledger.retries_due() == []


@pytest.fixture
def reviewer(transactional_db):
    return UserFactory(username="rev", role="reviewer", tenants=["default"])


# --- runs, steps, fencing --------------------------------------------------------------------


def test_a_step_derives_the_keys_and_its_token_fences_the_writes(ledger):
    from ledger_client import StaleFencingToken, step_key

    ledger.start_run("publish", run_id="run-1")
    ledger.add_step("run-1", "draft")
    first = ledger.resume("run-1", worker="w1", ttl_seconds=60)
    send = Calls(result="done")
    act = ledger.action("cms.post", target="https://cms")(send)
    with ledger.step("run-1", "draft", fencing_token=first.token):
        act("a")
        act("b")
        assert act.receipt("b").idempotency_key == step_key("run-1", "draft", "2")
    assert [op.idempotency_key for op in ops()] == [
        receipts.idempotency_key("run-1", "draft"),
        receipts.idempotency_key("run-1", "draft", "2")]
    with ledger.step("run-1", "draft", fencing_token=first.token):
        assert act("a") == "done"  # the step re-run finds its receipt: not sent again
    assert send.count == 2

    second = ledger.resume("run-1", worker="w1", ttl_seconds=60)  # the old is stale now
    # Once the run is leased a step is added only under the current token.
    for token in (None, first.token):
        with pytest.raises(StaleFencingToken) as refused:
            ledger.add_step("run-1", "publish", fencing_token=token)
        assert refused.value.current_token == second.token
    assert not Step.objects.filter(step_id="publish").exists()
    added = ledger.add_step("run-1", "publish", fencing_token=second.token)
    assert (added.step_id, added.state) == ("publish", "pending")
    assert Step.objects.get(step_id="publish").added_token == second.token
    with ledger.step("run-1", "publish", fencing_token=first.token):
        with pytest.raises(StaleFencingToken) as caught:
            act("c")
    assert caught.value.current_token > first.token
    assert send.count == 2  # refused before the call


# --- the ledger unreachable ------------------------------------------------------------------


def test_the_ledger_down_before_the_call_means_no_call(ledger, server):
    from ledger_client import LedgerUnavailable

    send = Calls(result="sent")
    act = ledger.action("x.y", target="https://x", key=lambda v: v)(send)
    server.kill()
    with pytest.raises(LedgerUnavailable, match="could not connect"):
        act("k")
    assert send.count == 0
    server.start()
    assert act("k") == "sent"
    assert send.count == 1


def test_the_ledger_down_after_the_call_is_recorded_once_it_is_back(ledger, server):
    restarted = []

    def send(_):
        server.kill()  # the call went out; the ledger dies before its outcome is recorded
        thread = threading.Thread(target=lambda: (time.sleep(1), server.start(),
                                                  restarted.append(True)))
        thread.start()
        restarted.append(thread)
        return {"id": 7}

    calls = Calls()
    act = ledger.action("x.y", target="https://x", key=lambda v: v,
                        external_id=lambda r: r["id"])(lambda v: (calls(), send(v))[1])
    assert act("k") == {"id": 7}
    restarted[0].join()
    assert calls.count == 1
    [op] = ops()
    assert (op.state, op.external_id, op.result, op.version) == ("succeeded", "7", {"id": 7}, 3)


def test_the_ledger_down_for_good_leaves_it_submitted_for_the_sweep(server, secret):
    from ledger_client import Ledger, OutcomeNotRecorded, OutcomeUnknown

    calls = Calls()

    def send(_):
        calls()
        server.kill()
        return "sent"

    with Ledger(server.url, key=secret, record_for=0.5) as ledger:
        act = ledger.action("x.y", target="https://x", key=lambda v: v)(send)
        with pytest.raises(OutcomeNotRecorded) as caught:
            act("k")
        assert caught.value.value == "sent"
        server.start()
        [op] = ops()
        assert op.state == "submitted"
        assert reconcile.sweep_stale_submissions(older_than=timedelta(0)) == 1
        with pytest.raises(OutcomeUnknown):
            act("k")
    assert calls.count == 1


def test_the_ledger_down_when_the_call_raised_keeps_the_callers_exception(server, secret):
    from ledger_client import Ledger

    def send(_):
        server.kill()
        raise TimeoutError("upstream timed out")

    with Ledger(server.url, key=secret, record_for=0.3) as ledger:
        act = ledger.action("x.y", target="https://x", key=lambda v: v)(send)
        with pytest.raises(TimeoutError) as caught:
            act("k")
    assert any("stays submitted" in note for note in caught.value.__notes__)
    from ledger_client import tool_message  # the sweep reconciles it: the model must not retry

    [op] = ops()
    assert (f"Do not retry; the ledger is reconciling operation {op.operation_id}."
            in tool_message(caught.value))


class DropFirstAnswer(httpx.HTTPTransport):
    """The real request reaches the real server; its first answer on `path_end` is lost
    (a timeout after the ledger has acted)."""

    def __init__(self, path_end: str):
        super().__init__()
        self.path_end = path_end
        self.dropped = 0

    def handle_request(self, request):
        response = super().handle_request(request)
        if request.url.path.endswith(self.path_end) and not self.dropped:
            response.read()
            self.dropped += 1
            raise httpx.ReadTimeout("answer lost", request=request)
        return response


def test_an_outcome_recorded_but_unanswered_is_not_recorded_twice(server, secret):
    from ledger_client import Ledger

    transport = DropFirstAnswer("/succeeded")
    send = Calls(result={"id": 3})
    with Ledger(server.url, key=secret, transport=transport) as ledger:
        act = ledger.action("x.y", target="https://x", key=lambda v: v)(send)
        assert act("k") == {"id": 3}
    assert transport.dropped == 1 and send.count == 1
    [op] = ops()
    assert (op.state, op.version) == ("succeeded", 3)


def test_a_lost_answer_to_the_submission_is_asked_again_and_the_call_made_once(server,
                                                                             secret):
    from ledger_client import Ledger

    transport = DropFirstAnswer("/operations")
    send = Calls(result="sent")
    with Ledger(server.url, key=secret, transport=transport) as ledger:
        act = ledger.action("x.y", target="https://x", key=lambda v: v)(send)
        assert act("k") == "sent"  # the repeat (same Request-Id) got the lost answer again
        assert act("k") == "sent"  # the stored result
    assert transport.dropped == 1 and send.count == 1
    [op] = ops()
    assert op.state == "succeeded"


def test_answers_lost_every_time_mean_no_call(server, secret):
    from ledger_client import InFlight, Ledger, LedgerUnavailable

    class DropAll(httpx.HTTPTransport):
        def handle_request(self, request):
            super().handle_request(request).read()
            raise httpx.ReadTimeout("answer lost", request=request)

    send = Calls(result="sent")
    with Ledger(server.url, key=secret, transport=DropAll()) as ledger:
        act = ledger.action("x.y", target="https://x", key=lambda v: v)(send)
        with pytest.raises(LedgerUnavailable, match="timed out"):
            act("k")
    with Ledger(server.url, key=secret) as ledger:  # another call: it is in flight
        act = ledger.action("x.y", target="https://x", key=lambda v: v)(send)
        with pytest.raises(InFlight):
            act("k")
    assert send.count == 0


class Garbage(http.server.BaseHTTPRequestHandler):
    status, content_type, body = 200, "text/html", b"<html>proxy</html>"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(self.status)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(("status", "content_type", "body", "error"), [
    (200, "text/html", b"<html>proxy</html>", "UnexpectedResponse"),
    (502, "text/html", b"Bad gateway", "ServerError"),
    (500, "application/problem+json",
     b'{"type": "urn:agent-ledger:problem:internal-error", "title": "Internal error", '
     b'"status": 500, "detail": "logged"}', "InternalError"),
    (409, "application/problem+json", b'{"not": "a problem"}', "UnexpectedResponse"),
])
def test_a_ledger_answering_garbage_or_5xx_is_a_typed_error_and_nothing_is_called(
        status, content_type, body, error):
    import ledger_client

    handler = type("Handler", (Garbage,), {"status": status, "content_type": content_type,
                                           "body": body})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        with ledger_client.Ledger(f"http://127.0.0.1:{httpd.server_port}", key="k") as ledger:
            send = Calls()
            act = ledger.action("x.y", target="https://x", key=lambda v: v)(send)
            with pytest.raises(getattr(ledger_client, error)) as caught:
                act("k")
            assert isinstance(caught.value, ledger_client.LedgerUnavailable)
            assert send.count == 0
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_slow_ledger_is_a_timeout_and_nothing_is_called(server, secret):
    import ledger_client

    class Slow(Garbage):
        def do_POST(self):
            time.sleep(1)
            super().do_POST()

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with ledger_client.Ledger(f"http://127.0.0.1:{httpd.server_port}", key="k",
                                  timeout=0.2) as ledger:
            send = Calls()
            act = ledger.action("x.y", target="https://x", key=lambda v: v)(send)
            with pytest.raises(ledger_client.LedgerUnavailable, match="timed out"):
                act("k")
            assert send.count == 0
    finally:
        httpd.shutdown()
        httpd.server_close()


# --- approvals -------------------------------------------------------------------------------


def test_an_approval_policy_raises_approval_required_without_calling(ledger, admin):
    from ledger_client import ApprovalRequired

    approvals.set_policy("payments.*", user=admin)
    send = Calls()
    act = ledger.action("payments.refund", target="https://pay", key=lambda v: v)(send)
    with pytest.raises(ApprovalRequired) as caught:
        act("r1")
    assert send.count == 0
    assert caught.value.operation.state == "planned"


@pytest.mark.parametrize("decision", ["approve", "deny"])
def test_waiting_for_approval_sends_once_approved_and_never_once_denied(ledger, admin,
                                                                        decision):
    from ledger_client import ApprovalDenied

    approvals.set_policy("payments.*", user=admin)
    send = Calls(result="refunded")
    act = ledger.action("payments.refund", target="https://pay", key=lambda v: v,
                        approval_timeout=60, approval_note="customer asked")(send)
    outcome = []

    def agent():
        try:
            outcome.append(act("r1"))
        except Exception as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)
        finally:
            from django.db import connection
            connection.close()

    thread = threading.Thread(target=agent)
    thread.start()
    deadline = time.monotonic() + 60
    while not ApprovalRequest.objects.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    [op] = ops()
    assert ApprovalRequest.objects.get().note == "customer asked"
    if decision == "approve":
        approvals.approve(op, user=admin, reason="ok")
    else:
        approvals.deny(op, user=admin, reason="not eligible")
    thread.join(timeout=60)
    if decision == "approve":
        assert outcome == ["refunded"] and send.count == 1
    else:
        assert isinstance(outcome[0], ApprovalDenied) and send.count == 0
        assert outcome[0].reason == "not eligible"


def test_no_decision_in_time_is_approval_required(ledger, admin):
    from ledger_client import ApprovalRequired

    approvals.set_policy("payments.*", user=admin)
    send = Calls()
    act = ledger.action("payments.refund", target="https://pay", key=lambda v: v,
                        approval_timeout=0.3)(send)
    with pytest.raises(ApprovalRequired, match="within 0.3 s"):
        act("r1")
    assert send.count == 0


# --- async -----------------------------------------------------------------------------------


def test_an_async_action_sends_once_and_reads_its_receipt(ledger):
    from ledger_client import OutcomeUnknown

    calls = Calls()

    @ledger.action("articles.create", target="https://cms", key=lambda slug: slug)
    async def create(slug: str) -> dict:
        calls()
        await asyncio.sleep(0)
        if slug == "bad":
            raise ConnectionError("dropped")
        return {"slug": slug}

    async def main():
        assert await create.receipt("a") is None
        assert await asyncio.gather(create("a"), create("b")) == [{"slug": "a"},
                                                                   {"slug": "b"}]
        assert await create("a") == {"slug": "a"}
        with pytest.raises(ConnectionError):
            await create("bad")
        with pytest.raises(OutcomeUnknown):
            await create("bad")
        return await create.receipt("a")

    receipt = asyncio.run(main())
    assert receipt.state == "succeeded"
    assert calls.count == 3


def test_an_async_action_with_the_ledger_down_before_the_call_is_not_called(ledger, server):
    from ledger_client import LedgerUnavailable

    calls = Calls()

    @ledger.action("x.y", target="https://x", key=lambda v: v)
    async def act(v):
        calls()

    server.kill()
    with pytest.raises(LedgerUnavailable):
        asyncio.run(act("k"))
    assert calls.count == 0


# --- traces ----------------------------------------------------------------------------------


def test_a_client_action_is_a_span_whose_trace_the_operation_stores(ledger, monkeypatch):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer", provider.get_tracer)

    act = ledger.action("payments.charge", target="https://u:hunter2@psp.example",
                        key=lambda card: card["id"])(Calls(result={"token": "sk-live-x"}))
    act({"id": "c-1", "number": "4242424242424242"})
    [span] = exporter.get_finished_spans()
    [op] = ops()
    assert span.name == "execute_tool payments.charge"
    assert dict(span.attributes) == {
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "payments.charge",
        "gen_ai.tool.call.id": op.operation_id, "ledger.operation_id": op.operation_id,
        "ledger.state": "succeeded", "ledger.idempotency_key": "c-1"}
    assert (op.trace_id, op.span_id) == (f"{span.context.trace_id:032x}",
                                         f"{span.context.span_id:016x}")
    text = repr(dict(span.attributes))
    assert "hunter2" not in text and "4242" not in text and "sk-live" not in text


def test_resume_is_a_span_with_the_run_its_token_and_the_fact_versions(ledger, monkeypatch):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ledger import facts, runs

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer", provider.get_tracer)
    run = runs.start("ship", run_id="run-t")
    facts.assert_fact("order:7", "status", {"secret": "shh"}, source="test", run=run)

    view = ledger.resume("run-t", worker="w1", ttl_seconds=60)
    [span] = [s for s in exporter.get_finished_spans() if s.name == "execute_tool run_resume"]
    attributes = dict(span.attributes)
    assert (attributes["ledger.run_id"], attributes["ledger.fencing_token"],
            attributes["ledger.facts.read"]) == ("run-t", view.token, ("order:7 status@1",))
    assert "shh" not in repr(attributes)


# --- replays and calls in flight -------------------------------------------------------------


def test_a_replay_says_it_is_one_over_http_and_on_the_receipt(ledger, server, secret):
    from ledger_client import OutcomeUnknown

    body = {"operation": "mail.send", "target": "smtp://mail", "intent": {"to": "ann"},
            "idempotency_key": "ann-1"}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {secret}"},
                      timeout=30) as raw:
        first = raw.post("/api/v1/operations", json={**body, "submit": True})
        assert first.status_code == 201 and first.json()["submitted_now"] is True
        assert "Idempotent-Replayed" not in first.headers
    recorded = ledger.record("mail.send", target="smtp://mail", intent={"to": "bob"},
                             idempotency_key="bob-1")
    assert (recorded.state, recorded.replayed) == ("planned", False)
    again = ledger.record("mail.send", target="smtp://mail", intent={"to": "bob"},
                          idempotency_key="bob-1")
    assert (again.operation_id, again.replayed) == (recorded.operation_id, True)
    assert len(ops()) == 2 and ops(idempotency_key="bob-1")[0].state == "planned"

    # An action's repeat of a call that ended is served from the receipt, and says so.
    act = ledger.action("mail.send", target="smtp://mail", key=lambda to: to)(
        Calls(raises=TimeoutError("read timed out")))
    with pytest.raises(TimeoutError):
        act("cyd")
    with pytest.raises(OutcomeUnknown) as repeat:
        act("cyd")
    assert repeat.value.operation.replayed is True
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {secret}"},
                      timeout=30) as raw:
        repeat = raw.post("/api/v1/operations", json={
            "operation": "mail.send", "target": "smtp://mail", "intent": {"args": ["cyd"]},
            "idempotency_key": "cyd", "retry_policy": "if_absent_proven", "redact": [],
            "submit": True})
        assert repeat.status_code == 200, repeat.text
        assert repeat.headers["Idempotent-Replayed"] == "true"
        assert repeat.json()["state"] == "outcome_unknown"


def test_a_key_another_caller_is_sending_is_in_flight_never_outcome_unknown(ledger, server,
                                                                           secret):
    """Ten concurrent calls, five keys: each key is sent once; every other call is told
    the call is in flight (409 idempotency-in-flight, Retry-After), then gets the result."""
    from ledger_client import InFlight, OutcomeUnknown, tool_message

    release = threading.Event()
    calls: list[str] = []

    @ledger.action("payments.charge", target="https://psp", key=lambda ref: ref)
    def charge(ref: str) -> dict:
        calls.append(ref)
        release.wait(30)
        return {"charged": ref}

    answers: dict[int, object] = {}

    def one(i: int) -> None:
        try:
            answers[i] = charge(f"ref-{i % 5}")
        except Exception as exc:  # noqa: BLE001 - the test looks at each
            answers[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(calls) < 5 or sum(isinstance(a, Exception) for a in answers.values()) < 5:
        assert time.monotonic() < deadline, (calls, answers)
        time.sleep(0.02)
    release.set()
    for t in threads:
        t.join(30)
    refused = [a for a in answers.values() if isinstance(a, Exception)]
    assert sorted(calls) == [f"ref-{k}" for k in range(5)]
    assert len(refused) == 5 and all(type(a) is InFlight for a in refused), refused
    for exc in refused:
        assert isinstance(exc, OutcomeUnknown)  # what existing callers catch
        assert exc.status == 409 and exc.retry_after == 1
        assert exc.operation.state == "submitted"
        assert "another caller is sending it now" in exc.detail
        assert tool_message(exc).startswith("In flight: payments.charge (operation ")
    # Asked again once it ended: the result, from the receipt.
    assert [charge(f"ref-{k}") for k in range(5)] == [{"charged": f"ref-{k}"}
                                                      for k in range(5)]
    assert len(calls) == 5

    # Over HTTP: 409 problem+json with Retry-After and the operation.
    op = ledger.record("mail.send", target="smtp://mail", intent={}, idempotency_key="m")
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {secret}"},
                      timeout=30) as raw:
        raw.post(f"/api/v1/operations/{op.operation_id}/submitted", json={})
        busy = raw.post("/api/v1/operations", json={
            "operation": "mail.send", "target": "smtp://mail", "intent": {},
            "idempotency_key": "m", "submit": True})
    assert busy.status_code == 409 and busy.headers["Retry-After"] == "1"
    assert busy.headers["content-type"] == "application/problem+json"
    problem = busy.json()
    assert problem["type"] == "urn:agent-ledger:problem:idempotency-in-flight"
    assert problem["operation"]["operation_id"] == op.operation_id
    assert problem["retry_after"] == 1


class KeepAliveOperation(http.server.BaseHTTPRequestHandler):
    """An instant answer over a kept-alive HTTP/1.1 connection: the client's pooled socket
    stays open until the client is closed."""

    protocol_version = "HTTP/1.1"
    body = b'{"operation_id": "op-1", "state": "planned", "version": 1}'

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


class RecordingOperation(KeepAliveOperation):
    """The same answer, with a cookie set; each request's path and Cookie header kept."""

    seen: list[tuple[str, str | None]] = []

    def do_GET(self):
        self.seen.append((self.path, self.headers.get("Cookie")))
        self.send_response(200)
        self.send_header("Set-Cookie", "sticky=node-1; Path=/")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)


def test_requests_go_under_the_ledgers_path_and_send_no_cookie_back():
    """A ledger served under a path prefix gets each request under that prefix, sync and
    async; a cookie an answer sets (the API sets none; a proxy might) is not sent back."""
    from ledger_client import Ledger

    RecordingOperation.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RecordingOperation)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/ledger/"
        with Ledger(url, key="alk_test") as ledger:
            assert ledger.operation("op-1").state == "planned"
            assert ledger.operation("op-1").state == "planned"

            async def read_twice():
                await ledger.aoperation("op-2")
                await ledger.aoperation("op-2")
                await ledger.aclose()

            asyncio.run(read_twice())
    finally:
        server.shutdown()
        server.server_close()
    expected = [(f"/ledger/api/v1/operations/{op}", None)
                for op in ("op-1", "op-1", "op-2", "op-2")]
    assert RecordingOperation.seen == expected, (
        f"expected {expected} (path, Cookie), found {RecordingOperation.seen}")


def test_the_async_transport_closes_what_it_opens():
    """One client per event loop, closed with its loop: 300 asyncio.run calls leave the
    process's open descriptors flat (a kept-alive server, so an unclosed client would hold
    a socket per loop)."""
    import os

    from ledger_client import Ledger

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), KeepAliveOperation)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ledger = Ledger(f"http://127.0.0.1:{server.server_address[1]}", key="alk_test")

    async def read():
        return (await ledger.aoperation("op-1")).state

    def open_descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    counts: dict[str, int] = {}

    def loops():
        # in a thread of its own: the suite's main thread may hold a running loop already
        # (the browser tests' Playwright), where asyncio.run refuses to start
        for _ in range(5):
            assert asyncio.run(read()) == "planned"
        counts["before"] = open_descriptors()
        for _ in range(300):
            asyncio.run(read())
        time.sleep(0.2)  # the server's threads see the closed connections
        counts["after"] = open_descriptors()

    try:
        worker = threading.Thread(target=loops)
        worker.start()
        worker.join(timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    before, after = counts["before"], counts["after"]
    assert after - before <= 3, f"expected flat descriptors, found {before} -> {after}"
    assert len(ledger._async._clients) == 0  # each closed with its loop
