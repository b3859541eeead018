"""Reads of retention: the ledger's size, the overview (admins), fetch-and-check a policy."""

import pytest

from ledger import retention
from ledger.errors import NotFound, PermissionDenied
from ledger.selectors import access_policy
from ledger.selectors import retention as retention_reads
from ledger.states import State
from tests.factories import OperationFactory


@pytest.mark.django_db
def test_table_sizes_report_rows_and_bytes_of_the_ledger_tables(admin_user):
    OperationFactory(state=State.SUCCEEDED)
    sizes = {t.table: t for t in retention_reads.table_sizes()}
    assert sizes["ledger_operation"].rows == 1
    assert sizes["ledger_operationevent"].rows == 3
    assert all(t.total_bytes > 0 for t in sizes.values())
    overview = retention_reads.retention_overview(admin_user)
    assert [p.policy.pattern for p in overview["previews"]] == ["*"]


@pytest.mark.django_db
def test_the_ledger_refuses_the_overview_to_a_user_without_the_retention_permission(reviewer):
    with pytest.raises(PermissionDenied, match="ledger.view_retentionpolicy"):
        retention_reads.retention_overview(reviewer)


@pytest.mark.django_db
def test_access_policy_fetches_for_admins_refuses_others_and_says_when_it_is_gone(
    admin_user, reviewer
):
    policy = retention.set_policy("mail.*", purge_after_days=5, user=admin_user)
    assert access_policy(admin_user, policy.pk) == policy
    with pytest.raises(PermissionDenied, match="ledger.view_retentionpolicy"):
        access_policy(reviewer, policy.pk)
    retention.delete_policy(policy, user=admin_user)
    with pytest.raises(NotFound, match=f"expected retention policy #{policy.pk}, found none"):
        access_policy(admin_user, policy.pk)
