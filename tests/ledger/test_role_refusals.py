"""PostgreSQL's refusals on role grounds (SQLSTATE 42501) reach the caller of a public
function as the ledger's PermissionDenied with the trigger's message, and nothing is
written: tried from real child processes, each logged in as one kind's login role, with a
real reviewer (their pk, name, permission and tenant, so that Python's own checks let the
call through to PostgreSQL)."""

from __future__ import annotations

import pytest

from api import problems
from ledger import errors
from ledger.db_roles import DatabaseRefusedByRole
from ledger.models import Operation
from ledger.states import State
from tests.conftest import TEST_LOGINS
from tests.factories import OperationFactory, UserFactory
from tests.ledger.test_db_roles import snapshot
from tests.support.processes import run_as

pytestmark = pytest.mark.django_db(transaction=True)

CALLS = """
from django.contrib.auth.models import User
from django.db import connection
from ledger import approvals, errors, receipts, transitions
from ledger.models import Operation

result = {}
with connection.cursor() as cursor:
    cursor.execute("SELECT current_user")
    result["login"] = cursor.fetchone()[0]

def call(name, fn):
    try:
        fn()
    except errors.PermissionDenied as exc:
        result[name] = [type(exc).__name__, getattr(exc.__cause__, "sqlstate", None), str(exc)]
    except Exception as exc:
        result[name] = ["other", type(exc).__name__, str(exc)]
    else:
        result[name] = ["accepted", None, ""]

def reviewer(pk, name):
    user = User(pk=pk, username=name, is_active=True)
    user._perm_cache = {"ledger.resolve_operation", "ledger.resolve_factconflict"}
    user._ledger_tenants = frozenset({"default"})
    return user

op = lambda pk: Operation.objects.get(pk=pk)
"""


@pytest.mark.parametrize("kind", ["agent", "reconciler"])
def test_a_person_s_decision_from_another_role_is_permission_denied(kind):
    unknown = OperationFactory(state=State.OUTCOME_UNKNOWN)
    planned = OperationFactory(state=State.PLANNED)
    person = UserFactory(username="reviewer", role="reviewer")
    before = snapshot()
    found = run_as(TEST_LOGINS[kind], CALLS + f"""
who = reviewer({person.pk}, "reviewer")
call("by_person", lambda: transitions.by_person(op({unknown.pk}), "succeeded", user=who,
                                                reason="checked by hand"))
call("approve", lambda: approvals.approve(op({planned.pk}), user=who))
call("deny", lambda: approvals.deny(op({planned.pk}), user=who, reason="no"))
""")
    assert found.pop("login") == TEST_LOGINS[kind]
    assert set(found) == {"by_person", "approve", "deny"}
    for name, (error, sqlstate, message) in found.items():
        assert (error, sqlstate) == ("DatabaseRefusedByRole", "42501"), (name, found[name])
        assert "expected " in message and ", found " in message, message
    # the role trigger's own words (approvals are refused earlier, by the grants)
    assert "expected a person's decision to come from the desk" in found["by_person"][2]
    assert f"found it from role {TEST_LOGINS[kind]}" in found["by_person"][2]
    assert snapshot() == before
    assert Operation.objects.get(pk=unknown.pk).state == State.OUTCOME_UNKNOWN
    assert Operation.objects.get(pk=planned.pk).state == State.PLANNED


def test_a_grant_s_refusal_says_what_was_expected_and_is_a_403_problem():
    found = run_as(TEST_LOGINS["agent"], CALLS + """
def read_hashes():
    with connection.cursor() as cursor:
        cursor.execute("SELECT password FROM auth_user")
call("read auth_user", read_hashes)
""")
    error, sqlstate, message = found["read auth_user"]
    assert (error, sqlstate) == ("DatabaseRefusedByRole", "42501")
    assert message == ("expected this session's database role to hold the privilege, found "
                       "PostgreSQL refusing it: permission denied for table auth_user")
    problem = problems.from_ledger_error(DatabaseRefusedByRole(message))
    assert (problem["status"], problem["type"]) == (
        403, "urn:agent-ledger:problem:permission-denied")
    assert issubclass(DatabaseRefusedByRole, errors.PermissionDenied)


SWEEP = """
from django.db import transaction
from ledger import reconcile

def raw_system_event(pk):
    def insert():
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO ledger_operationevent (tenant, version, from_state, to_state, "
                "actor_kind, actor_id, reason, evidence, created_at, operation_id, "
                "external_id) SELECT tenant, version + 1, 'submitted', 'outcome_unknown', "
                "'system', 'sweep_stale_submissions', 'forged', NULL, now(), id, '' "
                "FROM ledger_operation WHERE id = %s", [pk])
    return insert

def sweep(pk):
    def run():
        with transaction.atomic():
            transitions.by_sweep(op(pk), reason="sender gone", evidence={"checked": True})
    return run
"""


def test_a_system_event_comes_only_from_the_reconciler():
    submitted = OperationFactory(state=State.SUBMITTED)
    before = snapshot()
    found = run_as(TEST_LOGINS["agent"], CALLS + SWEEP + f"""
call("raw system event", raw_system_event({submitted.pk}))
call("by_sweep", sweep({submitted.pk}))
""")
    for name in ("raw system event", "by_sweep"):
        error, sqlstate, message = found[name]
        assert (error, sqlstate) == ("DatabaseRefusedByRole", "42501"), (name, found[name])
        assert message == ("operation event submitted -> outcome_unknown: expected a system "
                           "event (the sweep of stale submissions) to come from a session in "
                           "role ledger_reconciler, found it from role ledger_test_agent")
    assert snapshot() == before
    assert Operation.objects.get(pk=submitted.pk).state == State.SUBMITTED

    # the reconciler's login sweeps it
    found = run_as(TEST_LOGINS["reconciler"], CALLS + SWEEP + f"""
call("by_sweep", sweep({submitted.pk}))
""")
    assert found["by_sweep"] == ["accepted", None, ""]
    assert Operation.objects.get(pk=submitted.pk).state == State.OUTCOME_UNKNOWN


def test_a_notify_pass_runs_under_the_reconciler_login():
    """The notification loop logs in as a reconciler (make serve's ledger_notify): it
    collects and delivers without UPDATE on the desk's channels (its lock is advisory)."""
    from datetime import timedelta

    from django.utils import timezone

    from ledger import notifications
    from ledger.models import NotificationBatch

    admin = UserFactory(username="channels-admin", role="admin")
    notifications.create_channel("oncall-mail", user=admin, kind="email", pattern="*",
                                 recipients=["oncall@example.com"])
    OperationFactory(state=State.OUTCOME_UNKNOWN)
    later = (timezone.now() + timedelta(minutes=5)).isoformat()
    found = run_as(TEST_LOGINS["reconciler"], f"""
from datetime import datetime
from django.db import connection
from ledger import notifications
with connection.cursor() as cursor:
    cursor.execute("SELECT current_user")
    login = cursor.fetchone()[0]
result = {{"login": login, "pass": notifications.run_once(
    worker="role", now=datetime.fromisoformat({later!r}))}}
""")
    assert found == {"login": TEST_LOGINS["reconciler"], "pass": [1, 1]}
    assert NotificationBatch.objects.get().status == "delivered"
