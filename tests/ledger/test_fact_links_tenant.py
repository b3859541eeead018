"""A candidate fact contradicts a fact of its own tenant, subject and predicate, held by
PostgreSQL (`fact_insert_check`, migration 0057), which row-level security cannot hold (a
policy cannot read its own table): refused in raw SQL as the tables' owner, as each role's
login that may insert facts, and as a login limited to one tenant; the ledger's own
candidates pass."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from ledger import db_roles, facts
from ledger.models import Fact
from tests.conftest import TEST_LOGINS
from tests.support.processes import run_as

pytestmark = pytest.mark.django_db(transaction=True)

CANDIDATE = ("INSERT INTO ledger_fact (tenant, subject, predicate, value, value_fingerprint, "
             "source, observed_at, version, status, contradicts_id) VALUES "
             "(%s, %s, 'status', '\"forged\"', 'sha256:forged', 'x', now(), NULL, "
             "'candidate', %s)")
ACME_LOGIN = "ledger_test_acme_agent"


def globex_fact() -> Fact:
    return facts.assert_fact("order:17", "status", "paid", source="crm", tenant="globex")


def attempt(login: str | None, tenant: str, subject: str, contradicts: int) -> dict:
    """The raw INSERT of a candidate, as `login` in a child (None: the owner, here)."""
    if login is None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(CANDIDATE, [tenant, subject, contradicts])
        except Exception as exc:
            return {"sqlstate": getattr(exc.__cause__, "sqlstate", None), "message": str(exc)}
        return {"sqlstate": None, "message": "accepted"}
    return run_as(login, f"""
from django.db import connection
try:
    with connection.cursor() as cursor:
        cursor.execute({CANDIDATE!r}, [{tenant!r}, {subject!r}, {contradicts}])
except Exception as exc:
    result = {{"sqlstate": getattr(exc.__cause__, "sqlstate", None), "message": str(exc)}}
else:
    result = {{"sqlstate": None, "message": "accepted"}}
""")


def forged_candidates() -> int:
    return Fact.objects.filter(value_fingerprint="sha256:forged").count()


def test_the_owner_cannot_make_a_candidate_contradict_another_tenant_s_fact():
    other = globex_fact()
    found = attempt(None, "acme", "order:17", other.pk)
    assert found["sqlstate"] == "42501", found
    assert (f"expected the candidate to contradict a fact of its tenant acme, found fact id "
            f"{other.pk} of another tenant") in found["message"]
    assert forged_candidates() == 0


def test_nor_one_of_another_subject():
    other = facts.assert_fact("order:18", "status", "paid", source="crm", tenant="acme")
    found = attempt(None, "acme", "order:17", other.pk)
    assert found["sqlstate"] == "23514", found
    assert "expected the candidate to contradict a version of the same subject and " \
           "predicate, found order:18 status" in found["message"]
    assert forged_candidates() == 0


@pytest.mark.parametrize("kind", ["agent", "desk"])
def test_no_role_that_may_write_facts_links_across_tenants(kind):
    other = globex_fact()
    found = attempt(TEST_LOGINS[kind], "acme", "order:17", other.pk)
    assert found["sqlstate"] == "42501", found
    assert "expected the candidate to contradict a fact of its tenant acme" in found["message"]
    assert forged_candidates() == 0


def test_a_login_limited_to_its_tenant_does_not_even_find_the_other_s_fact():
    db_roles.ensure_login(ACME_LOGIN, (db_roles.AGENT,), tenants=("acme",))
    other = globex_fact()
    found = attempt(ACME_LOGIN, "acme", "order:17", other.pk)
    assert found["sqlstate"] == "42501", found
    assert f"found fact id {other.pk} not there or not visible" in found["message"]
    assert forged_candidates() == 0


def test_the_ledger_s_own_candidate_passes():
    current = facts.assert_fact("order:17", "status", "paid", source="crm", tenant="acme")
    candidate = facts.assert_fact("order:17", "status", "refunded", source="crm",
                                  tenant="acme")
    assert candidate.is_candidate and candidate.contradicts_id == current.pk
