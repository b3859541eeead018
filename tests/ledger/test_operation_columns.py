"""No column of an operation changes but through a transition that writes its event in the
same statement, checked by PostgreSQL column by column (issue 30, gap 2).

The finding: as the application's role, `external_id`, `in_flight_until` and `attempt` of a
submitted operation were rewritten in place, with no event. Each forgery below is raw SQL,
refused as the tables' owner with every trigger on, and from child processes logged in as
the agent's and the reconciler's roles; a well-formed transition written the same way (the
row and its event in one statement) is accepted, so what refuses a forgery is what it gets
wrong. The ledger's own writers are the rest of the suite (receipts, reconcile, the desk's
decisions and flags, the sweep, retention's redaction, intent edits).
"""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.db.utils import DatabaseError

from ledger.models import Operation
from ledger.states import State
from tests.conftest import TEST_LOGINS
from tests.factories import OperationFactory
from tests.support.processes import run_as

CHECK = "23514"

_EVENT = ("INSERT INTO ledger_operationevent (operation_id, tenant, version, from_state, "
          "to_state, actor_kind, actor_id, reason, created_at, chain_format, external_id) ")


def _transition(pk: int, version: int, *, sets: str, to_state: str, event_external_id: str
                ) -> str:
    """One statement: the row's change at `version` and its event (what transitions do)."""
    return (f"WITH changed AS (UPDATE ledger_operation SET state = '{to_state}', "
            f"version = {version + 1}, state_changed_at = now(){sets} "
            f"WHERE id = {pk} AND version = {version} RETURNING id, tenant) "
            + _EVENT + f"SELECT id, tenant, {version + 1}, 'submitted', '{to_state}', 'agent', "
            f"'forger', 'forged', now(), 2, '{event_external_id}' FROM changed")


def forgeries(pk: int, version: int) -> dict[str, tuple[list[str], str]]:
    """name -> (statements, what the refusal names), against submitted operation `pk`."""
    no_event = "expected a change of its columns to be a transition with its event"
    return {
        "external_id in place": (
            [f"UPDATE ledger_operation SET external_id = 'forged' WHERE id = {pk}"], no_event),
        "in_flight_until in place": (
            [f"UPDATE ledger_operation SET in_flight_until = now() + interval '1 day' "
             f"WHERE id = {pk}"], no_event),
        "attempt in place": (
            [f"UPDATE ledger_operation SET attempt = attempt + 1 WHERE id = {pk}"], no_event),
        "event in another statement": (
            [_EVENT + f"SELECT id, tenant, {version + 1}, 'submitted', 'succeeded', 'agent', "
             f"'forger', 'forged', now(), 2, 'forged' FROM ledger_operation WHERE id = {pk}",
             f"UPDATE ledger_operation SET state = 'succeeded', version = {version + 1}, "
             f"external_id = 'forged', completed_at = now() WHERE id = {pk}"],
            "found one written by another statement"),
        "a column the move does not change": (
            [_transition(pk, version, to_state=State.OUTCOME_UNKNOWN, event_external_id="",
                         sets=", unknown_since = now(), attempt = attempt + 4")],
            "to change only what that move changes, found it changing attempt"),
        "an event of another external id": (
            [_transition(pk, version, to_state=State.SUCCEEDED, event_external_id="real",
                         sets=", completed_at = now(), external_id = 'forged'")],
            "found an event of submitted -> succeeded, external_id 'real'"),
    }


def accepted(pk: int, version: int) -> list[str]:
    """The well-formed transition: submitted -> succeeded with its event, one statement."""
    return [_transition(pk, version, to_state=State.SUCCEEDED, event_external_id="ext-1",
                        sets=", completed_at = now(), external_id = 'ext-1'")]


# The child's side: each forgery in its own transaction, checks deferred to the commit
# included; the accepted one is rolled back.
CHILD = """
from django.db import connection, transaction
from django.db.utils import DatabaseError

class Rollback(Exception):
    pass

def attempt(statements, keep=False):
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            for sql in statements:
                cursor.execute(sql)
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
            raise Rollback
    except Rollback:
        return ["accepted", ""]
    except DatabaseError as exc:
        return [exc.__cause__.sqlstate, str(exc).splitlines()[0]]

result = {name: attempt(statements) for name, (statements, _) in FORGERIES.items()}
result["accepted"] = attempt(ACCEPTED)
"""


def _try(statements: list[str]) -> tuple[str, str]:
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            for sql in statements:
                cursor.execute(sql)
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # what COMMIT would check
    except DatabaseError as exc:
        return exc.__cause__.sqlstate, str(exc).splitlines()[0]
    return "accepted", ""


def _row(pk: int) -> tuple:
    with connection.cursor() as cursor:
        cursor.execute("SELECT t::text FROM ledger_operation t WHERE id = %s", [pk])
        return cursor.fetchone()


@pytest.mark.django_db
def test_the_owner_with_every_trigger_on_cannot_change_a_column_without_its_event():
    submitted = OperationFactory(state=State.SUBMITTED)
    before = _row(submitted.pk)
    for name, (statements, names) in forgeries(submitted.pk, submitted.version).items():
        sqlstate, message = _try(statements)
        assert (sqlstate, names in message) == (CHECK, True), (name, sqlstate, message)
        assert f"operation {submitted.operation_id}" in message, (name, message)
        assert _row(submitted.pk) == before, name
    assert _try(accepted(submitted.pk, submitted.version)) == ("accepted", "")
    done = Operation.objects.get(pk=submitted.pk)
    assert (done.state, done.external_id, done.version) == (
        State.SUCCEEDED, "ext-1", submitted.version + 1)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["agent", "reconciler"])
def test_the_application_s_roles_cannot_change_a_column_without_its_event(kind):
    submitted = OperationFactory(state=State.SUBMITTED)
    before = _row(submitted.pk)
    cases = forgeries(submitted.pk, submitted.version)
    well_formed = accepted(submitted.pk, submitted.version)
    found = run_as(TEST_LOGINS[kind],
                   f"FORGERIES = {cases!r}\nACCEPTED = {well_formed!r}\n" + CHILD)
    for name, (_, names) in cases.items():
        sqlstate, message = found[name]
        assert (sqlstate, names in message) == (CHECK, True), (kind, name, found[name])
    assert found["accepted"] == ["accepted", ""], found["accepted"]
    assert _row(submitted.pk) == before
