"""Reads of operations: the tenant filter, fetch-and-check, keyset pages."""

import pytest

from ledger import access, selectors
from ledger.errors import InvalidInput, NotFound
from ledger.models import Operation
from ledger.selectors import pagination
from ledger.selectors.operations import access_operation, operation_detail, visible_operations
from ledger.states import State
from tests.factories import OperationFactory, UserFactory


@pytest.fixture
def superuser(db):
    return UserFactory(username="root", is_superuser=True, tenants=[])


@pytest.mark.django_db
def test_access_operation_returns_an_operation_of_a_granted_tenant(reviewer,
                                                                   django_assert_num_queries):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    access.tenants_for(reviewer)  # the grants, read once per user
    with django_assert_num_queries(1):
        assert access_operation(reviewer, op.operation_id) == op


@pytest.mark.django_db
def test_another_tenants_operation_is_not_found_exactly_like_a_missing_one(reviewer):
    theirs = OperationFactory(state=State.OUTCOME_UNKNOWN, tenant="acme")
    with pytest.raises(NotFound) as invisible:
        access_operation(reviewer, theirs.operation_id)
    with pytest.raises(NotFound) as missing:
        access_operation(reviewer, "20260101T000000Z-0000000000")
    assert str(invisible.value) == (
        f"expected operation {theirs.operation_id!r} among the tenants you may see, found none")
    assert str(missing.value).replace("20260101T000000Z-0000000000", theirs.operation_id) == (
        str(invisible.value))
    with pytest.raises(NotFound):
        operation_detail(reviewer, theirs.operation_id)


@pytest.mark.django_db
def test_a_user_without_a_grant_sees_no_operation(db):
    nobody = UserFactory(username="nobody", role="reviewer", tenants=[])
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    assert list(visible_operations(nobody)) == []
    assert selectors.review_queue(nobody).items == []
    with pytest.raises(NotFound):
        access_operation(nobody, op.operation_id)


@pytest.mark.django_db
def test_a_superuser_sees_every_tenant(superuser):
    ours = OperationFactory(state=State.OUTCOME_UNKNOWN)
    theirs = OperationFactory(state=State.OUTCOME_UNKNOWN, tenant="acme")
    assert set(visible_operations(superuser)) == {ours, theirs}
    assert access_operation(superuser, theirs.operation_id) == theirs


@pytest.mark.django_db
def test_a_grant_made_later_makes_the_operation_visible(db):
    late = UserFactory(username="late", role="reviewer", tenants=[])
    op = OperationFactory(state=State.OUTCOME_UNKNOWN, tenant="acme")
    with pytest.raises(NotFound):
        access_operation(late, op.operation_id)
    access.grant(late, "acme")
    assert access_operation(late, op.operation_id) == op


@pytest.mark.django_db
@pytest.mark.parametrize("descending", [True, False])
def test_keyset_pages_visit_every_row_once_in_order(descending):
    made = [OperationFactory(state=State.OUTCOME_UNKNOWN) for _ in range(5)]
    order = ("-created_at", "-id") if descending else ("created_at", "id")
    qs = Operation.objects.order_by(*order)
    seen, cursor = [], ""
    while True:
        page = pagination.Page(**pagination.keyset_page(
            qs, "created_at", cursor=cursor, per_page=2, descending=descending))
        assert len(page.items) <= 2
        seen += page.items
        if not page.next_cursor:
            break
        cursor = page.next_cursor
    assert seen == list(qs) and len(seen) == len(made)
    assert list(pagination.iter_keyset(qs, "created_at", descending=descending, batch=2)) == seen


@pytest.mark.django_db
@pytest.mark.parametrize("per_page", [0, 201, True, "10"])
def test_a_page_size_out_of_range_is_refused(per_page):
    with pytest.raises(InvalidInput, match="expected a page size between 1 and 200"):
        pagination.keyset_page(Operation.objects.all(), "created_at", per_page=per_page,
                               descending=True)


def test_a_cursor_reads_back_what_it_wrote_and_a_malformed_one_is_refused():
    from datetime import UTC, datetime

    at = datetime(2026, 8, 16, 1, 20, 30, tzinfo=UTC)
    assert pagination.parse_cursor(pagination.make_cursor(at, 42)) == (at, 42)
    for bad in ("nope", "2026-08-16T01:20:30~42", "2026-08-16T01:20:30+00:00~x"):
        with pytest.raises(InvalidInput, match="expected a page cursor"):
            pagination.parse_cursor(bad)
