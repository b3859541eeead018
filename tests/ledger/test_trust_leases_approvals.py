"""Leases, approval requests and the workers' locks take no writer's word (issue 41, items 3,
4 and 9), refused by PostgreSQL as each role that could try, each from a real child process
logged in as that role (one child per role, every attempt of that role in it), and as the
tables' owner where the owner is refused too.

3. A lease changes only through ledger_lease_acquire / _renew / _release: no login rewinds a
   token, takes a live lease, plants one or deletes one; the functions still work for the
   agent's and the reconciler's logins, tokens increasing.
4. An agent creates only a pending request, of its operation's tenant, asking at least what
   the policies ask; only the desk marks it approved (with enough live approvals) or denied
   (with a person's denial).
9. An agent's or the desk's login holding the old advisory locks, or trying the new ones,
   stalls neither the sealer nor the notification loop.
"""

from __future__ import annotations

import json
import subprocess
from datetime import timedelta

import pytest
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from ledger import approvals, chain, leases, notifications
from ledger.models import ApprovalRequest, Lease, NotificationBatch, Operation, OperationEvent
from ledger.states import State
from tests.conftest import TEST_LOGINS
from tests.factories import OperationFactory, UserFactory, reconciler_lease
from tests.support.processes import run_as, spawn, wait_for_line

pytestmark = pytest.mark.django_db(transaction=True)

NO_PRIVILEGE = "42501"
CHECK = "23514"
HELD = "run:default:run-held"
MINUTE = timedelta(minutes=1)

# The child's tools: `attempt` runs raw SQL in its own transaction (checks deferred to the
# commit included) and records what PostgreSQL said; `call` runs a ledger function.
TOOLS = """
import json, sys
from datetime import timedelta
from django.db import connection, transaction
from ledger import approvals, errors, leases, receipts
from ledger.models import Operation

result = {}
with connection.cursor() as cursor:
    cursor.execute("SELECT current_user")
    result["login"] = cursor.fetchone()[0]

def attempt(name, sql, params=()):
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql, params)
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    except Exception as exc:
        cause = exc.__cause__ or exc
        result[name] = ["refused", getattr(cause, "sqlstate", None), str(exc).splitlines()[0]]
    else:
        result[name] = ["accepted", None, ""]

def call(name, fn):
    try:
        value = fn()
    except Exception as exc:
        result[name] = ["raised", type(exc).__name__, str(exc)]
    else:
        result[name] = ["returned", None, value if isinstance(value, (int, str)) else None]

op = lambda pk: Operation.objects.get(pk=pk)
"""

# Item 3, as any login: the raw writes that rewound a token and took a live lease, then the
# sanctioned functions on a lease of the login's own.
LEASE_ATTEMPTS = """
attempt("lease.rewind", "UPDATE ledger_lease SET token = 1 WHERE resource = %s", [HELD])
attempt("lease.take_live", "UPDATE ledger_lease SET owner = 'attacker', "
        "expires_at = now() + interval '30 days' WHERE resource = %s", [HELD])
attempt("lease.extend", "UPDATE ledger_lease SET expires_at = now() + interval '30 days' "
        "WHERE resource = %s", [HELD])
attempt("lease.plant", "INSERT INTO ledger_lease (resource, owner, token, acquired_at, "
        "expires_at) VALUES ('run:default:run-planted', 'attacker', 1000, now(), "
        "now() + interval '30 days')")
attempt("lease.delete", "DELETE FROM ledger_lease WHERE resource = %s", [HELD])
attempt("lease.upsert", "INSERT INTO ledger_lease AS l (resource, owner, token, acquired_at, "
        "expires_at) VALUES (%s, 'attacker', 1, now(), now()) ON CONFLICT (resource) DO "
        "UPDATE SET owner = 'attacker', token = 1", [HELD])
call("lease.acquire_live", lambda: leases.acquire(HELD, "attacker", timedelta(days=30)))
"""

