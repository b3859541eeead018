"""Facts that expire (seed 003: "When should it expire?"): after its expiry a version is no
longer current for anyone acting on it. Reads leave it out, `require_current` and
`relies_on` refuse it as stale, naming the expiry, in Python and in PostgreSQL (against the
submitting transaction's now())."""

import time
from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from ledger import db_roles, facts, receipts, runs, transitions
from ledger.errors import InvalidInput, StaleFact
from ledger.models import Fact, Operation
from ledger.states import State
from tests.conftest import TEST_LOGINS
from tests.support.processes import run_as

pytestmark = pytest.mark.django_db

SHORT = timedelta(milliseconds=300)


def expire():
    """Wait until a fact written with `ttl=SHORT` before the call has expired."""
    time.sleep(SHORT.total_seconds() + 0.1)


def test_a_fact_carries_its_expiry_from_ttl_or_expires_at():
    before = timezone.now()
    by_ttl = facts.assert_fact("customer:1", "email", "a@x.example", source="crm",
                               ttl=timedelta(hours=1))
    assert before + timedelta(hours=1) <= by_ttl.expires_at <= timezone.now() + timedelta(
        hours=1)
    at = timezone.now() + timedelta(days=2)
    by_time = facts.assert_fact("customer:1", "phone", "+1 555", source="crm", expires_at=at)
    assert Fact.objects.get(pk=by_time.pk).expires_at == at
    never = facts.assert_fact("customer:1", "name", "Ada", source="crm")
    assert never.expires_at is None and not never.is_expired
    assert [f.predicate for f in facts.read_facts("customer:1")] == ["email", "name", "phone"]


@pytest.mark.parametrize("kwargs, says", [
    ({"ttl": timedelta(0)}, "expected ttl to be a timedelta above 0"),
    ({"ttl": 30}, "expected ttl to be a timedelta"),
    ({"expires_at": timezone.now() - timedelta(seconds=1)}, "expected expires_at after"),
    ({"expires_at": timezone.now().replace(tzinfo=None) + timedelta(hours=1)},
     "timezone-aware"),
    ({"expires_at": timezone.now() + timedelta(hours=1), "ttl": timedelta(hours=1)},
     "not both"),
])
def test_a_bad_expiry_is_refused_and_nothing_written(kwargs, says):
    with pytest.raises(InvalidInput, match=says):
        facts.assert_fact("customer:2", "email", "a@x.example", source="crm", **kwargs)
    assert not Fact.objects.exists()


def test_an_expired_fact_is_left_out_of_reads_and_refused_as_stale():
    fact = facts.assert_fact("customer:3", "address", "1 Old Road", source="crm", ttl=SHORT)
    facts.assert_fact("customer:3", "name", "Ada", source="crm")
    assert facts.require_current(fact).pk == fact.pk
    expire()
    assert [f.predicate for f in facts.read_facts("customer:3")] == ["name"]
    shown = facts.read_facts("customer:3", include_expired=True)
    assert [(f.predicate, f.is_expired) for f in shown] == [("address", True), ("name", False)]
    with pytest.raises(StaleFact, match="expired at") as refused:
        facts.require_current(fact)
    assert "version 1 of customer:3 address" in str(refused.value)
    assert refused.value.current.pk == fact.pk


def test_an_expired_fact_is_superseded_by_the_next_write_and_renewed_by_the_same_value():
    first = facts.assert_fact("customer:4", "plan", "gold", source="crm", ttl=SHORT)
    # Before its expiry the same value is nothing new, a different one a candidate.
    assert facts.assert_fact("customer:4", "plan", "gold", source="crm", ttl=None,
                             expires_at=first.expires_at).pk == first.pk
    assert facts.assert_fact("customer:4", "plan", "silver", source="crm").is_candidate
    expire()
    renewed = facts.assert_fact("customer:4", "plan", "gold", source="crm",
                                ttl=timedelta(hours=1))
    assert (renewed.version, renewed.is_current, renewed.is_expired) == (2, True, False)
    assert Fact.objects.get(pk=first.pk).status == "superseded"
    # A different value after an expiry needs no version: nothing current contradicts it.
    facts.assert_fact("customer:5", "plan", "gold", source="crm", ttl=SHORT)
    expire()
    moved = facts.assert_fact("customer:5", "plan", "bronze", source="crm")
    assert (moved.version, moved.value, moved.is_candidate) == (2, "bronze", False)


