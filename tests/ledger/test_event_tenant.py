"""An event's tenant is its operation's, checked by PostgreSQL at the event's insert (the
trigger `event_chain_columns`, which reads the operation's row for the event's content
anyway; migration 0055), for the tables' owner and for every role's login, through raw SQL.
The ledger's own writes, which record an operation and its first event in one statement,
pass the same check."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.db.utils import ProgrammingError

from ledger import receipts
from ledger.models import OperationEvent
from tests.conftest import TEST_LOGINS
from tests.factories import OperationFactory
from tests.support.processes import run_as

pytestmark = pytest.mark.django_db(transaction=True)

INSERT = ("INSERT INTO ledger_operationevent (operation_id, tenant, from_state, to_state, "
          "actor_kind, actor_id, reason, evidence, created_at, version) "
          "VALUES (%s, %s, 'planned', 'planned', 'agent', 'a', '', '{}', now(), 99)")


def test_the_owner_cannot_write_an_event_into_another_tenant_at_the_insert_itself():
    op = OperationFactory(tenant="acme")
    with pytest.raises(ProgrammingError) as refused, transaction.atomic():
        with connection.cursor() as cursor:
            # refused by this statement, not later at commit: nothing after it runs
            cursor.execute(INSERT, [op.pk, "globex"])
            pytest.fail("expected the INSERT itself refused, found it accepted")
    assert refused.value.__cause__.sqlstate == "42501"
    assert ("expected its operation's tenant, found globex on the event and acme on an "
            "operation this session may see") in str(refused.value)
    assert not OperationEvent.objects.filter(operation=op, version=99).exists()


def test_an_event_of_no_operation_is_refused_the_same_way():
    with pytest.raises(ProgrammingError) as refused, transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(INSERT, [2**40, "acme"])
    assert "found acme on the event and none on an operation" in str(refused.value)


@pytest.mark.parametrize("kind", ["agent", "reconciler", "desk", "web"])
def test_no_role_may_write_an_event_into_another_tenant(kind):
    op = OperationFactory(tenant="acme")
    found = run_as(TEST_LOGINS[kind], f"""
from django.db import connection
result = {{}}
try:
    with connection.cursor() as cursor:
        cursor.execute({INSERT!r}, [{op.pk}, "globex"])
except Exception as exc:
    result = {{"sqlstate": getattr(exc.__cause__, "sqlstate", None), "message": str(exc)}}
else:
    result = {{"sqlstate": None, "message": "accepted"}}
""")
    # Each role is refused: by this check, or before it by its grants or a role check.
    print(kind, found)
    assert found["sqlstate"] == "42501", found
    assert not OperationEvent.objects.filter(operation=op, version=99).exists()


def test_the_ledger_s_one_statement_writes_pass_the_check():
    op = receipts.record_intent("mail.send", "smtp://x", {"to": "a@example.com"},
                                tenant="acme", submit=True)
    events = list(OperationEvent.objects.filter(operation=op).order_by("version"))
    assert [(e.tenant, e.to_state) for e in events] == [("acme", "planned"),
                                                        ("acme", "submitted")]
    assert all(e.content["tenant"] == "acme" for e in events)
