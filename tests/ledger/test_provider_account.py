"""The provider account on the receipt: which account at the provider a call acts as.

Recorded beside the target, part of the key's identity, never changed after the insert
(PostgreSQL, as the owner and as each role), under the chain, and the account a reconciler
reads as: a positive control is an effect of the same target and account.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.utils import DatabaseError

from demo.simulated.articles import ArticleRejected, ArticlesClient, ArticlesService
from ledger import chain, receipts, reconcile
from ledger.errors import IdempotencyKeyReused, InvalidInput
from ledger.models import Evidence, Operation, OperationEvent
from ledger.states import State
from tests.conftest import TEST_LOGINS
from tests.factories import OperationFactory
from tests.support.processes import run_as

TARGET = "https://articles.example/api/articles"
CHECK, NO_PRIVILEGE = "23514", "42501"


# --- recorded, replayed, refused ------------------------------------------------------------


@pytest.mark.django_db
def test_the_account_is_recorded_beside_the_target_and_a_replay_needs_the_same_account():
    op = receipts.record_intent("mail.send", "smtp://mail.example", {"to": "a@example.com"},
                                idempotency_key="mail-1", account="ops@example.com")
    assert (op.target, op.account, op.recorded_now) == ("smtp://mail.example",
                                                        "ops@example.com", True)
    again = receipts.record_intent("mail.send", "smtp://mail.example",
                                   {"to": "a@example.com"}, idempotency_key="mail-1",
                                   account="ops@example.com")
    assert (again.pk, again.recorded_now) == (op.pk, False)

    with pytest.raises(IdempotencyKeyReused) as refused:
        receipts.record_intent("mail.send", "smtp://mail.example", {"to": "a@example.com"},
                               idempotency_key="mail-1", account="sales@example.com")
    assert ("to come with account 'ops@example.com', found 'sales@example.com'"
            in str(refused.value)), refused.value
    assert Operation.objects.filter(idempotency_key="mail-1").count() == 1


@pytest.mark.django_db
def test_an_account_is_a_label_never_a_credential():
    op = OperationFactory(account="https://bot:hunter2@acct.example/")
    assert "hunter2" not in op.account and "[redacted]" in op.account
    for bad in ("x" * 201, 42, "line\nbreak"):
        with pytest.raises(InvalidInput, match="account"):
            receipts.record_intent("mail.send", TARGET, {}, account=bad)
    assert OperationFactory().account == ""


# --- never changed after the insert ---------------------------------------------------------


def _forgeries(pk: int, version: int) -> dict[str, list[str]]:
    return {
        "in place": [f"UPDATE ledger_operation SET account = 'acct_other' WHERE id = {pk}"],
        "with a transition": [
            f"WITH changed AS (UPDATE ledger_operation SET state = 'succeeded', "
            f"version = {version + 1}, state_changed_at = now(), completed_at = now(), "
            f"external_id = 'x-1', account = 'acct_other' WHERE id = {pk} AND version = "
            f"{version} RETURNING id, tenant) INSERT INTO ledger_operationevent (operation_id, "
            "tenant, version, from_state, to_state, actor_kind, actor_id, reason, created_at, "
            f"external_id) SELECT id, tenant, {version + 1}, 'submitted', 'succeeded', "
            "'agent', 'forger', 'forged', now(), 'x-1' FROM changed"],
    }


def _try(statements: list[str]) -> tuple[str, str]:
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            for sql in statements:
                cursor.execute(sql)
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    except DatabaseError as exc:
        return exc.__cause__.sqlstate, str(exc).splitlines()[0]
    return "accepted", ""


@pytest.mark.django_db
def test_the_owner_cannot_change_an_account_with_or_without_a_transition():
    op = OperationFactory(state=State.SUBMITTED, account="acct_1")
    for name, statements in _forgeries(op.pk, op.version).items():
        sqlstate, message = _try(statements)
        assert sqlstate == CHECK, (name, sqlstate, message)
        assert "account" in message, (name, message)
    op.refresh_from_db()
    assert (op.state, op.account) == (State.SUBMITTED, "acct_1")


CHILD = """
from django.db import connection, transaction
from django.db.utils import DatabaseError

def attempt(statements):
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            for sql in statements:
                cursor.execute(sql)
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    except DatabaseError as exc:
        return [exc.__cause__.sqlstate, str(exc).splitlines()[0]]
    return ["accepted", ""]

