"""PostgreSQL roles per kind of actor (`manage.py db_roles`, migration 0030), tried from real
child processes, each logged in as one kind's login role.

An agent goes around the API with only its own credentials: a person's decision, an
approval, a reconciler's verdict, Django's auth tables are refused by PostgreSQL and nothing
is written. A reconciler cannot decide as a person; the desk cannot decide for a user
without the permission or the tenant grant. And the product works under these roles.
"""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from ledger.models import Approval, Operation
from ledger.states import State
from tests.conftest import TEST_LOGINS
from tests.factories import OperationFactory, UserFactory
from tests.support.processes import run_as

pytestmark = pytest.mark.django_db(transaction=True)

NO_PRIVILEGE = "42501"


@pytest.fixture
def logins():
    """The logins tests/conftest.py made for the session, one per kind."""
    return TEST_LOGINS


@pytest.fixture
def people():
    return {
        "reviewer": UserFactory(username="reviewer", role="reviewer"),
        "stranger": UserFactory(username="stranger", tenants=[]),  # no permission, no tenant
        "elsewhere": UserFactory(username="elsewhere", role="reviewer", tenants=["other"]),
        "admin": UserFactory(username="admin", role="admin"),
    }


def snapshot() -> dict:
    tables = ["ledger_operation", "ledger_operationevent", "ledger_approval",
              "ledger_resolutionproposal", "ledger_evidence", "ledger_chainhead", "auth_user"]
    with connection.cursor() as cursor:
        state = {}
        for table in tables:
            cursor.execute(f"SELECT count(*), md5(coalesce(string_agg(t::text, '|' "
                           f"ORDER BY t::text), '')) FROM {table} t")
            state[table] = cursor.fetchone()
        return state


# What each child defines first: `attempt(name, fn)` records how `fn` ended (PostgreSQL's
# SQLSTATE and message, a Python refusal, or "accepted"); `person(pk, name)` is a User built
# without reading auth_user, its permission and tenant looked up already (as an attacker
# would set them), so that Python's own checks let it through to PostgreSQL.
ATTEMPTS = """
from django.contrib.auth.models import User
from django.db import DatabaseError, connection, transaction
from ledger import approvals, receipts, transitions
from ledger.models import Approval, Operation

result = {}
with connection.cursor() as cursor:
    cursor.execute("SELECT current_user")
    result["login"] = cursor.fetchone()[0]

def attempt(name, fn, atomic=True):
    try:
        if atomic:
            with transaction.atomic():
                fn()
                with connection.cursor() as cursor:
                    cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        else:
            fn()
    except DatabaseError as exc:
        result[name] = [getattr(exc.__cause__, "sqlstate", None), str(exc).splitlines()[0]]
    except Exception as exc:
        result[name] = ["python", f"{type(exc).__name__}: {exc}"]
    else:
        result[name] = ["accepted", ""]

def person(pk, name, tenants=("default",)):
    user = User(pk=pk, username=name, is_active=True)
    user._perm_cache = {"ledger.resolve_operation", "ledger.resolve_factconflict"}
    user._ledger_tenants = frozenset(tenants)
    return user

def op(pk):
    return Operation.objects.get(pk=pk)

def decide(pk, user_pk, to_state="succeeded", actor_kind="human"):
    return lambda: transitions._apply(op(pk), to_state, actor_kind=actor_kind,
                                      actor_id="forger", decided_by=user_pk, reason="forged")

def raw_approval(pk, user_pk):
    def insert():
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO ledger_approval (operation_id, tenant, decision, "
                "intent_fingerprint, version, edited_from, decided_by_id, decided_by_name, "
                "reason, expires_at, created_at) SELECT id, tenant, 'approve', "
                "intent_fingerprint, version, '', %s, 'forger', '', now() + interval '1 hour', "
                "now() FROM ledger_operation WHERE id = %s", [user_pk, pk])
    return insert

def read_hashes():
    with connection.cursor() as cursor:
        cursor.execute("SELECT password FROM auth_user")
        cursor.fetchall()

def make_superuser():
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO auth_user (password, is_superuser, username, first_name, "
                       "last_name, email, is_staff, is_active, date_joined) VALUES "
                       "('x', true, 'root2', '', '', '', true, true, now())")
"""


