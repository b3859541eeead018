"""Poisoned answers stay with their operation: a reconciler that answers what cannot be stored
(a NUL, an unpaired surrogate, a huge number, a structure too deep or circular), or raises
with such a message, is a reconciler failure of that operation only; the rest of the pass
settles; and an agent's exception with such a message still records its outcome."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from ledger import receipts, reconcile
from ledger.errors import UnstorableResult
from ledger.models import Evidence, Operation
from ledger.states import State
from tests.factories import OperationFactory
from tests.support.loops import run_coroutine
from tests.support.processes import ROOT, child_env


def _circular():
    value = {"a": []}
    value["a"].append(value)
    return value


def _deep(n):
    value = []
    for _ in range(n):
        value = [value]
    return value


# What each poisoned operation's lookup does (by the `poison` in its intent).
POISONS = {
    "nul-observed": lambda: reconcile.Found("ext-1", {"note": "a\x00b"}),
    "surrogate-observed": lambda: reconcile.NotYet({"seen": "\ud800"}),
    "nul-key": lambda: reconcile.ProvenAbsent({"k\x00": 1}),
    "huge-number": lambda: reconcile.ProvenAbsent({"count": 10**5000}),
    "deep": lambda: reconcile.Found("ext-1", {"body": _deep(10_000)}),
    "circular": lambda: reconcile.Found("ext-1", _circular()),
    "nul-external-id": lambda: reconcile.Found("ext\x00-1"),
    "surrogate-query": lambda: reconcile.Found("ext-1", query={"q": "\udc80"}),
    "raises-nul": lambda: (_ for _ in ()).throw(ConnectionError("reset\x00 by peer")),
    "raises-surrogate": lambda: (_ for _ in ()).throw(ValueError("bad \ud800 byte")),
    "raises-huge-number": lambda: (_ for _ in ()).throw(OverflowError(str(10**4000)[:10])),
}


@reconcile.register("test.poisoned")
class Poisoned(reconcile.Reconciler):
    backoff_initial = timedelta(0)
    backoff_max = timedelta(0)
    grace_period = timedelta(days=1)

    def lookup(self, op):
        poison = op.intent.get("poison")
        if poison is None:
            return reconcile.Found(f"ext-{op.intent['n']}", {"status": "published"})
        return POISONS[poison]()


class _Unstorable(reconcile.Reconciler):
    """Answers a plain Found, but its name holds a NUL: the Evidence row (which names the
    reconciler) cannot be stored, though the gate saw nothing wrong with the verdict."""

    name = "unstorable\x00reconciler"
    backoff_initial = timedelta(0)
    backoff_max = timedelta(0)

    def lookup(self, op):
        return reconcile.Found("ext-unstorable")


@pytest.fixture
def unstorable_reconciler():
    reconcile.register("test.unstorable")(_Unstorable)
    yield
    reconcile.unregister("test.unstorable")


def _unknown(operation="test.poisoned", **intent):
    return OperationFactory(state=State.OUTCOME_UNKNOWN, operation=operation, intent=intent)


@pytest.mark.django_db
def test_poisoned_answers_fail_their_own_operation_and_healthy_ones_settle_in_one_pass(
        settings, unstorable_reconciler):
    settings.LEDGER_RECONCILE_MAX_FAILURES = 2
    # Poisoned first: the claim order would reach them before the healthy ones.
    poisoned = {name: _unknown(poison=name) for name in POISONS}
    poisoned["unstorable"] = _unknown(operation="test.unstorable", n=0)
    healthy = [_unknown(n=n) for n in range(3)]

    assert reconcile.run_once(worker="w1") == len(healthy)
    for n, op in enumerate(healthy):
        op.refresh_from_db()
        assert (op.state, op.external_id) == (State.SUCCEEDED, f"ext-{n}")
    for name, op in poisoned.items():
        op.refresh_from_db()
        assert (op.state, op.reconcile_failures) == (State.OUTCOME_UNKNOWN, 1), name
        [evidence] = Evidence.objects.filter(operation=op)
        assert evidence.verdict == reconcile.ERROR, name
        assert evidence.observed["error"] and evidence.detail, name

    # The second failure reaches the limit: a person decides, with the evidence of both.
    assert reconcile.run_once(worker="w1") == len(poisoned)
    for name, op in poisoned.items():
        op.refresh_from_db()
        assert (op.state, op.reconcile_failures) == (State.MANUAL_REVIEW, 2), name
        assert Evidence.objects.filter(operation=op, verdict=reconcile.ERROR).count() == 2
    assert not Operation.objects.filter(state=State.RECONCILING).exists()


@pytest.mark.django_db
def test_the_evidence_of_a_poisoned_answer_says_what_was_wrong_and_where():
    nul = _unknown(poison="nul-observed")
    huge = _unknown(poison="huge-number")
    raised = _unknown(poison="raises-nul")
    reconcile.run_once(worker="w1")
    [evidence] = Evidence.objects.filter(operation=nul)
    assert "observed.note" in evidence.detail and "NUL" in evidence.detail
    [evidence] = Evidence.objects.filter(operation=huge)
    assert "observed.count" in evidence.detail and "digits" in evidence.detail
    [evidence] = Evidence.objects.filter(operation=raised)
    assert evidence.observed == {"error": "ConnectionError",
                                 "message": "ConnectionError: reset\ufffd by peer"}


@pytest.mark.django_db
def test_a_verdict_that_cannot_be_stored_is_recorded_as_a_failure(unstorable_reconciler):
    op = _unknown(operation="test.unstorable", n=0)
    assert reconcile.run_once(worker="w1") == 0
    op.refresh_from_db()
    assert (op.state, op.reconcile_failures) == (State.OUTCOME_UNKNOWN, 1)
    [evidence] = Evidence.objects.filter(operation=op)
    assert evidence.verdict == reconcile.ERROR
    assert evidence.reconciler == "unstorable\ufffdreconciler"
    assert evidence.observed["verdict"] == reconcile.FOUND
    assert "could not be stored" in evidence.detail


@pytest.mark.django_db
def test_an_ambiguous_reason_with_a_nul_is_recorded_not_counted_as_a_failure():
    @reconcile.register("test.ambiguous-nul")
    class Unsure(reconcile.Reconciler):
        def lookup(self, op):
            return reconcile.Ambiguous(reason="two\x00matches")

    try:
        op = _unknown(operation="test.ambiguous-nul")
        assert reconcile.run_once(worker="w1") == 1
    finally:
        reconcile.unregister("test.ambiguous-nul")
    op.refresh_from_db()
    assert (op.state, op.reconcile_failures) == (State.MANUAL_REVIEW, 0)
    assert "two\ufffdmatches" in Evidence.objects.get(operation=op).detail


# --- reconcile --once tells its caller when a worker crashed (real processes) ----------------

_CHILD = """
import os, sys
sys.path.insert(0, {root!r})
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
import django
django.setup()
from django.core.management import ManagementUtility
from django.db import connection
from ledger import reconcile