def test_an_action_relying_on_an_expired_fact_is_not_submitted():
    fact = facts.assert_fact("order:1", "status", "paid", source="billing", ttl=SHORT)
    op = receipts.record_intent("parcels.ship", "https://carrier.example/parcels",
                                {"order": 1}, relies_on=[fact])
    expire()
    with pytest.raises(StaleFact, match="expired at"):
        receipts.mark_submitted(op)
    op.refresh_from_db()
    assert (op.state, op.version) == (State.PLANNED, 1)
    # And recording a new intent on it is refused before anything is written.
    with pytest.raises(StaleFact, match="expired at"):
        receipts.record_intent("parcels.ship", "https://carrier.example/parcels",
                               {"order": 2}, relies_on=[fact])
    assert Operation.objects.count() == 1


def test_the_resume_view_lists_operations_blocked_by_an_expired_fact():
    run = runs.start("ship", run_id="run-expiring")
    runs.add_step(run, "ship")
    fact = facts.assert_fact("order:3", "status", "paid", source="billing", run=run, ttl=SHORT)
    op = receipts.record_intent("parcels.ship", "https://x.example", {"n": 3}, run=run,
                                step="ship", relies_on=[fact])
    expire()
    resumed = runs.resume("run-expiring", worker="w1")
    assert [o.operation_id for o in resumed.blocked_by_stale_facts] == [op.operation_id]
    assert [f["expired"] for f in resumed.as_dict()["facts"]] == [True]


@pytest.mark.django_db(transaction=True)
def test_postgresql_refuses_the_submission_as_the_owner_and_as_the_agent():
    """The ledger's writer without receipts' check in front of it, then raw SQL: as the
    tables' owner in this process, and as ledger_agent in a child logged in as it."""
    db_roles.apply()
    fact = facts.assert_fact("order:4", "status", "paid", source="billing", ttl=SHORT)
    op = receipts.record_intent("parcels.ship", "https://carrier.example/parcels",
                                {"order": 4}, relies_on=[fact])
    expire()
    with pytest.raises(StaleFact, match="expired at"):
        transitions.by_agent(op, State.SUBMITTED, reason="sent anyway",
                             changes={"submitted_at": op.created_at})
    with pytest.raises(IntegrityError, match="order:4 status version 1 current, expired at"), \
            transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("UPDATE ledger_operation SET state = 'submitted', version = version + 1 "
                       "WHERE id = %s", [op.pk])
    child = run_as(TEST_LOGINS["agent"], f"""
from django.db import IntegrityError, connection, transaction
from ledger import transitions
from ledger.errors import StaleFact
from ledger.models import Operation
from ledger.states import State
op = Operation.objects.get(pk={op.pk})
result = {{}}
try:
    transitions.by_agent(op, State.SUBMITTED, reason="sent anyway",
                         changes={{"submitted_at": op.created_at}})
except StaleFact as exc:
    result["writer"] = str(exc)
try:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT current_user")
        result["role"] = cursor.fetchone()[0]
        cursor.execute("UPDATE ledger_operation SET state = 'submitted', "
                       "version = version + 1 WHERE id = %s", [{op.pk}])
except IntegrityError as exc:
    result["sql"] = str(exc)
""")
    assert child["role"] == TEST_LOGINS["agent"], child
    assert "expired at" in child.get("writer", ""), child
    assert "order:4 status version 1 current, expired at" in child.get("sql", ""), child
    op.refresh_from_db()
    assert (op.state, op.version) == (State.PLANNED, 1)


@pytest.mark.django_db(transaction=True)
def test_postgresql_lets_the_submission_through_before_the_expiry():
    db_roles.apply()
    fact = facts.assert_fact("order:5", "status", "paid", source="billing",
                             ttl=timedelta(hours=1))
    op = receipts.record_intent("parcels.ship", "https://carrier.example/parcels",
                                {"order": 5}, relies_on=[fact])
    child = run_as(TEST_LOGINS["agent"], f"""
from ledger import receipts
from ledger.models import Operation
result = {{"state": receipts.mark_submitted(Operation.objects.get(pk={op.pk})).state}}
""")
    assert child == {"state": "submitted"}


def test_the_record_link_covers_an_expiry_and_leaves_the_column_out_while_null():
    """A fact with an expiry has it under its record link; one without has the content it
    had before the column existed (the links of facts written before it still verify)."""
    from ledger.models import RecordLink

    lasting = facts.assert_fact("order:6", "status", "paid", source="billing")
    expiring = facts.assert_fact("order:6", "carrier", "dhl", source="billing",
                                 ttl=timedelta(hours=1))
    links = {link.row_id: link.content for link in RecordLink.objects.filter(
        source="fact", action="insert", row_id__in=[lasting.pk, expiring.pk])}
    assert "expires_at" not in links[lasting.pk] and "run_id" in links[lasting.pk]
    assert len(links[expiring.pk]["expires_at"]) == 64
    assert set(links[expiring.pk]) - set(links[lasting.pk]) == {"expires_at"}
