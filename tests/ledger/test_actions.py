"""@receipts.action over sync and async functions, retries_due, and `manage.py retries`."""

import asyncio
import signal
from datetime import timedelta
from io import StringIO

import pytest
from asgiref.sync import sync_to_async
from django.core.management import call_command
from django.db import connections

from ledger import receipts, reconcile, runs
from ledger.errors import InFlight, InvalidInput, OutcomeUnknown, Rejected, UnstorableResult
from ledger.models import Operation
from ledger.states import State
from tests.support.loops import run_coroutine
from tests.support.processes import spawn, wait_for_line

TARGET = "https://articles.example/api/articles"


class ClientError(Exception):
    """The service refused the request (a 4xx)."""


def make_actions(sent):
    """A sync and an async action over the same simulated effect: `sent` records each send,
    and the article's `fail` field decides how the call ends."""

    def effect(article):
        sent.append(article["slug"])
        if article.get("fail") == "timeout":
            raise TimeoutError("read timed out")
        if article.get("fail") == "reject":
            raise ClientError("422 slug taken")
        if article.get("fail") == "secret":
            return {"id": f"a-{len(sent)}", "token": "tok-123",
                    "link": "https://u:hunter2@cms.example/a"}
        if article.get("fail") == "not-json":
            return {"id": f"a-{len(sent)}", "tags": {"a", "b"}}
        return {"id": f"a-{len(sent)}", "slug": article["slug"]}

    @receipts.action("articles.create", target=TARGET, key=lambda article: article["slug"],
                     rejections=(ClientError,), external_id=lambda result: result["id"])
    def create(article: dict) -> dict:
        return effect(article)

    @receipts.action("articles.acreate", target=TARGET, key=lambda article: article["slug"],
                     rejections=(ClientError,), external_id=lambda result: result["id"])
    async def acreate(article: dict) -> dict:
        await asyncio.sleep(0)
        return effect(article)

    return create, acreate


def call(fn, *args):
    result = fn(*args)
    if not asyncio.iscoroutine(result):
        return result

    async def run_and_close():
        try:
            return await result
        finally:
            # The ledger's worker thread keeps its connection; close it for the test database.
            await sync_to_async(connections.close_all)()

    return run_coroutine(run_and_close())


@pytest.fixture(params=["sync", "async"])
def kit(request):
    sent = []
    create, acreate = make_actions(sent)
    return (create if request.param == "sync" else acreate), sent


def op_of(fn, key):
    return Operation.objects.get(operation=fn.operation_name, idempotency_key=key)


@pytest.mark.django_db(transaction=True)
def test_one_send_per_key_across_repeats_and_the_stored_result_is_returned(kit):
    fn, sent = kit
    first = call(fn, {"slug": "hello", "title": "Hello"})
    again = call(fn, {"slug": "hello", "title": "Hello"})
    assert first == again == {"id": "a-1", "slug": "hello"}
    assert sent == ["hello"]
    op = op_of(fn, "hello")
    assert (op.state, op.attempt, op.external_id) == (State.SUCCEEDED, 1, "a-1")
    assert op.result == {"id": "a-1", "slug": "hello"}
    assert op.intent == {"article": {"slug": "hello", "title": "Hello"}}


@pytest.mark.django_db(transaction=True)
def test_a_timeout_is_outcome_unknown_and_the_next_call_raises_without_sending(kit):
    fn, sent = kit
    with pytest.raises(TimeoutError):
        call(fn, {"slug": "slow", "fail": "timeout"})
    op = op_of(fn, "slow")
    assert (op.state, op.error_code) == (State.OUTCOME_UNKNOWN, "TimeoutError")
    with pytest.raises(OutcomeUnknown, match="found outcome_unknown") as caught:
        call(fn, {"slug": "slow", "fail": "timeout"})
    assert caught.value.operation.operation_id == op.operation_id
    assert sent == ["slow"]