# ... and the functions, as a login that may call them (the agent's, the reconciler's).
LEASE_FUNCTIONS = """
mine = f"own:{result['login']}"
tokens = [leases.acquire(mine, "me", timedelta(minutes=1)),
          leases.acquire(mine, "me", timedelta(minutes=1))]
leases.renew(mine, "me", tokens[-1], timedelta(minutes=2))
call("lease.renew_stale", lambda: leases.renew(mine, "me", tokens[0], timedelta(minutes=1)))
leases.release(mine, "me", tokens[-1])
tokens.append(leases.acquire(mine, "someone-else", timedelta(minutes=1)))
result["lease.own_tokens"] = tokens
"""


def held_lease() -> Lease:
    """A live lease of worker-a at token 2, and its row as it stands."""
    leases.acquire(HELD, "worker-a", timedelta(minutes=10))
    leases.acquire(HELD, "worker-a", timedelta(minutes=10))
    return Lease.objects.get(resource=HELD)


def lease_prelude(*, functions: bool = True) -> str:
    return TOOLS + f"HELD = {HELD!r}\n" + LEASE_ATTEMPTS + (LEASE_FUNCTIONS if functions else "")


def assert_lease_attempts_refused(found: dict, before: Lease, *, functions: bool = True) -> None:
    for name in ("lease.rewind", "lease.take_live", "lease.extend", "lease.plant",
                 "lease.delete", "lease.upsert"):
        verdict, sqlstate, message = found[name]
        assert (verdict, sqlstate) == ("refused", NO_PRIVILEGE), (
            f"expected {name} refused by PostgreSQL as {found['login']} (42501), found "
            f"{found[name]}")
    if functions:
        assert found["lease.acquire_live"][:2] == ["raised", "LeaseHeld"], (
            found["lease.acquire_live"])
        assert found["lease.renew_stale"][:2] == ["raised", "StaleFencingToken"]
        tokens = found["lease.own_tokens"]
        assert tokens == sorted(tokens) and len(set(tokens)) == 3, (
            f"expected the functions to hand out increasing tokens, found {tokens}")
    else:
        assert found["lease.acquire_live"][:2] == ["raised", "DatabaseRefusedByRole"], (
            f"expected the lease functions refused to {found['login']}, found "
            f"{found['lease.acquire_live']}")
    after = Lease.objects.get(resource=HELD)
    assert (after.owner, after.token, after.expires_at) == (
        before.owner, before.token, before.expires_at), (
        f"expected the held lease untouched, found {after} until {after.expires_at}")
    assert not Lease.objects.filter(resource="run:default:run-planted").exists()


# --- item 4: approval requests ------------------------------------------------------------

APPROVAL_ATTEMPTS_AGENT = """
call("approval.request", lambda: approvals.request(op(OWN), note="please") and "asked")
attempt("approval.self_approved", "UPDATE ledger_approvalrequest SET approvals_needed = 0, "
        "status = 'approved', decided_at = now() WHERE operation_id = %s", [OWN])
attempt("approval.marked_approved", "UPDATE ledger_approvalrequest SET status = 'approved', "
        "decided_at = now() WHERE operation_id = %s", [OWN])
attempt("approval.nobody_asked", "UPDATE ledger_approvalrequest SET approvals_needed = 0 "
        "WHERE operation_id = %s", [OWN])
attempt("approval.insert_approved", "INSERT INTO ledger_approvalrequest (operation_id, tenant, "
        "note, requested_by, approvals_needed, status, requested_at, decided_at) VALUES "
        "(%s, 'acme', '', 'agent', 1, 'approved', now(), now())", [UNASKED])
attempt("approval.insert_other_tenant", "INSERT INTO ledger_approvalrequest (operation_id, "
        "tenant, note, requested_by, approvals_needed, status, requested_at, decided_at) "
        "VALUES (%s, 'acme', '', 'agent', 1, 'pending', now(), NULL)", [OTHER])
attempt("approval.insert_approved_other_tenant", "INSERT INTO ledger_approvalrequest "
        "(operation_id, tenant, note, requested_by, approvals_needed, status, requested_at, "
        "decided_at) VALUES (%s, 'acme', '', 'agent', 0, 'approved', now(), now())", [OTHER])
call("approval.submit", lambda: receipts.mark_submitted(op(OWN)) and "submitted")
"""


