"""Logins PostgreSQL limits to their tenants (`manage.py db_roles --login NAME=agent
--tenants acme`): row-level security on every ledger table, one policy each from
`ledger.db_roles.TENANT_ROWS`.

As a login limited to acme, in a child process: globex's rows of every table are invisible
(raw SQL and the in-process API alike: another tenant's operation is NotFound, its run no
run), every write into globex is refused by PostgreSQL (raw SQL and the API), acme's whole
lifecycle works (intent, submit, success, approval request, facts, obligations, runs and
steps, episodes, leases). A login without --tenants, the workers and the owner see every
tenant. `manage.py check --deploy` warns about an agent login limited to no tenant.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from textwrap import dedent

import pytest
from django.db import connection

from ledger import approvals, db_roles, episodes, facts, obligations, receipts, runs
from ledger.models import Operation
from tests.conftest import TEST_LOGINS
from tests.factories import add_evidence
from tests.support.processes import ROOT, child_env, run_as

pytestmark = pytest.mark.django_db(transaction=True)

ACME_LOGIN = "ledger_test_acme_agent"
NO_PRIVILEGE = "42501"
# The tables the setup below writes a row of each tenant into, and how to find a tenant's.
ROWS_OF = {
    "ledger_operation": "SELECT id FROM ledger_operation WHERE tenant = %s",
    "ledger_operationevent": "SELECT id FROM ledger_operationevent WHERE tenant = %s",
    "ledger_evidence": "SELECT e.id FROM ledger_evidence e JOIN ledger_operation o "
                       "ON o.id = e.operation_id WHERE o.tenant = %s",
    "ledger_fact": "SELECT id FROM ledger_fact WHERE tenant = %s",
    "ledger_obligation": "SELECT id FROM ledger_obligation WHERE tenant = %s",
    "ledger_run": "SELECT id FROM ledger_run WHERE tenant = %s",
    "ledger_step": "SELECT s.id FROM ledger_step s JOIN ledger_run r ON r.id = s.run_id "
                   "WHERE r.tenant = %s",
    "ledger_step_depends_on": "SELECT d.id FROM ledger_step_depends_on d JOIN ledger_step s "
                              "ON s.id = d.from_step_id JOIN ledger_run r ON r.id = s.run_id "
                              "WHERE r.tenant = %s",
    "ledger_episode": "SELECT id FROM ledger_episode WHERE tenant = %s",
    "ledger_lease": "SELECT id FROM ledger_lease WHERE resource LIKE 'run:' || %s || ':%%'",
    "ledger_approvalrequest": "SELECT id FROM ledger_approvalrequest WHERE tenant = %s",
}


@pytest.fixture
def acme_login(db):
    db_roles.ensure_login(ACME_LOGIN, (db_roles.AGENT,), tenants=("acme",))
    return ACME_LOGIN


def tenant_rows(tenant: str) -> dict:
    """A row of `tenant` in each table of ROWS_OF, written through the ledger's API."""
    run = runs.start("sync the CRM", tenant=tenant, run_id=f"run-{tenant}")
    runs.add_step(run, "fetch")
    runs.add_step(run, "write", depends_on=["fetch"])
    episodes.record(run, "assistant", content="planned the sync")
    obligations.open(run, "email", f"welcome-{tenant}")
    facts.assert_fact("customer-1", "email", {"address": f"a@{tenant}.example"},
                      source="crm", tenant=tenant)
    op = receipts.record_intent("crm.update", "https://crm.example/api", {"n": 1},
                                tenant=tenant, idempotency_key=f"k-{tenant}")
    receipts.mark_submitted(op)
    receipts.mark_succeeded(op, external_id=f"crm-{tenant}")
    add_evidence(Operation.objects.get(pk=op.pk), verdict="applied")
    asked = receipts.record_intent("crm.delete", "https://crm.example/api", {"n": 2},
                                   tenant=tenant, idempotency_key=f"ask-{tenant}")
    approvals.request(asked, note="please")
    leased = runs.start("leased", tenant=tenant, run_id=f"leased-{tenant}")
    runs.resume(leased, worker=f"worker-{tenant}", ttl=timedelta(minutes=5))
    found = {}
    with connection.cursor() as cursor:
        for table, sql in ROWS_OF.items():
            cursor.execute(sql, [tenant])
            found[table] = sorted(i for (i,) in cursor.fetchall())
    return {"rows": found, "operation_pk": op.pk, "operation_id": op.operation_id,
            "asked_pk": asked.pk}


