"""Reads of runs: fetch-and-check, the one builder of a run's records behind both the
hand-off view and the run page, overdue obligations."""

from datetime import timedelta

import pytest
from django.utils import timezone

from ledger import obligations, runs, selectors
from ledger.errors import NotFound
from ledger.selectors.runs import overdue_obligations, run_records
from ledger.states import TERMINAL
from tests.factories import UserFactory
from tests.review.execution_setup import busy_run, make_overdue


@pytest.mark.django_db
def test_access_run_checks_the_tenant(reviewer):
    ours, _ = busy_run()
    theirs = runs.start("Sync the CRM", tenant="acme", run_id="run-acme")
    assert selectors.access_run(reviewer, ours.run_id) == ours
    for read in (selectors.access_run, selectors.run_detail):
        with pytest.raises(NotFound, match="expected run 'run-acme' among the tenants"):
            read(reviewer, theirs.run_id)
    with pytest.raises(NotFound):
        selectors.access_run(reviewer, "no-such-run")


@pytest.mark.django_db
def test_without_a_grant_no_run_is_visible_and_a_superuser_sees_all(db):
    theirs = runs.start("Sync the CRM", tenant="acme", run_id="run-acme")
    nobody = UserFactory(username="nobody", role="viewer", tenants=[])
    root = UserFactory(username="root", is_superuser=True, tenants=[])
    with pytest.raises(NotFound):
        selectors.access_run(nobody, theirs.run_id)
    assert selectors.access_run(root, theirs.run_id) == theirs


@pytest.mark.django_db
def test_the_hand_off_and_the_run_page_are_built_from_the_same_records(reviewer):
    run, made = busy_run(extra_rows=2)
    page = selectors.run_detail(reviewer, run.run_id)
    view = runs.hand_off(run.run_id)
    everything = run_records(run)
    assert [s.step_id for s in page.steps] == [s.step_id for s in view.steps] == ["pay", "ship"]
    assert page.operations == everything.operations
    assert list(view.open_operations) == [op for op in everything.operations
                                          if op.state not in TERMINAL]
    assert made["paid"] in page.operations and made["paid"] not in view.open_operations
    assert list(view.pending_obligations) == [o for o in everything.obligations
                                              if o.state == "open"]
    assert page.facts == list(view.facts) == everything.facts
    assert page.open_conflicts == list(view.open_conflicts)
    assert (view.token, page.lease.token) == (made["token"], made["token"])


@pytest.mark.django_db
def test_a_limit_cuts_each_list_and_leaves_payloads_unloaded(django_assert_num_queries):
    run, _ = busy_run(extra_rows=3)
    with django_assert_num_queries(6):
        records = run_records(run, limit=2)
    assert (len(records.operations), len(records.obligations)) == (2, 2)
    with django_assert_num_queries(1):
        assert isinstance(records.operations[0].intent, dict)  # deferred: read when asked
    with django_assert_num_queries(6):
        whole = run_records(run)
    with django_assert_num_queries(0):
        assert isinstance(whole.operations[0].intent, dict)
    assert len(whole.operations) == 5


@pytest.mark.django_db
def test_overdue_obligations_most_overdue_first_and_paged(reviewer):
    run = runs.start("Welcome mails")
    later = make_overdue(run, key="later", hours_late=1)
    late = make_overdue(run, key="late", hours_late=5)
    obligations.open(run, "email.send", "not-yet",
                     deadline=timezone.now() + timedelta(hours=1))
    assert list(overdue_obligations()) == [late, later]
    assert list(obligations.overdue()) == [late, later]
    first = selectors.overdue_page(reviewer, per_page=1)
    second = selectors.overdue_page(reviewer, per_page=1, cursor=first.next_cursor)
    assert (first.items, second.items, second.next_cursor) == ([late], [later], "")
    assert selectors.execution_counts(reviewer).overdue_obligations == 2
