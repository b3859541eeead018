"""Who wrote it (issue 41, items 1, 2 and 5): PostgreSQL takes no writer's word about itself.

1. An event's actor kind is one of agent, human, reconciler, system, spelled exactly:
   'person', 'Agent', 'HUMAN', 'agent ' are refused as every role and as the owner, also
   where 'Agent' would have slipped past the fence of a leased run.
2. The fence follows the row's run, not the actor kind: a leased run's operation is not
   submitted without the lease's current token whatever kind the event names (a person's,
   the system's); a leased run's fact is not superseded by a successor without a run (it
   inherits the run, and with it the fence), of another run, or, from the desk, without
   the person's decision; a step, an obligation or an episode written under a stale token
   is refused.
5. The duplicate mark changes only with its event: a bare UPDATE of `conflict` is refused.

Each role's attempts run in one child process logged in as that role (each attempt in its
own transaction, deferred checks run at its end), the owner's in this process; then the
rightful paths still work, as those roles.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.db import DatabaseError, connection, transaction

from ledger import episodes, facts, leases, obligations, receipts, runs
from ledger.errors import StaleFencingToken
from ledger.models import Episode, Fact, FactConflict, Obligation, Operation, Step
from ledger.states import State
from tests.conftest import TEST_LOGINS
from tests.factories import OperationFactory, UserFactory
from tests.support.processes import run_as

pytestmark = pytest.mark.django_db(transaction=True)

MINUTE = timedelta(minutes=1)
CHECK = "23514"
NO_PRIVILEGE = "42501"
UNKNOWN_KIND = "expected an actor kind among agent, human, reconciler, system"
# Spellings of no kind, and of a kind but not exactly.
FORGED_KINDS = ["person", "Agent", "HUMAN", "agent ", "Reconciler"]
TABLES = ("ledger_operation", "ledger_operationevent", "ledger_fact", "ledger_factconflict",
          "ledger_step", "ledger_obligation", "ledger_episode")


def attempt_each(cursor, attempts) -> dict:
    """Each attempt (name, [[sql, params], ...]) in its own transaction, deferred checks at
    its end: {name: [sqlstate, message]} when refused, {name: None} when taken."""
    found = {}
    for name, statements in attempts:
        try:
            with transaction.atomic():
                for sql, params in statements:
                    cursor.execute(sql, params)
                cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        except DatabaseError as exc:
            found[name] = [exc.__cause__.sqlstate, exc.__cause__.diag.message_primary]
        else:
            found[name] = None
    return found


def snapshot() -> dict:
    with connection.cursor() as cursor:
        state = {}
        for table in TABLES:
            cursor.execute(f"SELECT count(*), md5(coalesce(string_agg(t::text, '|' "
                           f"ORDER BY t.id), '')) FROM {table} t")
            state[table] = cursor.fetchone()
        return state


def next_fact_id() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT nextval(pg_get_serial_sequence('ledger_fact', 'id'))")
        return cursor.fetchone()[0]


@pytest.fixture
def world():
    """Run run-9 leased twice by worker-a (tokens old < new) with five planned operations,
    its fact order-9 refunded v1 (under the current token) contested by a candidate, and
    run-10 never leased; an operation without a run planned, one succeeded; a reviewer."""
    reviewer = UserFactory(username="reviewer", role="reviewer")
    run = runs.start("Refund order 9", run_id="run-9")
    other = runs.start("Another run", run_id="run-10")
    old = leases.acquire(run.lease_resource, "worker-a", MINUTE)
    new = leases.acquire(run.lease_resource, "worker-a", MINUTE)
    leased = [OperationFactory(run=run, idempotency_key=f"leased-{n}") for n in range(5)]
    fact = facts.assert_fact("order-9", "refunded", False, source="refunds", run=run,
                             fencing_token=new)
    candidate = facts.assert_fact("order-9", "refunded", True, source="support",
                                  run=run, fencing_token=new)
    assert candidate.is_candidate
    return {
        "reviewer": reviewer.pk, "run": run.pk, "other": other.pk, "old": old, "new": new,
        "leased": [op.pk for op in leased], "fact": fact.pk,
        "plain": OperationFactory().pk,
        "succeeded": OperationFactory(state=State.SUCCEEDED).pk,
    }


def forge_event(op_pk: int, kind: str, *, version: int, from_state="planned",
                to_state="abandoned", decided_by=None) -> list:
    """A bare event of `op_pk`, as the desk's timeline would show it."""
    return ["INSERT INTO ledger_operationevent (operation_id, tenant, version, from_state, "
            "to_state, actor_kind, actor_id, reason, evidence, fencing_token, decided_by_id, "
            "created_at, external_id) SELECT id, tenant, %s, %s, %s, %s, 'rev1', 'Approved', "
            "NULL, NULL, %s, now(), '' FROM ledger_operation WHERE id = %s",
            [version, from_state, to_state, kind, decided_by, op_pk]]