def test_every_ledger_table_an_agent_may_touch_has_the_tenant_policy(acme_login):
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, c.relrowsecurity, "
            "       (SELECT count(*) FROM pg_policies p WHERE p.tablename = c.relname) "
            "  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            " WHERE n.nspname = 'public' AND c.relkind = 'r' AND c.relname LIKE 'ledger\\_%' "
            "   AND has_table_privilege('ledger_agent', c.oid, "
            "                           'SELECT, INSERT, UPDATE, DELETE') ORDER BY 1")
        tables = cursor.fetchall()
    assert len(tables) > 35
    missing = [name for name, secured, policies in tables if not secured or policies == 0]
    assert missing == []
    assert {name for name, _, _ in tables} == set(db_roles.TENANT_ROWS) | {
        db_roles.LOGIN_TENANT_TABLE}


def test_a_limited_login_sees_and_writes_its_tenants_rows_only(acme_login):
    acme, globex = tenant_rows("acme"), tenant_rows("globex")
    found = run_as(acme_login, dedent(f"""
        from datetime import timedelta
        from django.db import DatabaseError, connection, transaction
        from ledger import approvals, episodes, errors, facts, leases, obligations, receipts, runs
        from ledger.models import AgentKey, Operation, Run
        from ledger.selectors.operations import access_operation

        acme, globex = {acme!r}, {globex!r}
        result = {{"visible": {{}}, "refused": {{}}, "api": {{}}}}
        with connection.cursor() as cursor:
            cursor.execute("SELECT session_user, ledger_login_tenants()")
            result["session"] = list(cursor.fetchone())
            for table, ids in acme["rows"].items():
                cursor.execute(f"SELECT id FROM {{table}} WHERE id = ANY(%s)", [ids])
                mine = sorted(i for (i,) in cursor.fetchall())
                cursor.execute(f"SELECT id FROM {{table}} WHERE id = ANY(%s)",
                               [globex["rows"][table]])
                result["visible"][table] = [mine == ids, [i for (i,) in cursor.fetchall()]]

        def refused(name, action):
            # raw SQL in a transaction of its own, its deferred checks run at its end; an
            # API call (its own durable transaction) as it is
            raw = getattr(action, "raw", False)
            try:
                if raw:
                    with transaction.atomic():
                        action()
                        with connection.cursor() as cursor:
                            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
                else:
                    action()
            except DatabaseError as exc:
                result["refused"][name] = [exc.__cause__.sqlstate,
                                           exc.__cause__.diag.message_primary]
            except errors.LedgerError as exc:
                result["refused"][name] = [type(exc).__name__, str(exc)]
            else:
                result["refused"][name] = None

        def sql(statement, params=()):
            def run():
                with connection.cursor() as cursor:
                    cursor.execute(statement, params)
                    if cursor.rowcount == 0:
                        raise errors.NotFound("no row changed")
            run.raw = True
            return run

        op_pk, asked_pk = globex["operation_pk"], globex["asked_pk"]
        refused("event of another tenant's operation", sql(
            "INSERT INTO ledger_operationevent (operation_id, tenant, from_state, to_state, "
            "actor_kind, actor_id, reason, evidence, created_at, version) "
            "VALUES (%s, 'acme', 'planned', 'planned', 'agent', 'a', '', '{{}}', now(), 99)",
            [op_pk]))
        refused("update of another tenant's operation", sql(
            "UPDATE ledger_operation SET error_detail = 'x' WHERE id = %s", [op_pk]))
        refused("update of another tenant's approval request", sql(
            "UPDATE ledger_approvalrequest SET note = 'x' WHERE operation_id = %s", [asked_pk]))
        refused("own approval request moved to another tenant", sql(
            "UPDATE ledger_approvalrequest SET tenant = 'globex' WHERE operation_id = %s",
            [acme["asked_pk"]]))
        for tenant in ("globex", "acme"):
            refused(f"approval request of another tenant's operation, as {{tenant}}", sql(
                "INSERT INTO ledger_approvalrequest (operation_id, tenant, note, "
                "requested_by, approvals_needed, status, requested_at) "
                "VALUES (%s, %s, '', 'a', 1, 'pending', now())", [asked_pk, tenant]))
        refused("step into another tenant's run", sql(
            "INSERT INTO ledger_step (step_id, created_at, run_id, state, added_token) "
            "VALUES ('evil', now(), %s, 'pending', NULL)", [globex["rows"]["ledger_run"][0]]))
        refused("intent of another tenant", lambda: receipts.record_intent(
            "crm.update", "https://crm.example/api", {{"n": 9}}, tenant="globex"))
        refused("run of another tenant", lambda: runs.start("x", tenant="globex"))
        refused("fact of another tenant", lambda: facts.assert_fact(
            "customer-9", "email", {{"a": 1}}, source="crm", tenant="globex"))
        refused("obligation of another tenant's run", lambda: obligations.open(
            Run(pk=globex["rows"]["ledger_run"][0], tenant="globex", run_id="run-globex"),
            "email", "evil"))
        refused("lease of another tenant's run", lambda: leases.acquire(
            "run:globex:run-globex", "thief", timedelta(days=30)))
        refused("a reconciler's lease", lambda: leases.acquire(
            f"reconcile:{{globex['operation_id']}}", "thief", timedelta(days=30)))

        # the in-process API, with a principal Python would let through to both tenants
        key = AgentKey(name="both", tenants=["acme", "globex"])
        for name, call in (
            ("operation", lambda: access_operation(key, globex["operation_id"])),
            ("run", lambda: runs.as_run("run-globex")),
            ("request approval", lambda: approvals.request(
                Operation(pk=asked_pk, operation_id="x", tenant="globex", state="planned",
                          version=1))),
        ):
            try:
                call()
            except errors.LedgerError as exc:
                result["api"][name] = [type(exc).__name__, str(exc)]
            else:
                result["api"][name] = None
        result["own operation"] = access_operation(key, acme["operation_id"]).tenant

        # acme's whole lifecycle, as this login
        run = runs.start("acme again", tenant="acme", run_id="run-acme-2")
        lease = runs.resume(run, worker="acme-worker", ttl=timedelta(minutes=5))
        token = lease.token
        runs.add_step(run, "one", fencing_token=token)
        runs.start_step(run, "one", fencing_token=token)
        runs.commit_step(run, "one", fencing_token=token)
        episodes.record(run, "assistant", content="done", fencing_token=token)
        obligations.open(run, "email", "welcome-acme-2", fencing_token=token)
        obligations.commit("welcome-acme-2", {{"sent": True}}, fencing_token=token,
                           tenant="acme")
        fact = facts.assert_fact("customer-2", "email", {{"a": 2}}, source="crm",
                                 tenant="acme", run=run, fencing_token=token)
        op = receipts.record_intent("crm.update", "https://crm.example/api", {{"n": 3}},
                                    tenant="acme", run=run, step="one", relies_on=[fact])
        op = receipts.mark_submitted(op, fencing_token=token)
        op = receipts.mark_succeeded(op, external_id="crm-3", fencing_token=token)
        asked = receipts.record_intent("crm.delete", "https://crm.example/api", {{"n": 4}},
                                       tenant="acme")
        approvals.request(asked, note="please")
        leases.release(run.lease_resource, "acme-worker", token)
        result["lifecycle"] = [op.state, fact.tenant]
    """))
    assert found["session"] == [acme_login, ["acme"]]
    for table, (all_mine, theirs) in found["visible"].items():
        assert all_mine and acme["rows"][table], table
        assert globex["rows"][table] and theirs == [], table
    refusals = found["refused"]
    assert all(refusals.values()), refusals
    # the request's trigger (migration 0042) finds no such operation among this login's
    for name in ("approval request of another tenant's operation, as acme",
                 "approval request of another tenant's operation, as globex",
                 "own approval request moved to another tenant"):
        assert refusals[name][0] in (NO_PRIVILEGE, "23503", "23514"), (name, refusals[name])
    for name in ("event of another tenant's operation", "step into another tenant's run",
                 "intent of another tenant",
                 "run of another tenant", "fact of another tenant",
                 "lease of another tenant's run", "a reconciler's lease"):
        assert refusals[name][0] in (NO_PRIVILEGE, "PermissionDenied",
                                     "DatabaseRefusedByRole"), (name, refusals[name])
    for name in ("update of another tenant's operation",
                 "update of another tenant's approval request"):
        assert refusals[name][0] == "NotFound", (name, refusals[name])
    assert found["api"]["operation"][0] == "NotFound"
    assert "among the tenants you may see" in found["api"]["operation"][1]
    assert found["api"]["run"][0] == "InvalidInput"
    assert "found no such run" in found["api"]["run"][1]
    assert found["api"]["request approval"][0] == "NotFound"
    assert found["own operation"] == "acme"
    assert found["lifecycle"] == ["succeeded", "acme"]
    # globex's rows are as they were
    op = Operation.objects.get(pk=globex["operation_pk"])
    assert (op.state, op.error_detail) == ("succeeded", "")
    assert not runs.Run.objects.filter(tenant="globex", objective="x").exists()