@pytest.mark.django_db(transaction=True)
def test_a_rejection_is_recorded_and_raised_as_rejected_next_time(kit):
    fn, sent = kit
    with pytest.raises(ClientError):
        call(fn, {"slug": "taken", "fail": "reject"})
    with pytest.raises(Rejected, match="with code ClientError") as caught:
        call(fn, {"slug": "taken", "fail": "reject"})
    assert caught.value.operation.state == State.REJECTED
    assert caught.value.operation.error_code == "ClientError"
    assert sent == ["taken"]


@pytest.mark.django_db(transaction=True)
def test_a_safe_to_retry_operation_is_resent_as_attempt_two_with_the_same_key(kit, reviewer):
    fn, sent = kit
    with pytest.raises(TimeoutError):
        call(fn, {"slug": "again", "fail": "timeout"})
    op = op_of(fn, "again")
    receipts.resolve(op, State.SAFE_TO_RETRY, user=reviewer, reason="not in the CMS")
    assert list(receipts.retries_due(operation=fn.operation_name)) == [op]
    # The fingerprint is of the intent: the retry must carry the same arguments.
    with pytest.raises(TimeoutError):
        call(fn, {"slug": "again", "fail": "timeout"})
    op.refresh_from_db()
    assert (op.state, op.attempt) == (State.OUTCOME_UNKNOWN, 2)
    assert sent == ["again", "again"]
    assert Operation.objects.filter(idempotency_key="again").count() == 1


@pytest.mark.django_db(transaction=True)
def test_secrets_in_the_result_are_redacted_before_storage(kit):
    fn, _ = kit
    returned = call(fn, {"slug": "s", "fail": "secret"})
    assert returned["token"] == "tok-123"   # the caller gets what the service said
    stored = op_of(fn, "s").result
    assert stored["token"] == "[redacted]"
    assert "hunter2" not in stored["link"]
    assert "tok-123" not in str(Operation.objects.filter(result__isnull=False).values("result"))


@pytest.mark.django_db(transaction=True)
def test_a_result_that_is_not_json_is_recorded_as_succeeded_and_handed_back_on_the_error(kit):
    fn, sent = kit
    with pytest.raises(UnstorableResult, match="recorded as succeeded") as caught:
        call(fn, {"slug": "set", "fail": "not-json"})
    assert caught.value.value["tags"] == {"a", "b"}          # nothing lost
    op = op_of(fn, "set")
    assert (op.state, op.external_id, op.result) == (State.SUCCEEDED, "a-1", None)
    assert "set" in op.result_unstorable
    with pytest.raises(UnstorableResult, match="found none"):
        call(fn, {"slug": "set", "fail": "not-json"})
    assert sent == ["set"]


@pytest.mark.django_db(transaction=True)
def test_arguments_that_are_not_json_are_refused_before_anything_is_recorded(kit):
    fn, sent = kit
    with pytest.raises(InvalidInput, match="intent"):
        call(fn, {"slug": "x", "when": object()})
    assert sent == [] and not Operation.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_an_action_without_a_key_outside_a_step_scope_is_refused():
    @receipts.action("articles.create", target=TARGET)
    def create(article: dict) -> dict:
        raise AssertionError("must not be called")

    with pytest.raises(InvalidInput, match="expected a key for action articles.create"):
        create({"slug": "x"})
    assert not Operation.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_inside_a_step_scope_the_key_derives_from_run_and_step():
    sent = []

    @receipts.action("articles.create", target=TARGET)
    def create(article: dict, *, draft: bool = False) -> dict:
        sent.append(article)
        return {"id": "a-1"}

    run = runs.start("publish", run_id="run-1")
    runs.add_step(run, "write")
    for _ in range(2):
        with receipts.step_scope(run, "write"):
            assert create({"slug": "x"}) == {"id": "a-1"}
    op = Operation.objects.get()
    assert op.idempotency_key == receipts.idempotency_key("run-1", "write")
    assert (op.run.run_id, op.step.step_id) == ("run-1", "write")
    assert op.intent == {"article": {"slug": "x"}, "draft": False}   # defaults applied
    assert len(sent) == 1