def submit(op_pk: int, kind: str, *, token=None, decided_by=None) -> list:
    """The move planned -> submitted of `op_pk` with its event, one statement, as
    ledger.transitions writes it, naming actor kind `kind`."""
    return ["WITH changed AS (UPDATE ledger_operation SET state = 'submitted', "
            "version = version + 1, state_changed_at = now(), submitted_at = now() "
            "WHERE id = %s AND state = 'planned' RETURNING id, tenant, version) "
            "INSERT INTO ledger_operationevent (operation_id, tenant, version, from_state, "
            "to_state, actor_kind, actor_id, reason, fencing_token, decided_by_id, created_at, "
            "external_id) SELECT id, tenant, version, 'planned', 'submitted', %s, 'forger', "
            "'forged', %s, %s, now(), '' FROM changed",
            [op_pk, kind, token, decided_by]]


def supersede(fact_pk: int, new_id: int, *, run, token=None, source="forger") -> list:
    """Version 2 of fact `fact_pk`, linked from it, of run `run` (None: without a run)."""
    return [
        ["UPDATE ledger_fact SET status = 'superseded', superseded_by_id = %s WHERE id = %s",
         [new_id, fact_pk]],
        ["INSERT INTO ledger_fact (id, tenant, subject, predicate, value, value_fingerprint, "
         "source, observed_at, version, status, run_id, fencing_token) VALUES (%s, "
         "'default', 'order-9', 'refunded', 'true', 'forged', %s, now(), 2, 'current', %s, "
         "%s)", [new_id, source, run, token]],
    ]


def attempts_for(kind: str, w: dict) -> dict[str, list]:
    """{item: [(name, statements)]}: what `kind` ("owner" for the tables' owner) may try,
    each attempt within its grants."""
    run, old, plain, reviewer = w["run"], w["old"], w["plain"], w["reviewer"]
    a, b, c, d, e = w["leased"]  # one per submission, so that each attempt is its own
    who = {}
    # 1. Actor kinds outside the closed set: a bare event, and a leased run's submission.
    who["1"] = [(f"event as {forged!r}", [forge_event(plain, forged, version=100 + n)])
                for n, forged in enumerate(FORGED_KINDS)]
    who["1"].append(("leased run's operation submitted as 'Agent' without a token",
                     [submit(a, "Agent")]))
    # 2. The fence follows the run.
    two = []
    if kind in ("agent", "owner"):
        two += [
            ("submitted by the agent without a token", [submit(d, "agent")]),
            ("submitted by the agent with the old token", [submit(e, "agent", token=old)]),
            ("fact superseded by a successor without a run",
             supersede(w["fact"], next_fact_id(), run=None)),
            ("fact superseded by a successor of a run never leased",
             supersede(w["fact"], next_fact_id(), run=w["other"])),
            ("fact superseded by a successor of its run with the old token",
             supersede(w["fact"], next_fact_id(), run=run, token=old)),
            ("step added under the old token",
             [["INSERT INTO ledger_step (run_id, step_id, state, created_at, added_token) "
               "VALUES (%s, 'forged', 'pending', now(), %s)", [run, old]]]),
            ("obligation opened under the old token",
             [["INSERT INTO ledger_obligation (run_id, tenant, kind, key, state, "
               "cancel_reason, opened_token) VALUES (%s, 'default', 'refund', 'forged-9', "
               "'open', '', %s)", [run, old]]]),
            ("episode recorded under the old token",
             [["INSERT INTO ledger_episode (run_id, tenant, role, content_ref, content, "
               "fencing_token) VALUES (%s, 'default', 'assistant', '', 'forged', %s)",
               [run, old]]]),
            ("step added under a token of a run never leased",
             [["INSERT INTO ledger_step (run_id, step_id, state, created_at, added_token) "
               "VALUES (%s, 'forged', 'pending', now(), 1)", [w["other"]]]]),
        ]
    if kind in ("reconciler", "owner"):
        two.append(("submitted as the system without a token", [submit(b, "system")]))
    if kind in ("desk", "owner"):
        two += [
            ("submitted as a person without a token",
             [submit(c, "human", decided_by=reviewer)]),
            ("fact superseded as a person without a decision",
             supersede(w["fact"], next_fact_id(), run=None, source="reviewer:reviewer")),
        ]
    if kind == "desk":
        two.append(("fact superseded by the desk without a run",
                    supersede(w["fact"], next_fact_id(), run=None)))
    who["2"] = two
    # 5. The duplicate mark without its event.
    who["5"] = [("duplicate mark without an event",
                 [["UPDATE ledger_operation SET conflict = 'duplicate' WHERE id = %s",
                   [w["succeeded"]]]])]
    return who