def test_the_agent_cannot_act_as_a_person_a_reconciler_or_read_auth(logins, people):
    unknown = OperationFactory(state=State.OUTCOME_UNKNOWN)
    planned = OperationFactory(state=State.PLANNED)
    reviewer = people["reviewer"]
    before = snapshot()
    found = run_as(logins["agent"], ATTEMPTS + f"""
attempt("raw human decision", decide({unknown.pk}, {reviewer.pk}))
attempt("by_person with a reviewer", lambda: transitions.by_person(
    op({unknown.pk}), "succeeded", user=person({reviewer.pk}, "reviewer"), reason="forged"),
    atomic=False)
attempt("raw approval", raw_approval({planned.pk}, {reviewer.pk}))
attempt("approve", lambda: approvals.approve(op({planned.pk}),
                                             user=person({reviewer.pk}, "reviewer")), atomic=False)
attempt("deny", lambda: approvals.deny(op({planned.pk}), user=person({reviewer.pk}, "reviewer"),
                                       reason="forged"), atomic=False)
attempt("reconciler claim", decide({unknown.pk}, None, "reconciling", "reconciler"))
attempt("claim as an agent", decide({unknown.pk}, None, "reconciling", "agent"))
attempt("read auth_user", read_hashes)
attempt("write auth_user", make_superuser)
""")
    assert found.pop("login") == logins["agent"]
    for name, (sqlstate, message) in found.items():
        assert sqlstate == NO_PRIVILEGE, f"{name}: {sqlstate} {message}"
    assert "expected a person's decision to come from the desk" in found["raw human decision"][1]
    assert "found it from role ledger_test_agent" in found["by_person with a reviewer"][1]
    assert "ledger_reconciler" in found["reconciler claim"][1]
    assert "ledger_reconciler" in found["claim as an agent"][1]
    assert snapshot() == before
    assert Operation.objects.get(pk=unknown.pk).state == State.OUTCOME_UNKNOWN


def test_the_reconciler_cannot_decide_as_a_person(logins, people):
    unknown = OperationFactory(state=State.OUTCOME_UNKNOWN)
    planned = OperationFactory(state=State.PLANNED)
    reviewer = people["reviewer"]
    before = snapshot()
    found = run_as(logins["reconciler"], ATTEMPTS + f"""
attempt("raw human decision", decide({unknown.pk}, {reviewer.pk}))
attempt("by_person with a reviewer", lambda: transitions.by_person(
    op({unknown.pk}), "abandoned", user=person({reviewer.pk}, "reviewer"), reason="forged"),
    atomic=False)
attempt("raw approval", raw_approval({planned.pk}, {reviewer.pk}))
attempt("read auth_user", read_hashes)
""")
    assert found.pop("login") == logins["reconciler"]
    for name, (sqlstate, message) in found.items():
        assert sqlstate == NO_PRIVILEGE, f"{name}: {sqlstate} {message}"
    assert "found it from role ledger_test_reconciler" in found["raw human decision"][1]
    assert snapshot() == before


def test_the_desk_cannot_decide_for_a_user_without_the_permission_or_the_tenant(logins, people):
    unknown = OperationFactory(state=State.OUTCOME_UNKNOWN)
    planned = OperationFactory(state=State.PLANNED)
    stranger, elsewhere = people["stranger"], people["elsewhere"]
    before = snapshot()
    found = run_as(logins["desk"], ATTEMPTS + f"""
attempt("decision for a user without the permission", decide({unknown.pk}, {stranger.pk}))
attempt("decision for a user without the tenant", decide({unknown.pk}, {elsewhere.pk}))
attempt("approval for a user without the permission",
        raw_approval({planned.pk}, {stranger.pk}))
attempt("reconciler verdict", decide({unknown.pk}, None, "reconciling", "reconciler"))
from django.contrib.auth.models import User
attempt("by_person, Python first", lambda: transitions.by_person(
    op({unknown.pk}), "succeeded", user=User.objects.get(pk={stranger.pk}), reason="forged"),
    atomic=False)
attempt("by_person for elsewhere, Python first", lambda: transitions.by_person(
    op({unknown.pk}), "succeeded", user=User.objects.get(pk={elsewhere.pk}), reason="forged"),
    atomic=False)
""")
    assert found.pop("login") == logins["desk"]
    python = {name: found.pop(name) for name in list(found) if "Python first" in name}
    for name, (sqlstate, message) in found.items():
        assert sqlstate == NO_PRIVILEGE, f"{name}: {sqlstate} {message}"
    assert found["decision for a user without the permission"][1].endswith(
        "found user stranger without permission ledger.resolve_operation")
    assert found["decision for a user without the tenant"][1].endswith(
        "found user elsewhere without a grant of tenant default")
    assert "without permission ledger.resolve_operation" in found[
        "approval for a user without the permission"][1]
    assert python["by_person, Python first"] == [
        "python", "PermissionDenied: expected permission ledger.resolve_operation to decide "
                  f"on operation {unknown.operation_id}, found stranger without it"]
    assert python["by_person for elsewhere, Python first"] == [
        "python", "PermissionDenied: expected elsewhere to be granted tenant 'default', "
                  "found no such grant"]
    assert snapshot() == before