@pytest.mark.django_db(transaction=True)
def test_a_crash_between_send_and_record_is_never_sent_again():
    child = spawn(
        """
        import time
        from ledger import receipts

        @receipts.action("articles.create", target="t", key=lambda article: article["slug"])
        def create(article):
            print("SENT", flush=True)
            time.sleep(60)   # the response never comes back: killed here

        create({"slug": "crash"})
        """
    )
    wait_for_line(child, "SENT")
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    op = Operation.objects.get(idempotency_key="crash")
    assert op.state == State.SUBMITTED

    sent = []

    @receipts.action("articles.create", target="t", key=lambda article: article["slug"])
    def create(article):
        sent.append(article)

    with pytest.raises(InFlight, match="found it submitted since") as in_flight:
        create({"slug": "crash"})
    assert isinstance(in_flight.value, OutcomeUnknown)  # what existing callers catch
    assert reconcile.sweep_stale_submissions(older_than=timedelta(0)) == 1
    with pytest.raises(OutcomeUnknown, match="found outcome_unknown") as unknown:
        create({"slug": "crash"})
    assert not isinstance(unknown.value, InFlight)
    assert sent == []


@pytest.mark.django_db(transaction=True)
def test_manage_py_retries_lists_the_operations_safe_to_retry_oldest_first(reviewer):
    sent = []
    create, _ = make_actions(sent)
    for slug in ("b-first", "a-second"):
        with pytest.raises(TimeoutError):
            create({"slug": slug, "fail": "timeout"})
        receipts.resolve(op_of(create, slug), State.SAFE_TO_RETRY, user=reviewer,
                         reason="absent")
    create({"slug": "done"})
    assert [op.idempotency_key for op in receipts.retries_due()] == ["b-first", "a-second"]
    assert list(receipts.retries_due(tenant="other")) == []
    out = StringIO()
    call_command("retries", stdout=out)
    text = out.getvalue()
    assert text.index("key=b-first") < text.index("key=a-second")
    assert "2 operation(s) safe to retry in tenant default" in text


# --- tenant and target per call; the receipt without sending ---------------------------------


@pytest.mark.django_db(transaction=True)
def test_tenant_and_target_may_be_functions_of_the_calls_arguments():
    sent = []

    @receipts.action("nats.publish", target=lambda tenant, subject: f"nats://{subject}",
                     tenant=lambda tenant, subject: tenant,
                     key=lambda tenant, subject: subject)
    def publish(tenant: str, subject: str) -> int:
        sent.append((tenant, subject))
        return len(sent)

    assert publish("acme", "orders.1") == 1
    assert publish("globex", "orders.1") == 2
    assert publish("acme", "orders.1") == 1  # the stored result: not sent again
    assert sorted(Operation.objects.values_list("tenant", "target")) == [
        ("acme", "nats://orders.1"), ("globex", "nats://orders.1")]
    with pytest.raises(InvalidInput, match="tenant"):
        publish("", "orders.2")  # checked as a declared tenant is
    assert len(sent) == 2


@pytest.mark.django_db(transaction=True)
def test_receipt_reads_the_calls_operation_without_recording_or_sending(kit):
    fn, sent = kit
    assert call(fn.receipt, {"slug": "later"}) is None
    assert not Operation.objects.exists()
    call(fn, {"slug": "later"})
    receipt = call(fn.receipt, {"slug": "later"})
    assert (receipt.state, receipt.attempt, receipt.external_id) == (State.SUCCEEDED, 1, "a-1")
    assert sent == ["later"]


@pytest.mark.django_db(transaction=True)
def test_receipt_in_a_step_scope_names_the_last_call_made_there():
    run = runs.start("publish", run_id="r-receipt")
    runs.add_step(run, "draft")

    @receipts.action("cms.post", target=TARGET)
    def post(text: str) -> str:
        return text

    with receipts.step_scope(run, "draft"):
        assert post.receipt("a") is None
        post("a")
        assert post.receipt("a").idempotency_key == receipts.idempotency_key("r-receipt",
                                                                              "draft")
        post("b")
        assert post.receipt("b").idempotency_key == receipts.idempotency_key(
            "r-receipt", "draft", "2")
