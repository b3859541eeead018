"""A leased run's steps, obligations and facts are fenced by PostgreSQL, as its operations
are: a write that does not carry the run lease's current token is refused whoever sends it
(the owner, or the agent's role from its own process), and the refusal reaches the caller of
the ledger's functions as StaleFencingToken. The rightful holder then does its own work: it
never finds a forged result as the winner's."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.db import DatabaseError, connection, transaction

from ledger import facts, leases, obligations, runs
from ledger.errors import StaleFencingToken
from ledger.models import Fact, Obligation, Step
from ledger.models.triggers import FENCE_HINT
from tests.conftest import TEST_LOGINS
from tests.support.processes import run_as

pytestmark = pytest.mark.django_db(transaction=True)

MINUTE = timedelta(minutes=1)
CHECK = "23514"
NO_PRIVILEGE = "42501"
# Per role, which attempts it holds the grants for (the rest PostgreSQL refuses it anyway:
# the desk may insert facts, but not lock a run's lease, which the fence of a run's fact does).
GRANTED = {"agent": lambda name: True, "desk": lambda name: False,
           "reconciler": lambda name: False}


@pytest.fixture
def leased():
    """Run run-9, leased twice by worker-a (tokens old < new): step pack started under the
    current token, step ship pending, obligation refund-9 open. Returns (run, old, new)."""
    run = runs.start("Refund order 9", run_id="run-9")
    runs.add_step(run, "pack")
    runs.add_step(run, "ship")
    obligations.open(run, "refund", "refund-9")
    old = leases.acquire(run.lease_resource, "worker-a", MINUTE)
    new = leases.acquire(run.lease_resource, "worker-a", MINUTE)
    runs.start_step(run, "pack", fencing_token=new)
    return run, old, new


def snapshot() -> dict:
    with connection.cursor() as cursor:
        state = {}
        for table in ("ledger_step", "ledger_obligation", "ledger_fact", "ledger_lease"):
            cursor.execute(f"SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) "
                           f"FROM {table} t")
            state[table] = cursor.fetchone()[0]
        return state


def forgeries(run, old, new) -> list[tuple[str, str, list, str | None]]:
    """(name, statement, parameters, the refusal's hint): writes of a stale or tokenless
    worker, and rows inserted already settled (under the current token, so that the rule
    of their INSERT refuses them, not the fence)."""
    pack, ship = (Step.objects.get(run=run, step_id=s).pk for s in ("pack", "ship"))
    refund = Obligation.objects.get(key="refund-9").pk
    fact = ("INSERT INTO ledger_fact (tenant, subject, predicate, value, value_fingerprint, "
            "source, observed_at, version, status, run_id, fencing_token) VALUES "
            "('default', 'order-9', 'refunded', 'true', 'forged', 'forger', now(), 1, "
            "'current', %s, %s)")
    settle = ("UPDATE ledger_obligation SET state = 'committed', result = '[\"forged\"]', "
              "committed_at = now(){} WHERE id = %s")
    return [
        ("step started without a token",
         "UPDATE ledger_step SET state = 'started', started_at = now() WHERE id = %s",
         [ship], FENCE_HINT),
        ("step started with the old token",
         "UPDATE ledger_step SET state = 'started', started_at = now(), started_token = %s "
         "WHERE id = %s", [old, ship], FENCE_HINT),
        # Its started_token is the current one: a commit that writes no token of its own
        # does not inherit it.
        ("started step committed without a token",
         "UPDATE ledger_step SET state = 'committed', committed_at = now() WHERE id = %s",
         [pack], FENCE_HINT),
        ("step inserted committed",
         "INSERT INTO ledger_step (run_id, step_id, state, created_at, started_at, "
         "committed_at, added_token) VALUES (%s, 'forged', 'committed', now(), now(), now(), "
         "%s)", [run.pk, new], None),
        ("obligation committed without a token", settle.format(""), [refund],
         FENCE_HINT),
        ("obligation committed with the old token",
         settle.format(", fencing_token = %s"), [old, refund], FENCE_HINT),
        ("obligation cancelled without a token",
         "UPDATE ledger_obligation SET state = 'cancelled', cancelled_at = now(), "
         "cancel_reason = 'forged' WHERE id = %s", [refund], FENCE_HINT),
        ("obligation inserted committed",
         "INSERT INTO ledger_obligation (run_id, tenant, kind, key, state, result, "
         "committed_at, cancel_reason, opened_token) VALUES (%s, 'default', 'refund', "
         "'refund-forged', 'committed', '{\"forged\": 1}', now(), '', %s)",
         [run.pk, new], None),
        ("fact of the run without a token", fact, [run.pk, None], FENCE_HINT),
        ("fact of the run with the old token", fact, [run.pk, old], FENCE_HINT),
    ]


def attempt_each(cursor, attempts) -> dict:
    """Each statement in its own transaction: {name: [sqlstate, hint]}, or None if taken."""
    found = {}
    for name, sql, params, _ in attempts:
        try:
            with transaction.atomic():
                cursor.execute(sql, params)
                cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        except DatabaseError as exc:
            found[name] = [exc.__cause__.sqlstate, exc.__cause__.diag.message_hint]
        else:
            found[name] = None
    return found


def assert_refused_and_then_the_holder_works(found, attempts, run, new, before, *,
                                             granted=lambda name: True):
    """Each attempt refused: by the fence or a check where the role may write the table
    (`granted`), for want of the privilege elsewhere."""
    assert found == {name: [CHECK, hint] if granted(name) else [NO_PRIVILEGE, None]
                     for name, _, _, hint in attempts}
    assert snapshot() == before
    # The rightful holder commits its own result: no forged winner waits for it.
    assert obligations.commit("refund-9", {"refund": "r-1"},
                              fencing_token=new).result == {"refund": "r-1"}
    step = runs.commit_step(run, "pack", fencing_token=new)
    assert (step.state, step.started_token, step.committed_token) == ("committed", new, new)
    fact = facts.assert_fact("order-9", "refunded", True, source="refunds", run=run,
                             fencing_token=new)
    assert (fact.version, fact.fencing_token) == (1, new)


def test_postgresql_refuses_the_owner_s_writes_without_the_current_token(leased):
    run, old, new = leased
    attempts = forgeries(run, old, new)
    before = snapshot()
    with connection.cursor() as cursor:
        found = attempt_each(cursor, attempts)
    assert_refused_and_then_the_holder_works(found, attempts, run, new, before)


@pytest.mark.parametrize("kind", GRANTED)
def test_postgresql_refuses_each_role_s_writes_without_the_current_token(leased, kind):
    run, old, new = leased
    attempts = forgeries(run, old, new)
    before = snapshot()
    code = f"""
import json
from django.db import DatabaseError, connection, transaction
from tests.ledger.test_run_fence_in_postgres import attempt_each

result = {{}}
with connection.cursor() as cursor:
    cursor.execute("SELECT current_user")
    result["login"] = cursor.fetchone()[0]
    result["found"] = attempt_each(cursor, json.loads({json.dumps(attempts)!r}))
"""
    found = run_as(TEST_LOGINS[kind], code)
    assert found["login"] == TEST_LOGINS[kind]
    assert_refused_and_then_the_holder_works(found["found"], attempts, run, new, before,
                                             granted=GRANTED[kind])


def test_the_agent_role_works_a_leased_run_with_the_current_token(leased):
    run, _, new = leased
    found = run_as(TEST_LOGINS["agent"], f"""
from ledger import facts, obligations, runs
result = {{
    "commit": obligations.commit("refund-9", {{"refund": "r-1"}}, fencing_token={new}).result,
    "step": runs.commit_step("run-9", "ship", fencing_token={new}).committed_token,
    "fact": facts.assert_fact("order-9", "refunded", True, source="refunds", run="run-9",
                              fencing_token={new}).fencing_token,
}}
""")
    assert found == {"commit": {"refund": "r-1"}, "step": new, "fact": new}
    assert Obligation.objects.get(key="refund-9").fencing_token == new


def test_postgresql_s_refusal_reaches_the_caller_as_stale_fencing_token(leased, monkeypatch):
    run, old, new = leased
    # Without the ledger's own check, the write reaches PostgreSQL, which refuses it.
    monkeypatch.setattr(leases, "check_run", lambda run_pk, token: None)
    before = snapshot()
    for write in (
        lambda: runs.start_step(run, "ship", fencing_token=old),
        lambda: runs.commit_step(run, "pack"),
        lambda: obligations.commit("refund-9", {"forged": 1}, fencing_token=old),
        lambda: obligations.cancel("refund-9", reason="forged"),
        lambda: facts.assert_fact("order-9", "refunded", True, source="forger", run=run),
    ):
        with pytest.raises(StaleFencingToken,
                           match=f"expected the current fencing token {new} of "
                                 f"{run.lease_resource}") as refused:
            write()
        assert refused.value.current_token == new
    assert snapshot() == before
    assert not Fact.objects.exists()


def test_the_ledger_refuses_a_fact_of_a_leased_run_without_the_token(leased):
    run, old, new = leased
    for token in (None, old):
        with pytest.raises(StaleFencingToken):
            facts.assert_fact("order-9", "refunded", True, source="refunds", run=run,
                              fencing_token=token)
    assert not Fact.objects.exists()