# Which check refuses which attempt (by the start of the attempt's name), where PostgreSQL
# lets the role that far: the fence's own words, not another rule's.
REASONS = {
    "submitted": "expected the current fencing token",
    "fact superseded by a successor without a run": "expected the current fencing token",
    "fact superseded by a successor of a run never leased": "expected the successor of fact",
    "fact superseded by a successor of its run": "expected the current fencing token",
    "fact superseded as a person": "expected a successor of a leased run's fact written "
                                   "without the lease's token to be a person's decision",
    "step added under a token of a run never leased": "found no lease at all",
    "step added": "to be current for the lease of the run of step forged added",
    "obligation opened": "to be current for the lease of the run of obligation forged-9",
    "episode recorded": "to be current for the lease of the run of an episode said by",
    "duplicate mark": "expected its conflict mark to change only with its event",
}


# The desk may not lock a run's lease, which the fence does (a submission, or a fact that
# inherited its run): refused by the grants, before the fence's own words.
LEASE_LOCK = "permission denied for table ledger_lease"


def reason(name: str) -> str:
    return next(words for start, words in REASONS.items() if name.startswith(start))


def assert_each_refused(found: dict, who: dict, as_whom: str) -> None:
    """Every attempt refused by PostgreSQL, item by item (all items' failures named at
    once), the actor kinds by their check."""
    wrong = {}
    for item, attempts in who.items():
        for name, _ in attempts:
            if found[name] is None:
                wrong.setdefault(item, []).append(f"{name}: taken")
                continue
            sqlstate, message = found[name]
            # The ledger's checks say what they expected; a grant's refusal is PostgreSQL's
            # own ("permission denied for table ledger_lease": the fence's lock).
            if not (sqlstate == CHECK and "expected" in message and "found" in message
                    or sqlstate == NO_PRIVILEGE and "permission denied" in message):
                wrong.setdefault(item, []).append(f"{name}: {sqlstate} {message}")
                continue
            # The actor kinds by their check; the rest by the rule each attempt meets.
            words = (UNKNOWN_KIND if item == "1" else LEASE_LOCK if sqlstate == NO_PRIVILEGE
                     else reason(name))
            if words not in message:
                wrong.setdefault(item, []).append(f"{name}: refused otherwise: {message}")
    assert not wrong, f"expected PostgreSQL to refuse each attempt of {as_whom}, found, " \
                      f"by item: {json.dumps(wrong, indent=1)}"


def flat(who: dict) -> list:
    return [attempt for attempts in who.values() for attempt in attempts]


def test_the_owner_s_forgeries_of_who_wrote_it_are_refused(world):
    who = attempts_for("owner", world)
    before = snapshot()
    with connection.cursor() as cursor:
        found = attempt_each(cursor, flat(who))
    assert_each_refused(found, who, "the owner")
    assert snapshot() == before


# What each child runs after its attempts: the rightful path of its role, still working.
RIGHTFUL = {
    # A twin's success marks the succeeded twin duplicate, in the statement of its event.
    "agent": """
from ledger import receipts
from ledger.models import Operation
twin = Operation.objects.get(pk={twin})
receipts.mark_succeeded(twin, external_id="article-2")
result["rightful"] = [twin.conflict,
                      Operation.objects.get(pk={succeeded}).conflict]
""",
    # A person decides the conflict on the leased run's fact: the decision inherits the run.
    "desk": """
from django.contrib.auth.models import User
from ledger import facts
from ledger.models import FactConflict
user = User(pk={reviewer}, username="reviewer", is_active=True)
user._perm_cache = {{"ledger.resolve_factconflict"}}
user._ledger_tenants = frozenset({{"default"}})
written = facts.resolve_conflict(FactConflict.objects.get(), winner="candidate", user=user,
                                 reason="the refund went out")
result["rightful"] = [written.version, written.run_id, written.source]
""",
    "reconciler": "",
}


