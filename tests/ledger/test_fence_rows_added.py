"""A leased run takes no step, obligation or episode without its lease's current token.

A worker whose lease was taken over could add a step, open an obligation or record an
episode on the run by leaving its token out. Once a run is leased (held, expired or
released), every such write carries the current token: none, or an older one, is refused
by the ledger (StaleFencingToken) and by PostgreSQL on its own (`step_added_fenced`,
`obligation_opened_fenced`, `episode_fenced`, with the fence's hint, which reaches the
caller as StaleFencingToken too), as the owner and as each role in its own process; the
holder's writes with its token are taken. A run never leased takes them without a token.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.db import DatabaseError, connection, transaction

from ledger import episodes, leases, obligations, runs
from ledger.errors import StaleFencingToken
from ledger.models import Episode, Obligation, Step
from ledger.models.triggers import FENCE_HINT
from tests.conftest import TEST_LOGINS
from tests.support.processes import run_as

pytestmark = pytest.mark.django_db(transaction=True)

MINUTE = timedelta(minutes=1)
CHECK = "23514"
NO_PRIVILEGE = "42501"
TABLES = ("ledger_step", "ledger_obligation", "ledger_episode", "ledger_lease")


@pytest.fixture
def leased():
    """Run run-9 leased twice by worker-a (tokens old < new), with step pack (pending) and
    obligation refund-9 (open) added before it was leased; run-10 never leased.
    Returns (run, other, old, new)."""
    run = runs.start("Refund order 9", run_id="run-9")
    other = runs.start("Another run", run_id="run-10")
    runs.add_step(run, "pack")
    obligations.open(run, "refund", "refund-9")
    old = leases.acquire(run.lease_resource, "worker-a", MINUTE)
    new = leases.acquire(run.lease_resource, "worker-a", MINUTE)
    return run, other, old, new


def snapshot() -> dict:
    with connection.cursor() as cursor:
        state = {}
        for table in TABLES:
            cursor.execute(f"SELECT count(*), md5(coalesce(string_agg(t::text, '|' "
                           f"ORDER BY t.id), '')) FROM {table} t")
            state[table] = cursor.fetchone()
        return state


def writes(run):
    """{name: write(token)}: each agent write to `run` the fence covers, by the ledger."""
    return {
        "add_step": lambda token: runs.add_step(run, "ship", depends_on=["pack"],
                                                fencing_token=token),
        "obligations.open": lambda token: obligations.open(run, "email", "email-9",
                                                           fencing_token=token),
        "episodes.record": lambda token: episodes.record(run, "assistant", content="said",
                                                         fencing_token=token),
        "commit_step": lambda token: runs.commit_step(run, "pack", fencing_token=token),
        "obligations.commit": lambda token: obligations.commit("refund-9", {"id": "r-1"},
                                                               fencing_token=token),
    }


def test_the_ledger_refuses_a_leased_run_s_writes_without_the_current_token(leased):
    run, _, old, new = leased
    before = snapshot()
    for name, write in writes(run).items():
        for token in (None, old):
            with pytest.raises(StaleFencingToken) as refused:
                write(token)
            assert refused.value.current_token == new, (name, token)
            assert run.lease_resource in str(refused.value), (name, token)
    assert snapshot() == before


def test_postgresql_alone_refuses_them_and_the_refusal_is_stale_fencing_token(
        leased, monkeypatch):
    run, _, old, new = leased
    # Without the ledger's own check, each write reaches PostgreSQL, which refuses it.
    monkeypatch.setattr(leases, "check_run", lambda run_pk, token: None)
    before = snapshot()
    for name, write in writes(run).items():
        for token, words in ((None, f"expected the current fencing token {new} of "
                                    f"{run.lease_resource}"),
                             (old, f"found current token {new} of {run.lease_resource}")):
            if token is not None and name in ("commit_step", "obligations.commit"):
                words = f"expected the current fencing token {new} of {run.lease_resource}"
            with pytest.raises(StaleFencingToken, match=words) as refused:
                write(token)
            assert refused.value.current_token == new, (name, token)
    assert snapshot() == before


def test_the_holder_writes_with_its_token_and_a_run_never_leased_without_one(leased):
    run, other, _, new = leased
    done = {name: write(new) for name, write in writes(run).items()}
    assert done["add_step"].added_token == new
    assert done["obligations.open"].opened_token == new
    assert done["episodes.record"].fencing_token == new
    assert (done["commit_step"].state, done["commit_step"].committed_token) == ("committed",
                                                                                new)
    assert done["obligations.commit"].fencing_token == new
    # A run never leased: without a token, as before; a token names no lease of it.
    assert runs.add_step(other, "pack").added_token is None
    assert obligations.open(other, "email", "email-10").opened_token is None
    assert episodes.record(other, "user", content="hello").fencing_token is None
    with pytest.raises(StaleFencingToken, match="found no lease at all"):
        runs.add_step(other, "ship", fencing_token=new)


def test_a_run_stays_fenced_after_its_lease_ends(leased):
    run, _, _, new = leased
    leases.release(run.lease_resource, "worker-a", new)
    with pytest.raises(StaleFencingToken):
        episodes.record(run, "assistant", content="after the end")
    assert not Episode.objects.exists()
    # The token of the released lease is still the current one: its holder may write.
    assert episodes.record(run, "assistant", content="closing note",
                           fencing_token=new).fencing_token == new


# --- PostgreSQL, as the owner and as each role ---------------------------------------------


def inserts(run_pk: int, other_pk: int, old: int, new: int) -> list:
    """(name, statement, parameters): raw INSERTs of the three rows, without a token, with
    the old one and with the current one on the leased run, and without one on the run
    never leased."""
    step = ("INSERT INTO ledger_step (run_id, step_id, state, created_at, added_token) "
            "VALUES (%s, %s, 'pending', now(), %s)")
    obligation = ("INSERT INTO ledger_obligation (run_id, tenant, kind, key, state, "
                  "cancel_reason, created_at, opened_token) VALUES (%s, 'default', 'refund', "
                  "%s, 'open', '', now(), %s)")
    episode = ("INSERT INTO ledger_episode (run_id, tenant, role, content_ref, content, "
               "created_at, fencing_token) VALUES (%s, 'default', 'assistant', '', %s, "
               "now(), %s)")
    found = []
    for label, token in (("without a token", None), ("with the old token", old),
                         ("with the current token", new)):
        slug = label.replace(" ", "-")
        found += [(f"step {label}", step, [run_pk, f"s-{slug}", token]),
                  (f"obligation {label}", obligation, [run_pk, f"o-{slug}", token]),
                  (f"episode {label}", episode, [run_pk, slug, token])]
    found += [("step of a run never leased", step, [other_pk, "s-free", None]),
              ("obligation of a run never leased", obligation, [other_pk, "o-free", None]),
              ("episode of a run never leased", episode, [other_pk, "free", None])]
    return found


def attempt_each(cursor, attempts) -> dict:
    """Each statement in its own transaction: {name: [sqlstate, hint]}, or None if taken."""
    found = {}
    for name, sql, params in attempts:
        try:
            with transaction.atomic():
                cursor.execute(sql, params)
        except DatabaseError as exc:
            found[name] = [exc.__cause__.sqlstate, exc.__cause__.diag.message_hint]
        else:
            found[name] = None
    return found


def expected(attempts, *, may_insert: bool) -> dict:
    """What PostgreSQL answers: the fence's refusal of a leased run's rows without the
    current token, the rest taken; for a role without INSERT on the tables, no privilege."""
    if not may_insert:
        return {name: [NO_PRIVILEGE, None] for name, _, _ in attempts}
    return {name: None if "current token" in name or "never leased" in name
            else [CHECK, FENCE_HINT] for name, _, _ in attempts}


def test_postgresql_refuses_the_owner_s_rows_without_the_current_token(leased):
    run, other, old, new = leased
    attempts = inserts(run.pk, other.pk, old, new)
    with connection.cursor() as cursor:
        found = attempt_each(cursor, attempts)
    assert found == expected(attempts, may_insert=True)
    assert sorted(Step.objects.filter(added_token=new).values_list("step_id", flat=True)) \
        == ["s-with-the-current-token"]


@pytest.mark.parametrize("kind", ["agent", "reconciler", "desk"])
def test_postgresql_refuses_each_role_s_rows_without_the_current_token(leased, kind):
    run, other, old, new = leased
    attempts = inserts(run.pk, other.pk, old, new)
    before = snapshot()
    code = f"""
