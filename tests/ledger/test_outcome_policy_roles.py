"""Who may write unknown-outcome policies, held by PostgreSQL's grants: tried in child
processes logged in as each kind's login. The desk writes the policies and appends their
changes; the reconciler only reads them; the agent neither writes nor rewrites; nobody moves a
policy to another pattern."""

from __future__ import annotations

import pytest

from ledger import outcome_policies
from ledger.models import UnknownOutcomePolicy, UnknownOutcomePolicyChange
from tests.conftest import TEST_LOGINS
from tests.support.processes import run_as

pytestmark = pytest.mark.django_db(transaction=True)

CALLS = """
from django.db import connection, transaction

result = {}

def call(name, sql, params=()):
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql, list(params))
            result[name] = ["accepted", cursor.fetchall() if cursor.description else None]
    except Exception as exc:
        result[name] = [getattr(getattr(exc, "__cause__", None), "sqlstate", None),
                        str(exc).splitlines()[0]]

call("insert", "INSERT INTO ledger_unknownoutcomepolicy (pattern, tenant, automatic_retry, "
     "created_at, updated_at) VALUES ('mail.*', 'default', true, now(), now())")
call("update", "UPDATE ledger_unknownoutcomepolicy SET automatic_retry = true")
call("move", "UPDATE ledger_unknownoutcomepolicy SET pattern = 'refunds.*'")
call("log", "INSERT INTO ledger_unknownoutcomepolicychange (tenant, pattern, after, reason, "
     "changed_by_name, changed_at) VALUES ('default', 'mail.*', '{}', 'r', 'x', now())")
call("rewrite_log", "UPDATE ledger_unknownoutcomepolicychange SET reason = 'forged'")
call("read", "SELECT pattern, automatic_retry FROM ledger_unknownoutcomepolicy "
     "ORDER BY pattern")
"""


@pytest.mark.parametrize("kind", ["agent", "reconciler", "desk"])
def test_only_the_desk_writes_policies_and_nobody_rewrites_their_changes(kind, admin_user):
    outcome_policies.set_policy("payments.*", user=admin_user, automatic_retry=False,
                                reason="never without a person")
    found = run_as(TEST_LOGINS[kind], CALLS)
    assert found["read"][0] == "accepted", found
    # (the desk's own UPDATE above ran first; the others read the row as set)
    assert ["payments.*", kind == "desk"] in found["read"][1], found
    assert found["rewrite_log"][0] == "42501", found  # append-only: no UPDATE grant
    # a policy's pattern and tenant never change (only its rules, by column grant)
    assert found["move"][0] == "42501", found
    if kind == "desk":
        for name in ("insert", "update", "log"):
            assert found[name][0] == "accepted", (name, found)
        assert UnknownOutcomePolicy.objects.get(pattern="payments.*").automatic_retry
        assert UnknownOutcomePolicyChange.objects.count() == 2
    else:
        for name in ("insert", "update", "log"):
            assert found[name][0] == "42501", (name, found)
            assert "permission denied" in found[name][1], (name, found)
        assert not UnknownOutcomePolicy.objects.get(pattern="payments.*").automatic_retry
        assert UnknownOutcomePolicyChange.objects.count() == 1