def test_db_roles_refuses_a_login_that_could_switch_the_rules_off(logins):
    with connection.cursor() as cursor:
        cursor.execute("SELECT tableowner FROM pg_tables WHERE tablename = 'ledger_operation'")
        owner = cursor.fetchone()[0]
    with pytest.raises(CommandError, match=rf"expected role {owner} to be no superuser and no "
                                           rf"member of the tables' owner"):
        call_command("db_roles", "--login", f"{owner}=agent")
    with pytest.raises(CommandError, match="expected an agent's login never to act as a "
                                           "reconciler"):
        call_command("db_roles", "--login", "ledger_test_both=agent,reconciler")


def test_db_roles_refuses_a_ledger_table_it_does_not_know(logins):
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE ledger_unknown (id int)")
    try:
        with pytest.raises(CommandError, match="found ledger_unknown missing: decide who may "
                                               "write it"):
            call_command("db_roles")
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE ledger_unknown")


def test_db_roles_refuses_a_migration_state_behind_the_code(logins):
    from django.db.migrations.loader import MigrationLoader

    app, name = max(node for node in MigrationLoader(connection).graph.leaf_nodes()
                    if node[0] == "ledger")
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM django_migrations WHERE app = %s AND name = %s "
                       "RETURNING applied", [app, name])
        applied = cursor.fetchone()[0]
    try:
        with pytest.raises(CommandError, match=rf"expected every migration applied before "
                                               rf"db_roles, found 1 missing \(first: "
                                               rf"ledger.{name}\)"):
            call_command("db_roles")
    finally:
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO django_migrations (app, name, applied) "
                           "VALUES (%s, %s, %s)", [app, name, applied])


def test_db_roles_twice_at_once_both_succeed(logins):
    from tests.support.processes import spawn

    children = [spawn("""
from ledger import db_roles
db_roles.apply(logins=[("ledger_test_race", ("agent",))])
print("DONE")
""") for _ in range(2)]
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0 and "DONE" in out, err


# --- the product works under its roles ------------------------------------------------------


def test_an_agent_runs_its_whole_api_as_the_agent_role(logins):
    found = run_as(logins["agent"], """
from django.db import connection
from ledger import approvals, facts, leases, obligations, receipts, runs
from ledger.agent_kit import action
from datetime import timedelta

with connection.cursor() as cursor:
    cursor.execute("SELECT current_user")
    login = cursor.fetchone()[0]
op = receipts.record_intent("articles.create", "https://cms.example/a", {"title": "t"})
receipts.mark_submitted(op)
receipts.mark_succeeded(op, external_id="a-1")
lost = receipts.record_intent("articles.create", "https://cms.example/a", {"title": "u"})
receipts.mark_submitted(lost)
receipts.mark_outcome_unknown(lost, error_code="Timeout", detail="no answer")

@action("articles.publish", target="https://cms.example/p", key=lambda slug: slug,
        external_id=lambda result: result["id"])
def publish(slug):
    return {"id": "p-" + slug}

first, again = publish("hello"), publish("hello")
run = runs.start("nightly", run_id="run-agent")
runs.add_step(run, "one")
runs.start_step(run, "one")
runs.commit_step(run, "one")
obligations.open(run, "refund", "refund-agent")
obligations.commit("refund-agent", {"ok": True})
facts.assert_fact("order-1", "status", "paid", source="agent-a")
facts.assert_fact("order-1", "status", "refunded", source="agent-b")
token = leases.acquire("job:1", "agent-a", timedelta(minutes=1))
planned = receipts.record_intent("payments.send", "https://bank.example", {"amount": 5})
approvals.request(planned, note="please")
result = {"login": login, "states": [op.state, lost.state], "publish": [first, again],
          "token": token}
""")
    assert found == {"login": logins["agent"], "states": ["succeeded", "outcome_unknown"],
                     "publish": [{"id": "p-hello"}, {"id": "p-hello"}], "token": 1}