result = {name: attempt(statements) for name, statements in FORGERIES.items()}
"""


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["agent", "reconciler", "desk"])
def test_no_role_can_change_an_account(kind):
    op = OperationFactory(state=State.SUBMITTED, account="acct_1")
    found = run_as(TEST_LOGINS[kind],
                   f"FORGERIES = {_forgeries(op.pk, op.version)!r}\n" + CHILD)
    for name, (sqlstate, message) in found.items():
        # No role holds UPDATE on the column; the owner meets the trigger (above).
        assert sqlstate == NO_PRIVILEGE, (kind, name, sqlstate, message)
    op.refresh_from_db()
    assert (op.state, op.account) == (State.SUBMITTED, "acct_1")


# --- under the chain ------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_every_event_covers_the_account_and_a_rewrite_is_reported():
    op = OperationFactory(state=State.SUCCEEDED, account="acct_1")
    events = OperationEvent.objects.filter(operation=op)
    assert {(e.chain_format, e.content["account"]) for e in events} == {(5, "acct_1")}
    chain.seal()
    assert chain.verify(actor="test").is_intact
    from tests.ledger.test_verify_audit_tamper import tamper

    tamper(("UPDATE ledger_operation SET account = 'acct_2' WHERE id = %s", [op.pk]))
    result = chain.verify(actor="test")
    assert not result.is_intact
    assert "differs from its last event in account" in result.first_break.message
    assert "account 'acct_1'" in result.first_break.expected


# --- a reconciler reads as the account; its control is of the same account ------------------


def _send(service, operation, title, account, *, fault=None):
    client = ArticlesClient(service.url)
    op = receipts.record_intent(operation, TARGET, {"title": title, "body": "text"},
                                idempotency_key=f"{operation}-{uuid.uuid4().hex[:12]}",
                                account=account)
    try:
        with receipts.submit(op, rejections=(ArticleRejected,),
                             in_flight_for=timedelta(0)) as attempt:
            answer = client.create(title=title, body="text", idempotency_key=op.idempotency_key,
                                   fault=fault)
            attempt.succeeded(external_id=answer["id"])
    except (ArticleRejected, OSError):
        pass
    return Operation.objects.get(pk=op.pk)


READER = """
from ledger import reconcile, reconcilers
reconcilers.list_and_match(
    "acct.listing", items="items", match=("title", "body"),
    url=lambda op: ACCOUNTS[op.account] + "/articles?limit=50")
verdicts = []
reconcile.run_once(worker="child", on_verdict=lambda op, outcome: verdicts.append(
    [op.operation_id, outcome.verdict, op.state]))
result = verdicts
"""


@pytest.mark.django_db(transaction=True)
def test_the_control_is_the_latest_success_of_the_same_target_and_account():
    with ArticlesService() as account_a, ArticlesService() as account_b:
        control_b = _send(account_b, "acct.listing", "B's control", "acct_b")
        newer_a = _send(account_a, "acct.listing", "A's later success", "acct_a")
        lost_b = _send(account_b, "acct.listing", "B's lost one", "acct_b",
                       fault="lose_request")
        assert (control_b.state, newer_a.state, lost_b.state) == (
            State.SUCCEEDED, State.SUCCEEDED, State.OUTCOME_UNKNOWN)
        assert reconcile.latest_control(lost_b).pk == control_b.pk

        accounts = {"acct_a": account_a.url, "acct_b": account_b.url}
        verdicts = run_as(TEST_LOGINS["reconciler"],
                          f"ACCOUNTS = {accounts!r}\n" + READER)
        # Read as acct_b, backed by acct_b's own control: A's later success, which this
        # reader could never see, is not taken for a control and does not blind it.
        assert verdicts == [[lost_b.operation_id, "proven_absent", State.SAFE_TO_RETRY]], (
            Evidence.objects.get(operation=lost_b).detail)
        control = Evidence.objects.get(operation=lost_b).observed["positive_control"]
        assert (control["status"], control["control"]["operation_id"]) == (
            "seen", control_b.operation_id)

        # A reader that reads acct_b's operations as acct_a (a wrong account) is blind.
        lost_again = _send(account_b, "acct.listing", "B's second lost one", "acct_b",
                           fault="lose_request")
        wrong = {"acct_a": account_a.url, "acct_b": account_a.url}
        verdicts = run_as(TEST_LOGINS["reconciler"], f"ACCOUNTS = {wrong!r}\n" + READER)
        assert verdicts == [[lost_again.operation_id, "verifier_blind",
                             State.OUTCOME_UNKNOWN]]
        assert len(account_b.side_effects()) == 1  # the control; nothing sent again