@pytest.mark.parametrize("kind", ["agent", "reconciler", "desk"])
def test_each_role_s_forgeries_of_who_wrote_it_are_refused(world, kind):
    who = attempts_for(kind, world)
    twin = None
    if kind == "agent":
        first = Operation.objects.get(pk=world["succeeded"])
        twin = OperationFactory(state=State.SUBMITTED, intent=first.intent,
                                idempotency_key="twin-2").pk
    before = snapshot()
    code = f"""
import json
from django.db import connection
from tests.ledger.test_trust_who import attempt_each

result = {{}}
with connection.cursor() as cursor:
    cursor.execute("SELECT current_user")
    result["login"] = cursor.fetchone()[0]
    result["found"] = attempt_each(cursor, json.loads({json.dumps(flat(who))!r}))
""" + RIGHTFUL[kind].format(twin=twin, **world)
    found = run_as(TEST_LOGINS[kind], code)
    assert found["login"] == TEST_LOGINS[kind]
    assert_each_refused(found["found"], who, f"{kind} ({TEST_LOGINS[kind]})")
    if kind == "agent":
        assert found["rightful"] == ["duplicate", "duplicate"]
    elif kind == "desk":
        assert found["rightful"] == [2, world["run"], "reviewer:reviewer"]
        assert FactConflict.objects.get().state == "resolved"
    else:
        assert snapshot() == before


def test_a_stale_worker_adds_records_and_opens_nothing_and_the_holder_does(world,
                                                                         monkeypatch):
    run, old, new = runs.as_run("run-9"), world["old"], world["new"]
    writes = {
        "add_step": lambda token: runs.add_step(run, "pack", fencing_token=token),
        "episodes.record": lambda token: episodes.record(run, "assistant", content="said",
                                                         fencing_token=token),
        "obligations.open": lambda token: obligations.open(run, "refund", "refund-9",
                                                           fencing_token=token),
    }
    before = snapshot()
    for write in writes.values():
        with pytest.raises(StaleFencingToken, match=f"current for {run.lease_resource}"):
            write(old)
    # Without the ledger's own check the write reaches PostgreSQL, which refuses it.
    monkeypatch.setattr(leases, "check_run", lambda run_pk, token: None)
    for name, write in writes.items():
        with pytest.raises(StaleFencingToken, match=f"current token {new} of "
                                                    f"{run.lease_resource}") as refused:
            write(old)
        assert refused.value.current_token == new, name
    assert snapshot() == before
    monkeypatch.undo()
    assert runs.add_step(run, "pack", fencing_token=new).added_token == new
    assert episodes.record(run, "assistant", content="said",
                           fencing_token=new).fencing_token == new
    assert obligations.open(run, "refund", "refund-9", fencing_token=new).opened_token == new
    assert (Step.objects.get().added_token, Episode.objects.get().fencing_token,
            Obligation.objects.get().opened_token) == (new, new, new)


def test_a_fact_s_successor_inherits_its_run_and_its_fence(world):
    run = runs.as_run("run-9")
    first = Fact.objects.get(pk=world["fact"])
    # The holder supersedes its run's fact; a successor written without a run inherits it.
    second = facts.assert_fact("order-9", "refunded", "partly", source="refunds", run=run,
                               fencing_token=world["new"], expected_version=1)
    assert (second.version, second.run_id) == (2, run.pk)
    leases.release(run.lease_resource, "worker-a", world["new"])
    with pytest.raises(StaleFencingToken):
        # The run stays fenced after its lease ends: a run-less successor inherits it.
        facts.assert_fact("order-9", "refunded", "no", source="refunds", expected_version=2)
    assert Fact.objects.get(pk=second.pk).status == "current"
    assert first.run_id == run.pk
    # A run never leased: the successor without a run takes its predecessor's run.
    free = runs.start("Unleased", run_id="run-11")
    facts.assert_fact("order-11", "paid", False, source="payments", run=free)
    successor = facts.assert_fact("order-11", "paid", True, source="payments",
                                  expected_version=1)
    assert (successor.version, successor.run_id) == (2, free.pk)


def test_the_duplicate_mark_of_a_twin_s_success_still_comes_with_that_event(world):
    first = Operation.objects.get(pk=world["succeeded"])
    twin = OperationFactory(state=State.SUBMITTED, intent=first.intent,
                            idempotency_key="twin-2")
    receipts.mark_succeeded(twin, external_id="article-2")
    assert Operation.objects.get(pk=first.pk).conflict == "duplicate"
    assert twin.conflict == "duplicate"
