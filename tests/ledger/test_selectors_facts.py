"""Reads of facts and conflicts: the agent's reads answered from here, fetch-and-check of a
conflict, keyset pages of open conflicts."""

import pytest

from ledger import access, facts, selectors
from ledger.errors import NotFound
from ledger.selectors import facts as fact_reads
from tests.factories import UserFactory
from tests.review.execution_setup import make_conflict


@pytest.mark.django_db
def test_current_facts_history_and_the_agent_reads_agree():
    facts.assert_fact("order:17", "status", "paid", source="psp")
    current = facts.read_fact("order:17", "status")
    facts.assert_fact("order:17", "status", "shipped", source="wms", expected_version=1)
    facts.assert_fact("order:17", "carrier", "ups", source="wms")
    assert [f.predicate for f in fact_reads.current_facts("order:17")] == ["carrier", "status"]
    assert fact_reads.current_facts("order:17") == facts.read_facts("order:17")
    assert [f.value for f in fact_reads.history("order:17", "status")] == ["paid", "shipped"]
    assert fact_reads.current_fact("default", "order:17", "status").value == "shipped"
    assert fact_reads.current_fact("acme", "order:17", "status") is None
    assert current.version == 1


@pytest.mark.django_db
def test_access_conflict_loads_both_sides_in_one_query(reviewer, django_assert_num_queries):
    conflict = make_conflict()
    access.tenants_for(reviewer)  # the grants, read once per user
    with django_assert_num_queries(1):
        found = selectors.access_conflict(reviewer, conflict.pk)
        assert (found.current.value, found.candidate.value) == ({"paid": False},
                                                                 {"paid": True})


@pytest.mark.django_db
def test_another_tenants_conflict_is_not_found(reviewer):
    theirs = make_conflict(tenant="acme")
    for read in (selectors.access_conflict, selectors.conflict_detail):
        with pytest.raises(NotFound, match=f"expected fact conflict {theirs.pk}"):
            read(reviewer, theirs.pk)
    with pytest.raises(NotFound):
        selectors.access_conflict(reviewer, theirs.pk + 1000)


@pytest.mark.django_db
def test_without_a_grant_no_conflict_is_visible_and_a_superuser_sees_all(db):
    ours, theirs = make_conflict(), make_conflict(tenant="acme")
    nobody = UserFactory(username="nobody", role="reviewer", tenants=[])
    root = UserFactory(username="root", is_superuser=True, tenants=[])
    assert list(selectors.visible_conflicts(nobody)) == []
    assert selectors.execution_counts(nobody).fact_conflicts == 0
    assert list(selectors.visible_conflicts(root)) == [ours, theirs]
    assert selectors.access_conflict(root, theirs.pk) == theirs


@pytest.mark.django_db
def test_open_conflicts_page_oldest_first_one_query_each(reviewer, django_assert_num_queries):
    made = [make_conflict(f"invoice:{n}") for n in range(5)]
    access.tenants_for(reviewer)
    seen, cursor = [], ""
    while True:
        with django_assert_num_queries(1):
            page = selectors.conflict_page(reviewer, cursor=cursor, per_page=2)
        seen += page.items
        if not page.next_cursor:
            break
        cursor = page.next_cursor
    assert seen == made
    assert list(facts.open_conflicts(tenants={"default"})) == made