def test_an_unlimited_login_and_the_workers_see_every_tenant(acme_login):
    acme, globex = tenant_rows("acme"), tenant_rows("globex")
    code = dedent(f"""
        from django.db import connection
        acme, globex = {acme!r}, {globex!r}
        result = {{}}
        with connection.cursor() as cursor:
            for table in acme["rows"]:
                ids = acme["rows"][table] + globex["rows"][table]
                cursor.execute(f"SELECT count(*) FROM {{table}} WHERE id = ANY(%s)", [ids])
                result[table] = cursor.fetchone()[0] == len(ids)
    """)
    for kind in ("agent", "reconciler", "desk", "web"):
        seen = run_as(TEST_LOGINS[kind], code)
        assert all(seen.values()), (kind, seen)


def test_made_again_without_tenants_a_login_is_limited_to_none(acme_login):
    db_roles.apply(logins=[(acme_login, (db_roles.AGENT,))])
    seen = run_as(acme_login, dedent("""
        from django.db import connection
        with connection.cursor() as cursor:
            cursor.execute("SELECT ledger_login_tenants()")
            result = cursor.fetchone()[0]
    """))
    assert seen is None
    db_roles.apply(logins=[(acme_login, (db_roles.AGENT,), ("acme", "globex"))])
    seen = run_as(acme_login, dedent("""
        from django.db import connection
        with connection.cursor() as cursor:
            cursor.execute("SET ROLE ledger_agent")  # the login still limits the session
            cursor.execute("SELECT current_user, ledger_login_tenants()")
            result = list(cursor.fetchone())
    """))
    assert seen == ["ledger_agent", ["acme", "globex"]]


