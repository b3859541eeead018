"""safe_to_retry without a person only where a retry is allowed, held by PostgreSQL
(`event_automatic_retry_check`, migration 0056): a move to safe_to_retry that no person
made is refused when the operation's retry policy is `never`, or when the desk's
unknown-outcome policy of its kind (the matching row that ranks first) says a person
decides. Tried below the reconciler's own check (`transitions.by_reconciler`), in raw SQL
as the tables' owner, and in raw SQL as each role's login; a person's decision and an
allowed kind still pass."""

from __future__ import annotations

import pytest
from django.db import transaction

from ledger import outcome_policies, receipts, transitions
from ledger.errors import PermissionDenied
from ledger.models import Operation, OperationEvent
from ledger.states import ActorKind, State
from tests.conftest import TEST_LOGINS
from tests.factories import OperationFactory, UserFactory, reconciler_lease
from tests.ledger.test_fence import raw_move
from tests.support.processes import run_as

pytestmark = pytest.mark.django_db(transaction=True)


def verdict(op: Operation) -> Operation:
    """The reconciler's proven-absence verdict, written under its lease, below the
    reconciler's own reading of the policies."""
    token = reconciler_lease(op)
    with transaction.atomic():
        return transitions.by_reconciler(
            op, State.SAFE_TO_RETRY, worker=f"factory-{op.tenant}", token=token,
            resource=f"reconcile:{op.operation_id}", reason="proven absent")


def unchanged(op: Operation) -> None:
    stored = Operation.objects.get(pk=op.pk)
    assert (stored.state, stored.version) == (State.RECONCILING, op.version)
    assert not OperationEvent.objects.filter(operation=op, version=op.version + 1).exists()


def desk_policy(pattern: str, automatic_retry: bool, tenant: str = "default") -> None:
    admin = UserFactory(username=f"admin-{pattern}-{automatic_retry}", role="admin",
                        tenants=[tenant])
    outcome_policies.set_policy(pattern, user=admin, reason="payments are decided by people",
                                tenant=tenant, automatic_retry=automatic_retry)


def refused_message(excinfo) -> str:
    return str(excinfo.value)


def test_a_never_retry_operation_is_not_made_safe_to_retry_by_a_reconciler():
    op = OperationFactory(state=State.RECONCILING, retry_policy="never")
    with pytest.raises(PermissionDenied, match=f"operation {op.operation_id}: expected a "
                       "person to decide a retry of an operation whose retry policy is "
                       "never, found a move to safe_to_retry by reconciler"):
        verdict(op)
    unchanged(op)


def test_the_desk_policy_of_the_kind_holds_the_reconciler_to_a_person():
    desk_policy("payments.*", automatic_retry=False)
    op = OperationFactory(state=State.RECONCILING, operation="payments.charge")
    with pytest.raises(PermissionDenied, match=r"expected a person to decide a retry \(the "
                       "unknown-outcome policy of its kind on the desk says so\\)"):
        verdict(op)
    unchanged(op)


def test_the_row_that_ranks_first_decides_and_other_tenants_rows_do_not_count():
    desk_policy("payments.*", automatic_retry=False)
    desk_policy("payments.refund", automatic_retry=True)  # the exact name ranks first
    desk_policy("mail.*", automatic_retry=False, tenant="acme")
    refund = OperationFactory(state=State.RECONCILING, operation="payments.refund")
    mail = OperationFactory(state=State.RECONCILING, operation="mail.send")
    assert verdict(refund).state == State.SAFE_TO_RETRY
    assert verdict(mail).state == State.SAFE_TO_RETRY


def test_a_person_still_decides_the_retry():
    desk_policy("payments.*", automatic_retry=False)
    op = OperationFactory(state=State.MANUAL_REVIEW, operation="payments.charge")
    reviewer = UserFactory(username="reviewer", role="reviewer")
    decided = receipts.resolve(op, State.SAFE_TO_RETRY, user=reviewer,
                               reason="the provider's dashboard shows no charge")
    assert decided.state == State.SAFE_TO_RETRY


def test_raw_sql_as_the_owner_is_refused_too():
    desk_policy("payments.*", automatic_retry=False)
    op = OperationFactory(state=State.RECONCILING, operation="payments.charge")
    token = reconciler_lease(op)
    with pytest.raises(Exception) as refused, transaction.atomic():
        raw_move(op, to_state=State.SAFE_TO_RETRY, actor_kind=ActorKind.RECONCILER,
                 fencing_token=token)
    assert refused.value.__cause__.sqlstate == "42501"
    assert "expected a person to decide a retry" in refused_message(refused)
    unchanged(op)


@pytest.mark.parametrize("kind", ["reconciler", "agent", "desk", "web"])
def test_raw_sql_as_each_roles_login_is_refused(kind):
    op = OperationFactory(state=State.RECONCILING, operation="payments.charge",
                          retry_policy="never")
    token = reconciler_lease(op)
    found = run_as(TEST_LOGINS[kind], f"""
from django.db import transaction
from ledger.models import Operation
from ledger.states import ActorKind, State
from tests.ledger.test_fence import raw_move
op = Operation.objects.get(pk={op.pk})
try:
    with transaction.atomic():
        raw_move(op, to_state=State.SAFE_TO_RETRY, actor_kind=ActorKind.RECONCILER,
                 fencing_token={token})
except Exception as exc:
    result = {{"sqlstate": getattr(exc.__cause__, "sqlstate", None), "message": str(exc)}}
else:
    result = {{"sqlstate": None, "message": "accepted"}}
""")
    assert found["sqlstate"] == "42501", found
    if kind == "reconciler":  # the others are refused first by their grants or role checks
        assert "expected a person to decide a retry of an operation whose retry policy is " \
               "never" in found["message"]
    unchanged(op)