@reconcile.register("test.poisoned")
class Crashes(reconcile.Reconciler):
    def lookup(self, op):
        if {crash}:
            # The ledger's own database goes away mid-pass: not the reconciler's failure.
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        return reconcile.Found("ext-child")

ManagementUtility(["manage.py", "reconcile", "--once"]).execute()
"""


def _run_reconcile_once(crash: bool):
    import subprocess

    source = textwrap.dedent(_CHILD).format(root=str(ROOT), crash=crash)
    return subprocess.run([sys.executable, "-c", source], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.django_db(transaction=True)
def test_reconcile_once_exits_non_zero_when_a_worker_crashed():
    op = _unknown(n=1)
    child = _run_reconcile_once(crash=True)
    assert child.returncode != 0, child.stdout + child.stderr
    assert "crashed" in child.stderr
    op.refresh_from_db()
    # Left under its lease (no longer: the next pass after it expires takes it over).
    assert op.state == State.RECONCILING

    healthy = _unknown(n=2)  # the crashed one's lease is still live: this run skips it
    child = _run_reconcile_once(crash=False)
    assert child.returncode == 0, child.stdout + child.stderr
    healthy.refresh_from_db()
    assert healthy.state == State.SUCCEEDED


# --- an agent's exception whose message cannot be stored as it is --------------------------

BAD_MESSAGES = {"nul": ("reset\x00 by peer", "reset\ufffd by peer"),
                "surrogate": ("bad \ud800 byte", "bad \ufffd byte")}


@pytest.mark.django_db
@pytest.mark.parametrize("message, stored", BAD_MESSAGES.values(), ids=BAD_MESSAGES.keys())
def test_submit_records_the_outcome_and_reraises_the_agents_own_exception(message, stored):
    op = receipts.record_intent("articles.create", "svc://a", {"t": message.encode(
        "utf-8", "surrogatepass").hex()})
    error = OSError(message)
    with pytest.raises(OSError) as raised, receipts.submit(op):
        raise error
    assert raised.value is error
    op.refresh_from_db()
    assert (op.state, op.error_code, op.error_detail) == (
        State.OUTCOME_UNKNOWN, "OSError", stored)

    rejected = receipts.record_intent("articles.create", "svc://a", {"t": "r"})
    with pytest.raises(PermissionError), receipts.submit(rejected, (PermissionError,)):
        raise PermissionError(message)
    rejected.refresh_from_db()
    assert (rejected.state, rejected.error_detail) == (State.REJECTED, stored)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("message, stored", BAD_MESSAGES.values(), ids=BAD_MESSAGES.keys())
def test_asubmit_records_the_outcome_and_reraises_the_agents_own_exception(message, stored):
    op = receipts.record_intent("articles.create", "svc://a", {"t": "async"})
    error = ConnectionResetError(message)

    async def agent():
        try:
            async with receipts.asubmit(op):
                await asyncio.sleep(0)
                raise error
        finally:
            await sync_to_async(connections.close_all)()

    with pytest.raises(ConnectionResetError) as raised:
        run_coroutine(agent())
    assert raised.value is error
    op.refresh_from_db()
    assert (op.state, op.error_detail) == (State.OUTCOME_UNKNOWN, stored)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("message, stored", BAD_MESSAGES.values(), ids=BAD_MESSAGES.keys())
def test_the_action_decorator_records_the_outcome_and_reraises_sync_and_async(message, stored):
    error = TimeoutError(message)

    @receipts.action("articles.create", target="svc://a", key=lambda slug: slug)
    def create(slug):
        raise error

    @receipts.action("articles.create", target="svc://a", key=lambda slug: slug)
    async def acreate(slug):
        raise error

    with pytest.raises(TimeoutError) as raised:
        create("sync-1")
    assert raised.value is error
    async def agent():
        try:
            await acreate("async-1")
        finally:
            await sync_to_async(connections.close_all)()

    with pytest.raises(TimeoutError) as raised:
        run_coroutine(agent())
    assert raised.value is error
    for key in ("sync-1", "async-1"):
        op = Operation.objects.get(idempotency_key=key)
        assert (op.state, op.error_code, op.error_detail) == (
            State.OUTCOME_UNKNOWN, "TimeoutError", stored)


@pytest.mark.django_db
def test_an_external_id_the_decorator_extracts_is_recorded_storable():
    @receipts.action("articles.create", target="svc://a", key=lambda slug: slug,
                     external_id=lambda value: value["id"])
    def create(slug):
        return {"ok": True, "id": "art\x00-1"}

    # The result itself holds the NUL: not stored, and said so; the success and its id are.
    with pytest.raises(UnstorableResult) as unstorable:
        create("ext-nul")
    assert unstorable.value.value == {"ok": True, "id": "art\x00-1"}
    op = Operation.objects.get(idempotency_key="ext-nul")
    assert (op.state, op.external_id) == (State.SUCCEEDED, "art\ufffd-1")
    assert "result.id" in op.result_unstorable and "NUL" in op.result_unstorable
