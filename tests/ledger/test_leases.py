"""Leases and fencing tokens: tokens only grow, late writers are refused."""

import subprocess
import time
from datetime import timedelta

import pytest
from django.db.models.functions import Now

from ledger import leases, receipts
from ledger.errors import InvalidInput, LeaseHeld, StaleFencingToken
from ledger.models import Lease, OperationEvent, Run
from ledger.states import State
from tests.factories import OperationFactory
from tests.support.processes import spawn, wait_for_line

MINUTE = timedelta(minutes=1)


def wait_for_expiry(resource, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not Lease.objects.filter(resource=resource, expires_at__lte=Now()).exists():
        assert time.monotonic() < deadline, f"expected the lease {resource} to expire"
        time.sleep(0.02)


@pytest.mark.django_db
def test_each_acquisition_gets_a_larger_token_even_by_the_same_owner():
    first = leases.acquire("res", "a", MINUTE)
    second = leases.acquire("res", "a", MINUTE)
    assert second > first
    with pytest.raises(StaleFencingToken, match=f"expected fencing token {first}"):
        leases.check("res", first)
    leases.check("res", second)


@pytest.mark.django_db
def test_a_live_lease_of_another_owner_is_not_taken():
    leases.acquire("res", "a", MINUTE)
    with pytest.raises(LeaseHeld, match="found it held by a") as caught:
        leases.acquire("res", "b", MINUTE)
    assert caught.value.owner == "a"


@pytest.mark.django_db
def test_a_released_lease_is_taken_by_another_owner_with_a_larger_token():
    first = leases.acquire("res", "a", MINUTE)
    leases.release("res", "a", first)
    second = leases.acquire("res", "b", MINUTE)
    assert second > first
    assert leases.current_token("res") == second


@pytest.mark.django_db
def test_renew_and_release_with_a_stale_token_are_refused():
    first = leases.acquire("res", "a", MINUTE)
    leases.acquire("res", "a", MINUTE)
    with pytest.raises(StaleFencingToken):
        leases.renew("res", "a", first, MINUTE)
    with pytest.raises(StaleFencingToken):
        leases.release("res", "a", first)


@pytest.mark.django_db
def test_renew_extends_the_expiry_from_the_database_clock():
    token = leases.acquire("res", "a", timedelta(seconds=5))
    before = Lease.objects.get(resource="res").expires_at
    after = leases.renew("res", "a", token, timedelta(hours=1))
    assert after > before
    assert Lease.objects.get(resource="res").expires_at == after


@pytest.mark.django_db
@pytest.mark.parametrize("call", [
    lambda: leases.acquire("", "a", MINUTE),
    lambda: leases.acquire("res", "", MINUTE),
    lambda: leases.acquire("res", "a", timedelta(0)),
    lambda: leases.acquire("res", "a", 60),
])
def test_bad_arguments_are_refused_and_nothing_is_written(call):
    with pytest.raises(InvalidInput, match="expected"):
        call()
    assert not Lease.objects.exists()


@pytest.mark.django_db
def test_check_of_a_resource_that_was_never_leased_says_so():
    with pytest.raises(StaleFencingToken, match="found no lease at all"):
        leases.check("never-leased", 1)


# --- fencing of receipts -------------------------------------------------------------------


@pytest.mark.django_db
def test_mark_with_a_fencing_token_is_refused_once_a_newer_token_exists_for_the_run():
    run = Run.objects.create(run_id="run-fenced")
    old = leases.acquire(run.lease_resource, "agent-a", MINUTE)
    op = OperationFactory(run=run)
    receipts.mark_submitted(op, fencing_token=old)
    new = leases.acquire(run.lease_resource, "agent-a", MINUTE)
    with pytest.raises(StaleFencingToken, match=f"expected fencing token {old}.*current token "
                                                f"{new}"):
        receipts.mark_succeeded(op, external_id="article-1", fencing_token=old)
    op.refresh_from_db()
    assert (op.state, op.external_id) == (State.SUBMITTED, "")
    assert OperationEvent.objects.filter(operation=op).count() == 2
    receipts.mark_succeeded(op, external_id="article-1", fencing_token=new)
    assert OperationEvent.objects.filter(operation=op).last().fencing_token == new


@pytest.mark.django_db
def test_a_fencing_token_on_an_operation_without_a_run_is_refused():
    op = OperationFactory()
    with pytest.raises(InvalidInput, match="belong to a run"):
        receipts.mark_submitted(op, fencing_token=1)


@pytest.mark.django_db(transaction=True)
def test_a_writer_that_pauses_past_its_ttl_is_refused_after_another_took_over_and_leaves_no_trace():
    run = Run.objects.create(run_id="run-paused")
    op = OperationFactory(run=run)
    a = spawn(f"""
        import sys
        from datetime import timedelta
        from ledger import leases, receipts
        from ledger.errors import StaleFencingToken
        from ledger.models import Operation

        op = Operation.objects.get(pk={op.pk})
        token = leases.acquire("run:default:run-paused", "agent-a", timedelta(milliseconds=300))
        receipts.mark_submitted(op, fencing_token=token)
        print("SUBMITTED", token, flush=True)
        sys.stdin.readline()          # paused (a long GC, a stalled VM) past the TTL
        try:
            receipts.mark_succeeded(op, external_id="from-a", fencing_token=token)
            print("WROTE", flush=True)
        except StaleFencingToken as exc:
            print("REFUSED", exc, flush=True)
    """, stdin=subprocess.PIPE)
    token_a = int(wait_for_line(a, "SUBMITTED").split()[1])
    wait_for_expiry("run:default:run-paused")
    token_b = leases.acquire("run:default:run-paused", "agent-b", MINUTE)
    assert token_b > token_a
    op.refresh_from_db()
    receipts.mark_outcome_unknown(op, error_code="TakenOver", detail="A went silent",
                                  fencing_token=token_b)
    events_before = list(OperationEvent.objects.filter(operation=op).values_list("pk", flat=True))

    a.stdin.write("go\n")
    a.stdin.flush()
    line = wait_for_line(a, "REFUSED")
    a.communicate(timeout=30)
    assert f"expected fencing token {token_a}" in line and f"current token {token_b}" in line
    op.refresh_from_db()
    assert (op.state, op.external_id) == (State.OUTCOME_UNKNOWN, "")
    assert list(OperationEvent.objects.filter(operation=op).values_list("pk", flat=True)) \
        == events_before
    assert [e.fencing_token for e in OperationEvent.objects.filter(operation=op)][-2:] == [
        token_a, token_b]


ACQUIRER = """
    import sys
    from datetime import timedelta
    from ledger import leases
    from ledger.errors import LeaseHeld

    print("READY", flush=True)
    sys.stdin.readline()
    tokens = []
    while len(tokens) < {count}:
        try:
            token = leases.acquire("contended", "{owner}", timedelta(seconds=30))
        except LeaseHeld:
            continue
        tokens.append(token)
        leases.release("contended", "{owner}", token)
    print("TOKENS", " ".join(map(str, tokens)), flush=True)
"""


@pytest.mark.django_db(transaction=True)
def test_tokens_strictly_increase_under_two_processes_acquiring_concurrently():
    count = 40
    children = [spawn(ACQUIRER.format(count=count, owner=f"p{i}"), stdin=subprocess.PIPE)
                for i in range(2)]
    for child in children:
        wait_for_line(child, "READY")
    for child in children:
        child.stdin.write("go\n")
        child.stdin.flush()
    sequences = []
    for child in children:
        line = wait_for_line(child, "TOKENS", timeout=120)
        child.communicate(timeout=30)
        sequences.append([int(t) for t in line.split()[1:]])
    for tokens in sequences:
        assert tokens == sorted(tokens) and len(set(tokens)) == count
    everything = sequences[0] + sequences[1]
    assert len(set(everything)) == 2 * count, "expected no token handed out twice"
    assert leases.current_token("contended") == max(everything)