import json
from django.db import connection
from tests.ledger.test_fence_rows_added import attempt_each

result = {{}}
with connection.cursor() as cursor:
    cursor.execute("SELECT current_user")
    result["login"] = cursor.fetchone()[0]
    result["found"] = attempt_each(cursor, json.loads({json.dumps(attempts)!r}))
"""
    found = run_as(TEST_LOGINS[kind], code)
    assert found["login"] == TEST_LOGINS[kind]
    # Only the agent's role may add these rows at all; the others lack the grant.
    assert found["found"] == expected(attempts, may_insert=kind == "agent")
    if kind != "agent":
        assert snapshot() == before


def test_the_agent_role_s_ledger_calls_are_fenced_and_the_holder_s_taken(leased):
    run, _, old, new = leased
    found = run_as(TEST_LOGINS["agent"], f"""
from ledger import episodes, obligations, runs
from ledger.errors import StaleFencingToken

result = {{"refused": {{}}}}
calls = {{
    "add_step": lambda t: runs.add_step("run-9", "ship", fencing_token=t),
    "obligations.open": lambda t: obligations.open("run-9", "email", "email-9",
                                                   fencing_token=t),
    "episodes.record": lambda t: episodes.record("run-9", "assistant", content="said",
                                                 fencing_token=t),
}}
for name, call in calls.items():
    for token in (None, {old}):
        try:
            call(token)
        except StaleFencingToken as exc:
            result["refused"][f"{{name}} {{token}}"] = exc.current_token
result["taken"] = [calls["add_step"]({new}).added_token,
                   calls["obligations.open"]({new}).opened_token,
                   calls["episodes.record"]({new}).fencing_token]
""")
    assert found["refused"] == {f"{name} {token}": new
                                for name in ("add_step", "obligations.open", "episodes.record")
                                for token in (None, old)}
    assert found["taken"] == [new, new, new]
    assert Obligation.objects.get(key="email-9").opened_token == new