def planned(operation: str, tenant: str) -> Operation:
    return OperationFactory(operation=operation, tenant=tenant, state=State.PLANNED)


# --- item 9: the workers' locks ------------------------------------------------------------

# Take what stalled the workers before (the sealer's advisory lock of tenant acme, the
# notification loop's of the channel), try the new lock every way an application role
# could, then hold a transaction open and wait for the parent.
HOLD_LOCKS = """
with connection.cursor() as cursor:
    cursor.execute("SELECT pg_advisory_lock(24129, hashtext('acme'))")
    cursor.execute("SELECT pg_advisory_lock('ledger_notificationchannel'::regclass::oid::integer,"
                   " %s)", [CHANNEL])
attempt("lock.function", "SELECT ledger_worker_lock('seal:acme')")
attempt("lock.function_notify", "SELECT ledger_worker_lock(%s)", [f"notify:{CHANNEL}"])
attempt("lock.rows", "SELECT * FROM ledger_workerlock FOR UPDATE")
attempt("lock.rows_shared", "SELECT * FROM ledger_workerlock FOR KEY SHARE")
attempt("lock.insert", "INSERT INTO ledger_workerlock (name) VALUES ('seal:acme')")
attempt("lock.table", "LOCK TABLE ledger_workerlock IN EXCLUSIVE MODE")
with connection.cursor() as cursor:
    cursor.execute("BEGIN")
    cursor.execute("SELECT count(*) FROM ledger_chainhead")
    cursor.execute("SELECT to_regclass('ledger_workerlock') IS NOT NULL")
    if cursor.fetchone()[0]:
        cursor.execute("SELECT count(*) FROM ledger_workerlock")
    print("HOLDING " + json.dumps(result), flush=True)
    sys.stdin.readline()
    cursor.execute("ROLLBACK")
"""


def workers_world(admin_user) -> int:
    """Unsealed events of tenant acme and a channel of acme with an item to tell; the
    channel's id."""
    OperationFactory(tenant="acme", state=State.MANUAL_REVIEW)
    channel = notifications.create_channel("acme-mail", user=admin_user, kind="email",
                                           tenant="acme", recipients=["oncall@example.com"])
    return channel.pk