def test_reconcile_once_settles_as_the_reconciler_role(logins):
    from ledger.models import Evidence

    lost = OperationFactory(state=State.OUTCOME_UNKNOWN, operation="roles.found")
    found = run_as(logins["reconciler"], f"""
from django.core.management import call_command
from django.db import connection
from ledger import reconcile

@reconcile.register("roles.found")
class FoundIt(reconcile.Reconciler):
    def lookup(self, op):
        return reconcile.Found("ext-roles", {{"id": "ext-roles"}})

with connection.cursor() as cursor:
    cursor.execute("SELECT current_user")
    login = cursor.fetchone()[0]
call_command("reconcile", "--once")
from ledger.models import Approval, Operation
result = {{"login": login, "state": Operation.objects.get(pk={lost.pk}).state}}
""")
    assert found == {"login": logins["reconciler"], "state": "succeeded"}
    assert Evidence.objects.filter(operation=lost, verdict="found").exists()
    from ledger import chain

    chain.seal()
    assert chain.verify(actor="test").is_intact


def test_every_desk_decision_runs_as_the_desk_role(logins, people):
    from ledger import approvals, facts

    ops = {state: [OperationFactory(state=state) for _ in range(2)]
           for state in (State.OUTCOME_UNKNOWN, State.PLANNED)}
    bulk = [OperationFactory(state=State.OUTCOME_UNKNOWN) for _ in range(2)]
    two = OperationFactory(state=State.OUTCOME_UNKNOWN, operation="payments.send")
    approvals.set_policy("payments.*", user=people["admin"], consequential=True)
    twin_a = OperationFactory(state=State.SUCCEEDED, intent={"title": "same"},
                              idempotency_key="a")
    OperationFactory(state=State.SUCCEEDED, intent={"title": "same"}, idempotency_key="b")
    facts.assert_fact("order-9", "status", "paid", source="agent-a")
    facts.assert_fact("order-9", "status", "refunded", source="agent-b")
    UserFactory(username="second", role="reviewer")
    unknown, planned = ops[State.OUTCOME_UNKNOWN], ops[State.PLANNED]
    found = run_as(logins["desk"], f"""
from django.contrib.auth.models import User
from django.db import connection
from ledger import approvals, bulk, facts, receipts
from ledger.models import FactConflict, Operation

with connection.cursor() as cursor:
    cursor.execute("SELECT current_user")
    login = cursor.fetchone()[0]
reviewer = User.objects.get(username="reviewer")
second = User.objects.get(username="second")
op = Operation.objects.get
receipts.resolve(op(pk={unknown[0].pk}), "succeeded", user=reviewer, reason="seen",
                 external_id="x-1")
receipts.resolve(op(pk={unknown[1].pk}), "abandoned", user=reviewer, reason="never sent")
receipts.resolve(op(pk={two.pk}), "succeeded", user=reviewer, reason="seen", external_id="p")
receipts.resolve(op(pk={two.pk}), "succeeded", user=second, reason="agreed", external_id="p")
approvals.approve(op(pk={planned[0].pk}), user=reviewer, reason="fine")
approvals.deny(op(pk={planned[1].pk}), user=reviewer, reason="no")
receipts.acknowledge(op(pk={twin_a.pk}), user=reviewer, reason="two articles intended")
done = bulk.resolve_many([(o.operation_id, o.version) for o in
                          Operation.objects.filter(pk__in={[o.pk for o in bulk]})],
                         "abandoned", user=reviewer, reason="cleanup")
facts.resolve_conflict(FactConflict.objects.get(subject="order-9"), winner="candidate",
                       user=reviewer, reason="the bank says so")
result = {{"login": login}}
""")
    assert found == {"login": logins["desk"]}
    states = {o.pk: o.state for o in Operation.objects.all()}
    assert (states[unknown[0].pk], states[unknown[1].pk], states[two.pk]) == (
        State.SUCCEEDED, State.ABANDONED, State.SUCCEEDED)
    assert states[planned[1].pk] == State.ABANDONED
    assert all(states[o.pk] == State.ABANDONED for o in bulk)
    assert Approval.objects.filter(operation=planned[0], decision="approve").exists()


def test_check_deploy_warns_about_an_owner_or_superuser_login_only(logins):
    import subprocess
    import sys

    from tests.support.processes import ROOT, child_env

    def warnings(login=None):
        done = subprocess.run([sys.executable, "manage.py", "check", "--deploy"], cwd=ROOT,
                              env=child_env(login), capture_output=True, text=True,
                              timeout=120)
        return done.stdout + done.stderr

    with connection.cursor() as cursor:
        cursor.execute("SELECT session_user")
        owner = cursor.fetchone()[0]
    assert f"(ledger.W121) expected this process to log in as one kind's login (manage.py " \
           f"db_roles --login; docs/security.md), found {owner}, a superuser" in warnings()
    for kind in ("agent", "web"):
        assert "ledger.W121" not in warnings(logins[kind])
