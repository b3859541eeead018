"""`relies_on`: an action is bound to the fact versions it was planned on; once one is
superseded it is not sent (DESIGN "A receipt you can prove"; the stale-fact test of the
state article, seeds/001_...)."""

import pytest
from django.db import IntegrityError, ProgrammingError, connection

from ledger import db_roles, facts, receipts, runs, transitions
from ledger.errors import InvalidInput, StaleFact
from ledger.models import Operation, OperationEvent
from ledger.states import State

pytestmark = pytest.mark.django_db


def test_an_action_planned_on_a_superseded_fact_is_not_sent_through_the_decorator():
    """Write a fact, supersede it, and hand the agent a context holding only the old
    version: the agent must not act on it, even though it never calls require_current."""
    address = facts.assert_fact("customer:42", "shipping_address", "1 Old Road",
                                source="crm")
    context = {"address": address}  # what the agent was given: the old version only
    facts.assert_fact("customer:42", "shipping_address", "2 New Street", source="crm",
                      expected_version=1)
    shipped = []

    @receipts.action("parcels.ship", target="https://carrier.example/parcels",
                     key=lambda order, address: order,
                     relies_on=lambda order, address: [context["address"]])
    def ship(order: str, address: str) -> dict:
        shipped.append(address)
        return {"id": f"parcel-{order}"}

    with pytest.raises(StaleFact) as refused:
        ship("order-7", context["address"].value)
    assert shipped == []
    assert refused.value.current.value == "2 New Street"
    assert "version 1 of customer:42 shipping_address" in str(refused.value)
    assert not Operation.objects.filter(state=State.SUBMITTED).exists()

    # Re-read, and the same call on the current version goes out.
    context["address"] = facts.require_current(refused.value.current)
    assert ship("order-8", context["address"].value) == {"id": "parcel-order-8"}
    assert shipped == ["2 New Street"]


def test_the_versions_relied_on_are_stored_and_mark_submitted_refuses_once_one_is_superseded():
    fact = facts.assert_fact("order:9", "status", "paid", source="billing")
    op = receipts.record_intent("parcels.ship", "https://carrier.example/parcels",
                                {"order": 9}, relies_on=[fact])
    assert Operation.objects.get(pk=op.pk).relies_on == [fact.pk]
    newer = facts.assert_fact("order:9", "status", "refunded", source="billing",
                              expected_version=1)
    with pytest.raises(StaleFact) as refused:
        receipts.mark_submitted(op)
    assert refused.value.current.pk == newer.pk
    op.refresh_from_db()
    assert (op.state, op.version) == (State.PLANNED, 1)
    assert OperationEvent.objects.filter(operation=op).count() == 1


@pytest.mark.django_db(transaction=True)
def test_postgresql_refuses_the_submission_as_the_agent_role():
    db_roles.apply()
    fact = facts.assert_fact("order:10", "status", "paid", source="billing")
    op = receipts.record_intent("parcels.ship", "https://carrier.example/parcels",
                                {"order": 10}, relies_on=[fact])
    facts.assert_fact("order:10", "status", "refunded", source="billing", expected_version=1)
    with connection.cursor() as cursor:
        cursor.execute(f"SET ROLE {db_roles.ROLE[db_roles.AGENT]}")
    try:
        # The ledger's own writer, without receipts' check in front of it.
        with pytest.raises(StaleFact, match="order:10 status"):
            transitions.by_agent(op, State.SUBMITTED, reason="sent anyway",
                                 changes={"submitted_at": op.created_at})
        with pytest.raises(ProgrammingError, match="permission denied"), \
                connection.cursor() as cursor:
            cursor.execute("UPDATE ledger_operation SET relies_on = '[]' WHERE id = %s",
                           [op.pk])
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET ROLE")
    # Not even the tables' owner changes what a receipt relied on.
    with pytest.raises(IntegrityError, match="relies on"), connection.cursor() as cursor:
        cursor.execute("UPDATE ledger_operation SET relies_on = '[]' WHERE id = %s", [op.pk])
    op.refresh_from_db()
    assert (op.state, op.relies_on) == (State.PLANNED, [fact.pk])


def test_relies_on_is_checked_before_anything_is_written():
    fact = facts.assert_fact("order:11", "status", "paid", source="billing")
    for bad in ([fact.pk], ["order:11"], fact):
        with pytest.raises(InvalidInput, match="relies_on"):
            receipts.record_intent("parcels.ship", "https://x.example", {"n": 1},
                                   relies_on=bad)
    newer = facts.assert_fact("order:11", "status", "late", source="billing",
                              expected_version=1)
    with pytest.raises(StaleFact):
        receipts.record_intent("parcels.ship", "https://x.example", {"n": 1},
                               relies_on=[fact])
    assert not Operation.objects.exists()
    assert newer.is_current


def test_the_resume_view_lists_operations_blocked_by_stale_facts():
    run = runs.start("ship", run_id="run-stale")
    runs.add_step(run, "ship")
    runs.add_step(run, "bill")
    fact = facts.assert_fact("order:12", "status", "paid", source="billing", run=run)
    op = receipts.record_intent("parcels.ship", "https://x.example", {"n": 12}, run=run,
                                step="ship", relies_on=[fact])
    fresh = receipts.record_intent("invoices.send", "https://x.example", {"n": 12}, run=run,
                                   step="bill", relies_on=[
                                       facts.assert_fact("order:12", "email", "a@x.example",
                                                         source="crm")])
    facts.assert_fact("order:12", "status", "refunded", source="billing", expected_version=1)
    resumed = runs.resume("run-stale", worker="w1")
    assert [o.operation_id for o in resumed.blocked_by_stale_facts] == [op.operation_id]
    assert fresh.operation_id in [o.operation_id for o in resumed.open_operations]
    data = resumed.as_dict()
    assert [o["operation_id"] for o in data["blocked_by_stale_facts"]] == [op.operation_id]
    # Each open operation names the versions it relied on, and whether each is current.
    relied = {o["operation_id"]: o["relied_on"] for o in data["open_operations"]}
    assert relied[op.operation_id] == [
        {"subject": "order:12", "predicate": "status", "version": 1, "current": False}]
    assert relied[fresh.operation_id] == [
        {"subject": "order:12", "predicate": "email", "version": 1, "current": True}]


def test_the_desk_shows_what_an_operation_relied_on(client):
    from tests.factories import UserFactory

    fact = facts.assert_fact("order:13", "status", "paid", source="billing")
    op = receipts.record_intent("parcels.ship", "https://x.example", {"n": 13},
                                relies_on=[fact])
    facts.assert_fact("order:13", "status", "refunded", source="billing", expected_version=1)
    client.force_login(UserFactory(username="viewer-13", role="viewer", is_superuser=True))
    page = client.get(f"/operations/{op.operation_id}/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "Relied on" in text and "order:13" in text and "superseded: stale" in text