def test_only_an_agent_login_of_that_kind_alone_is_limited(db):
    for kinds in (("agent", "desk"), ("desk",), ("reconciler",)):
        with pytest.raises(db_roles.RolesRefused, match="expected --tenants for a login of "
                                                        "kind agent alone"):
            db_roles.ensure_login("ledger_test_limited_web", kinds, tenants=("acme",))
    with pytest.raises(db_roles.RolesRefused, match="expected tenant"):
        db_roles.ensure_login(ACME_LOGIN, ("agent",), tenants=("acme\n",))


def test_the_login_cannot_change_its_own_tenants(acme_login):
    found = run_as(acme_login, dedent("""
        from django.db import DatabaseError, connection, transaction
        result = {}
        for name, sql in (
            ("delete", "DELETE FROM ledger_logintenant"),
            ("insert", "INSERT INTO ledger_logintenant VALUES (session_user, 'globex')"),
            ("shadow", "CREATE TEMP TABLE ledger_logintenant (login text, tenant text)"),
        ):
            try:
                with transaction.atomic(), connection.cursor() as cursor:
                    cursor.execute(sql)
                    cursor.execute("SELECT ledger_login_tenants()")
                    result[name] = cursor.fetchone()[0]
            except DatabaseError as exc:
                result[name] = exc.__cause__.sqlstate
    """))
    assert found["delete"] == NO_PRIVILEGE and found["insert"] == NO_PRIVILEGE
    assert found["shadow"] == ["acme"]  # a temporary table of the name changes nothing


def test_check_deploy_warns_about_an_agent_login_limited_to_no_tenant(acme_login):
    def warnings():
        done = subprocess.run([sys.executable, "manage.py", "check", "--deploy"], cwd=ROOT,
                              env=child_env(None), capture_output=True, text=True,
                              timeout=120)
        return done.stdout + done.stderr

    said = warnings()
    unlimited = TEST_LOGINS["agent"]
    assert (f"(ledger.W122) expected every agent login limited by PostgreSQL to its "
            f"tenants, found {unlimited} limited to none") in said
    assert f"manage.py db_roles --login {unlimited}=agent --tenants" in said
    assert f"found {acme_login} limited to none" not in said
    assert f"found {TEST_LOGINS['web']} limited" not in said  # the web login serves all keys
    db_roles.apply(logins=[(acme_login, (db_roles.AGENT,))])
    try:
        assert f"found {acme_login} limited to none" in warnings()
    finally:
        db_roles.apply(logins=[(acme_login, (db_roles.AGENT,), ("acme",))])