def workers_while_held(login: str, code: str) -> tuple[dict, int, list]:
    """Run `code` (it ends holding its locks) in a child as `login`; meanwhile seal tenant
    acme and collect the channels' news here. (the child's results, sealed, batches)"""
    child = spawn(code, login=login, stdin=subprocess.PIPE)
    try:
        found = json.loads(wait_for_line(child, "HOLDING", timeout=90)[len("HOLDING "):])
        sealed = chain.seal(tenant="acme")
        batches = notifications.collect(now=timezone.now())
    finally:
        try:
            child.stdin.write("done\n")
            child.stdin.flush()
            child.communicate(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            child.kill()
    return found, sealed, batches


def assert_workers_not_stalled(found: dict, sealed: int, batches: list) -> None:
    for name in ("lock.function", "lock.function_notify", "lock.rows", "lock.rows_shared",
                 "lock.insert", "lock.table"):
        assert found[name][:2] == ["refused", NO_PRIVILEGE], (
            f"expected {name} refused by PostgreSQL as {found['login']} (42501), found "
            f"{found[name]}")
    unsealed = OperationEvent.objects.filter(tenant="acme", chain_seq__isnull=True).count()
    assert sealed > 0 and unsealed == 0, (
        f"expected the sealer to seal tenant acme while {found['login']} holds its locks, "
        f"found {sealed} sealed and {unsealed} left")
    assert [b.tenant for b in batches] == ["acme"], (
        f"expected the notification loop to collect the acme channel while {found['login']} "
        f"holds its locks, found {len(batches)} batch(es)")
    assert NotificationBatch.objects.filter(tenant="acme").count() == 1


# --- as each role ---------------------------------------------------------------------------


@pytest.fixture
def admin_user():
    """An admin of tenants acme and default (policies, channels)."""
    return UserFactory(username="boss", role="admin", tenants=["acme", "default"])


def test_an_agent_login_cannot_rewind_a_lease_approve_its_own_request_or_stall_the_workers(
        admin_user):
    before = held_lease()
    approvals.set_policy("payments.*", user=admin_user, tenant="acme")
    own = planned("payments.send", "acme")
    unasked = planned("payments.refund", "acme")
    other = planned("payments.send", "globex")
    channel = workers_world(admin_user)
    code = (lease_prelude() + f"OWN, UNASKED, OTHER = {own.pk}, {unasked.pk}, {other.pk}\n"
            + APPROVAL_ATTEMPTS_AGENT + f"CHANNEL = {channel}\n" + HOLD_LOCKS)
    found, sealed, batches = workers_while_held(TEST_LOGINS["agent"], code)

    assert found["login"] == TEST_LOGINS["agent"]
    # 3: leases
    assert_lease_attempts_refused(found, before)
    # 4: approval requests: its own request is made, pending, asking the policy's one person
    assert found["approval.request"] == ["returned", None, "asked"], found["approval.request"]
    for name in ("approval.self_approved", "approval.marked_approved",
                 "approval.nobody_asked", "approval.insert_approved",
                 "approval.insert_other_tenant", "approval.insert_approved_other_tenant"):
        verdict, sqlstate, message = found[name]
        assert verdict == "refused" and sqlstate in (NO_PRIVILEGE, CHECK), (
            f"expected {name} refused by PostgreSQL as the agent, found {found[name]}")
        assert "expected " in message and ", found " in message, message
    assert "expected the people asked to change only when the agent asks again" in \
        found["approval.self_approved"][2]
    assert found["approval.marked_approved"][1] == NO_PRIVILEGE
    assert "approved or denied by the desk" in found["approval.marked_approved"][2]
    assert "from role ledger_test_agent" in found["approval.marked_approved"][2]
    assert "expected at least 1 approval(s) asked" in found["approval.nobody_asked"][2]
    assert "expected a new request pending" in found["approval.insert_approved"][2]
    assert "expected its operation's tenant globex, found acme" in \
        found["approval.insert_other_tenant"][2]
    assert found["approval.submit"][:2] == ["raised", "ApprovalRequired"], found["approval.submit"]
    request = ApprovalRequest.objects.get()
    assert (request.operation_id, request.status, request.approvals_needed, request.tenant) == (
        own.pk, "pending", 1, "acme")
    assert Operation.objects.get(pk=own.pk).state == State.PLANNED
    # 9: the workers' locks
    assert_workers_not_stalled(found, sealed, batches)


def test_a_desk_login_cannot_mark_a_request_decided_without_people_nor_stall_the_workers(
        admin_user):
    before = held_lease()
    undecided = planned("payments.send", "acme")
    approvals.request(undecided, note="pay")
    decided = planned("payments.send", "default")
    approvals.request(decided, note="pay")
    reviewer = UserFactory(username="reviewer", role="reviewer")
    channel = workers_world(admin_user)
    code = lease_prelude(functions=False) + f"""
from django.contrib.auth.models import User
UNDECIDED, DECIDED = {undecided.pk}, {decided.pk}
attempt("approval.marked_approved", "UPDATE ledger_approvalrequest SET status = 'approved', "
        "decided_at = now() WHERE operation_id = %s", [UNDECIDED])
attempt("approval.marked_denied", "UPDATE ledger_approvalrequest SET status = 'denied', "
        "decided_at = now() WHERE operation_id = %s", [UNDECIDED])
call("approval.approve", lambda: approvals.approve(
    op(DECIDED), user=User.objects.get(pk={reviewer.pk})) and "approved")
CHANNEL = {channel}
""" + HOLD_LOCKS
    found, sealed, batches = workers_while_held(TEST_LOGINS["desk"], code)

    assert found["login"] == TEST_LOGINS["desk"]
    # 3: the desk has no way to a lease either
    assert_lease_attempts_refused(found, before, functions=False)
    # 4: a status says what people decided, and nothing else
    for name in ("approval.marked_approved", "approval.marked_denied"):
        assert found[name][:2] == ["refused", CHECK], (
            f"expected {name} refused by PostgreSQL as the desk, found {found[name]}")
    assert "expected 1 live approval(s) of fingerprint" in found["approval.marked_approved"][2]
    assert "expected a person's denial recorded" in found["approval.marked_denied"][2]
    assert ApprovalRequest.objects.get(operation=undecided).status == "pending"
    assert found["approval.approve"] == ["returned", None, "approved"], found["approval.approve"]
    assert ApprovalRequest.objects.get(operation=decided).status == "approved"
    # 9: the workers' locks
    assert_workers_not_stalled(found, sealed, batches)


def test_a_reconciler_login_cannot_rewind_or_take_over_a_lease_nor_forge_a_request():
    before = held_lease()
    op = planned("payments.send", "default")
    found = run_as(TEST_LOGINS["reconciler"], lease_prelude() + f"""
attempt("approval.insert_approved", "INSERT INTO ledger_approvalrequest (operation_id, tenant, "
        "note, requested_by, approvals_needed, status, requested_at, decided_at) VALUES "
        "(%s, 'default', '', 'r', 1, 'approved', now(), now())", [{op.pk}])
""")
    assert found["login"] == TEST_LOGINS["reconciler"]
    assert_lease_attempts_refused(found, before)
    assert found["approval.insert_approved"][:2] == ["refused", NO_PRIVILEGE]
    assert not ApprovalRequest.objects.exists()


# --- as the tables' owner -------------------------------------------------------------------


def refused(sql: str, params=()) -> str:
    with pytest.raises(DatabaseError) as caught, transaction.atomic(), \
            connection.cursor() as cursor:
        cursor.execute(sql, params)
    return str(caught.value)


def test_the_owner_cannot_rewind_a_token_take_over_a_live_lease_or_delete_one():
    before = held_lease()
    assert "expected its fencing token never to decrease, found 2 -> 1" in refused(
        "UPDATE ledger_lease SET token = 1 WHERE resource = %s", [HELD])
    assert "expected a new holder only once the lease expired" in refused(
        "UPDATE ledger_lease SET owner = 'attacker', token = token + 1 WHERE resource = %s",
        [HELD])
    assert "expected a lease row to stay" in refused(
        "DELETE FROM ledger_lease WHERE resource = %s", [HELD])
    assert "expected its resource unchanged" in refused(
        "UPDATE ledger_lease SET resource = 'elsewhere' WHERE resource = %s", [HELD])
    after = Lease.objects.get(resource=HELD)
    assert (after.owner, after.token, after.expires_at) == (
        before.owner, before.token, before.expires_at)
    # What test set-up needs stays the owner's: expiring a lease, then taking it over.
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    first = leases.acquire(f"reconcile:{op.operation_id}", "busy", timedelta(minutes=5))
    assert reconciler_lease(op) == first + 1


def test_the_owner_cannot_write_an_approved_request_nor_one_of_another_tenant(admin_user):
    approvals.set_policy("payments.*", user=admin_user, tenant="acme", consequential=True)
    op = planned("payments.send", "acme")
    columns = ("INSERT INTO ledger_approvalrequest (operation_id, tenant, note, requested_by, "
               "approvals_needed, status, requested_at, decided_at) VALUES ")
    assert "expected a new request pending" in refused(
        columns + "(%s, 'acme', '', 'x', 2, 'approved', now(), now())", [op.pk])
    assert "expected its operation's tenant acme, found globex" in refused(
        columns + "(%s, 'globex', '', 'x', 2, 'pending', now(), NULL)", [op.pk])
    # the consequential policy asks two people: a request asking one is refused
    assert "expected at least 2 approval(s) asked" in refused(
        columns + "(%s, 'acme', '', 'x', 1, 'pending', now(), NULL)", [op.pk])
    approvals.request(op)
    assert ApprovalRequest.objects.get().approvals_needed == 2
    assert "expected 2 live approval(s)" in refused(
        "UPDATE ledger_approvalrequest SET status = 'approved', decided_at = now()")
    assert "expected the people asked to change only when the agent asks again" in refused(
        "UPDATE ledger_approvalrequest SET status = 'denied', approvals_needed = 3, "
        "decided_at = now()")
