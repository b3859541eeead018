"""Versioned facts: supersede, candidates and conflicts, immutability, races, decisions."""

from datetime import UTC, datetime, timedelta

import pytest
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.utils import timezone

from ledger import facts, runs
from ledger.canonical import REDACTED
from ledger.errors import InvalidInput, PermissionDenied, StaleFact, StaleVersion
from ledger.models import (
    ConflictState,
    Fact,
    FactConflict,
    FactDecision,
    FactStatus,
)
from tests.factories import UserFactory
from tests.support.concurrency import join, run_threads, wait_for_lock_waiters


def status(value, **kwargs):
    kwargs.setdefault("source", "payments-api")
    return facts.assert_fact("order:17", "status", value, **kwargs)


# --- assert_fact ------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_first_value_is_version_one_and_current():
    fact = status("paid")
    assert (fact.version, fact.status, fact.value, fact.source) == (1, "current", "paid",
                                                                    "payments-api")
    assert fact.superseded_by is None and fact.created_at is not None


@pytest.mark.django_db
def test_the_expected_current_version_supersedes_it_and_the_old_version_stays_readable():
    first = status("paid")
    second = status("shipped", expected_version=1, source="warehouse")
    first.refresh_from_db()
    assert (second.version, second.status, second.value) == (2, "current", "shipped")
    assert (first.status, first.superseded_by_id, first.value) == ("superseded", second.pk,
                                                                   "paid")
    assert [f.value for f in facts.history("order:17", "status")] == ["paid", "shipped"]


@pytest.mark.django_db
def test_the_same_value_again_records_nothing_new_and_returns_the_current_version():
    current = status("paid")
    again = status("paid", source="another-source")
    stale_again = status("paid", expected_version=7)
    assert again.pk == current.pk == stale_again.pk
    assert Fact.objects.count() == 1 and FactConflict.objects.count() == 0


@pytest.mark.django_db
@pytest.mark.parametrize("expected_version", [None, 1])
def test_a_different_value_without_the_current_version_becomes_a_candidate_in_a_conflict(
    expected_version,
):
    status("paid")
    current = status("shipped", expected_version=1)
    candidate = status("refunded", expected_version=expected_version, source="crm")
    assert (candidate.status, candidate.version, candidate.contradicts_id) == (
        "candidate", None, current.pk)
    conflict = candidate.conflict
    assert (conflict.state, conflict.current_id, conflict.subject) == ("open", current.pk,
                                                                       "order:17")
    assert facts.read_fact("order:17", "status").value == "shipped"


@pytest.mark.django_db
def test_the_same_candidate_twice_is_kept_once_with_one_conflict():
    status("paid")
    first = status("refunded", source="crm")
    second = status("refunded", source="crm")
    assert first.pk == second.pk
    assert FactConflict.objects.count() == 1


@pytest.mark.django_db
def test_an_expected_version_for_a_subject_with_no_fact_raises_stale_fact():
    with pytest.raises(StaleFact, match="found no fact at all") as info:
        status("paid", expected_version=1)
    assert info.value.current is None
    assert Fact.objects.count() == 0


@pytest.mark.django_db
def test_a_fact_keeps_the_source_observation_time_and_run():
    run = runs.start("Ship order 17", run_id="run-facts")
    seen = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    fact = status("paid", observed_at=seen, run="run-facts")
    assert fact.provenance == {"source": "payments-api", "observed_at": seen,
                               "recorded_at": fact.created_at, "version": 1,
                               "run_id": run.run_id}


@pytest.mark.django_db
def test_secrets_in_a_value_never_reach_the_database():
    fact = facts.assert_fact("svc:mail", "config", {"host": "smtp", "password": "hunter2"},
                             source="agent")
    fact.refresh_from_db()
    assert fact.value == {"host": "smtp", "password": REDACTED}


@pytest.mark.django_db
def test_tenants_do_not_share_facts():
    status("paid")
    other = status("lost", tenant="acme")
    assert other.version == 1 and other.is_current
    assert [f.value for f in facts.read_facts("order:17")] == ["paid"]
    assert [f.value for f in facts.read_facts("order:17", tenant="acme")] == ["lost"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"subject": ""}, "expected subject to be a non-empty string"),
        ({"predicate": "  "}, "expected predicate to be a non-empty string"),
        ({"source": ""}, "expected source to be a non-empty string"),
        ({"value": {"at": object()}}, "expected value.at to hold only JSON values"),
        ({"expected_version": 0}, "expected expected_version to be None or a version"),
        ({"expected_version": True}, "expected expected_version to be None or a version"),
        ({"observed_at": datetime(2026, 1, 1)}, "expected observed_at to be a timezone-aware"),
        ({"run": "no-such-run"}, "expected run 'no-such-run' to exist"),
        ({"fencing_token": 3}, "expected a run when a fencing_token is given"),
    ],
)
def test_bad_input_gets_a_clear_error_and_writes_nothing(kwargs, message):
    args = {"subject": "order:1", "predicate": "status", "value": "paid", "source": "agent"}
    args.update(kwargs)
    with pytest.raises(InvalidInput, match=message):
        facts.assert_fact(args.pop("subject"), args.pop("predicate"), args.pop("value"), **args)
    assert Fact.objects.count() == 0


# --- reading, and acting on a stale fact -------------------------------------------------


@pytest.mark.django_db
def test_read_facts_returns_only_current_versions_by_predicate():
    facts.assert_fact("order:17", "total", 40, source="cart")
    status("paid")
    status("shipped", expected_version=1)
    status("lost", source="rumour")  # a candidate
    read = facts.read_facts("order:17")
    assert [(f.predicate, f.value, f.version) for f in read] == [
        ("status", "shipped", 2), ("total", 40, 1)]


@pytest.mark.django_db
def test_acting_on_a_superseded_version_raises_stale_fact_carrying_the_current_one():
    old = status("paid")
    newer = status("refunded", expected_version=1, source="crm")
    with pytest.raises(StaleFact, match="expected version 1 of order:17 status to be current, "
                                        "found version 2 = 'refunded' from crm") as info:
        facts.require_current(old)
    assert info.value.current.pk == newer.pk
    assert facts.require_current(newer).pk == newer.pk


@pytest.mark.django_db
def test_a_candidate_is_never_current():
    current = status("paid")
    candidate = status("lost", source="rumour")
    with pytest.raises(StaleFact, match="expected a candidate of order:17 status") as info:
        facts.require_current(candidate)
    assert info.value.current.pk == current.pk


# --- the database refuses changes in place -----------------------------------------------


def raw(sql, params=()):
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)


@pytest.mark.django_db
@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE ledger_fact SET value = '\"refunded\"' WHERE id = %s",
        "UPDATE ledger_fact SET source = 'someone else' WHERE id = %s",
        "UPDATE ledger_fact SET version = 9 WHERE id = %s",
        "UPDATE ledger_fact SET status = 'superseded' WHERE id = %s",
        "UPDATE ledger_fact SET observed_at = now() WHERE id = %s",
        "UPDATE ledger_fact SET value = value WHERE id = %s",
        "DELETE FROM ledger_fact WHERE id = %s",
    ],
)
def test_no_current_fact_can_be_changed_or_deleted_by_a_raw_query(sql):
    fact = status("paid")
    with pytest.raises(IntegrityError, match="expected"):
        raw(sql, [fact.pk])
    fact.refresh_from_db()
    assert (fact.value, fact.status, fact.version, fact.source) == ("paid", "current", 1,
                                                                   "payments-api")


@pytest.mark.django_db
@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE ledger_fact SET superseded_by_id = NULL, status = 'current' WHERE id = %s",
        "UPDATE ledger_fact SET superseded_by_id = id WHERE id = %s",
        "UPDATE ledger_fact SET value = '\"x\"' WHERE id = %s",
        "DELETE FROM ledger_fact WHERE id = %s",
    ],
)
def test_no_superseded_fact_can_be_changed_or_deleted_by_a_raw_query(sql):
    old = status("paid")
    status("shipped", expected_version=1)
    with pytest.raises(IntegrityError, match="expected"):
        raw(sql, [old.pk])
    old.refresh_from_db()
    assert (old.value, old.status) == ("paid", "superseded")


@pytest.mark.django_db
def test_a_current_fact_cannot_be_linked_to_an_existing_fact_by_a_raw_query():
    first = status("paid")
    other = facts.assert_fact("order:18", "status", "paid", source="agent")
    with pytest.raises(IntegrityError, match="expected no change but linking"):
        raw("UPDATE ledger_fact SET status = 'superseded', superseded_by_id = %s WHERE id = %s",
            [other.pk, first.pk])


@pytest.mark.django_db
def test_a_raw_insert_cannot_add_a_second_current_version_or_skip_a_version():
    status("paid")
    columns = ("tenant, subject, predicate, value, value_fingerprint, source, observed_at, "
               "version, status")
    with pytest.raises(IntegrityError, match="expected version 1 for a first value"):
        raw(f"INSERT INTO ledger_fact ({columns}) VALUES ('default', 'order:17', 'status', "
            "'\"lost\"', 'x', 'raw', now(), 3, 'current')")
    with pytest.raises(IntegrityError, match="fact_one_current_version|fact_version_unique"):
        raw(f"INSERT INTO ledger_fact ({columns}) VALUES ('default', 'order:17', 'status', "
            "'\"lost\"', 'x', 'raw', now(), 1, 'current')")
    assert Fact.objects.filter(subject="order:17").count() == 1


# --- races -------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_supersedes_leave_one_current_version_and_one_conflict():
    first = status("paid")
    values = ["shipped", "refunded"]
    with transaction.atomic():
        # Hold the current row so both writers reach the compare-and-set before either wins.
        Fact.objects.select_for_update().get(pk=first.pk)
        threads, results, errors = run_threads(
            2, lambda i: status(values[i], expected_version=1, source=f"agent-{i}"),
            start_together=False,
        )
        wait_for_lock_waiters(2)
    join(threads)
    assert errors == []
    current = Fact.objects.get(subject="order:17", status=FactStatus.CURRENT)
    candidate = Fact.objects.get(subject="order:17", status=FactStatus.CANDIDATE)
    assert current.version == 2 and {current.value, candidate.value} == set(values)
    assert {r.pk for r in results} == {current.pk, candidate.pk}
    conflict = FactConflict.objects.get()
    assert (conflict.current_id, conflict.candidate_id, conflict.state) == (
        current.pk, candidate.pk, "open")


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_first_values_leave_version_one_and_a_conflict():
    columns = ("tenant, subject, predicate, value, value_fingerprint, source, observed_at, "
               "version, status")
    with transaction.atomic():
        # An uncommitted first value: the API's insert must wait for it, then lose quietly.
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO ledger_fact ({columns}) VALUES ('default', 'order:17', 'status', "
                "'\"paid\"', 'sha256:x', 'agent-0', now(), 1, 'current')"
            )
        threads, results, errors = run_threads(1, lambda i: status("lost", source="agent-1"),
                                               start_together=False)
        wait_for_lock_waiters(1)
    join(threads)
    assert errors == []
    (candidate,) = results
    assert candidate.is_candidate and candidate.value == "lost"
    assert facts.read_fact("order:17", "status").value == "paid"
    assert FactConflict.objects.filter(candidate=candidate).exists()


@pytest.mark.django_db(transaction=True)
def test_eight_writers_of_different_first_values_make_one_version_and_seven_conflicts():
    threads, results, errors = run_threads(8, lambda i: status(f"v{i}", source=f"a{i}"))
    join(threads)
    assert errors == []
    assert Fact.objects.filter(status=FactStatus.CURRENT).count() == 1
    assert Fact.objects.filter(status=FactStatus.CANDIDATE).count() == 7
    assert FactConflict.objects.count() == 7


# --- people decide conflicts -------------------------------------------------------------


@pytest.fixture
def conflict(db):
    status("paid")
    return status("refunded", source="crm").conflict


@pytest.mark.django_db
def test_resolving_with_the_candidate_writes_a_new_version_sourced_by_the_reviewer(
    conflict, reviewer
):
    written = facts.resolve_conflict(conflict, winner=conflict.candidate, user=reviewer,
                                     reason="CRM shows the refund")
    assert (written.version, written.value, written.source, written.status) == (
        2, "refunded", "reviewer:reviewer", "current")
    conflict.refresh_from_db()
    assert (conflict.state, conflict.chosen_id, conflict.resolved_fact_id) == (
        ConflictState.RESOLVED, conflict.candidate_id, written.pk)
    assert conflict.resolved_by == reviewer and conflict.resolution_reason == (
        "CRM shows the refund")
    # Both sides stay readable exactly as they were written.
    conflict.current.refresh_from_db()
    conflict.candidate.refresh_from_db()
    assert (conflict.current.value, conflict.current.status) == ("paid", "superseded")
    assert (conflict.candidate.value, conflict.candidate.source) == ("refunded", "crm")
    decision = FactDecision.objects.get()
    assert (decision.conflict_id, decision.chosen_id, decision.written_id, decision.username,
            decision.reason, decision.tenant) == (
        conflict.pk, conflict.candidate_id, written.pk, "reviewer", "CRM shows the refund",
        "default")


@pytest.mark.django_db
def test_keeping_the_current_value_is_a_new_version_too(conflict, reviewer):
    written = facts.resolve_conflict(conflict, winner="current", user=reviewer,
                                     reason="payment confirmed")
    assert (written.version, written.value, written.source) == (2, "paid", "reviewer:reviewer")


@pytest.mark.django_db
def test_a_conflict_is_decided_once(conflict, reviewer):
    other = UserFactory(username="second", role="reviewer")
    stale_copy = FactConflict.objects.get(pk=conflict.pk)
    facts.resolve_conflict(conflict, winner="candidate", user=reviewer, reason="first")
    with pytest.raises(StaleVersion, match="found it resolved by reviewer"):
        facts.resolve_conflict(stale_copy, winner="current", user=other, reason="second")
    assert FactDecision.objects.count() == 1
    assert facts.read_fact("order:17", "status").version == 2


@pytest.mark.django_db
def test_deciding_against_a_version_that_moved_on_raises_stale_fact(conflict, reviewer):
    moved = status("shipped", expected_version=1, source="warehouse")
    with pytest.raises(StaleFact, match="found version 2 from warehouse") as info:
        facts.resolve_conflict(conflict, winner="candidate", user=reviewer, reason="refund")
    assert info.value.current.pk == moved.pk
    conflict.refresh_from_db()
    assert conflict.is_open and FactDecision.objects.count() == 0
    written = facts.resolve_conflict(conflict, winner="candidate", user=reviewer,
                                     reason="refund after all", expected_version=2)
    assert (written.version, written.value) == (3, "refunded")


@pytest.mark.django_db
def test_deciding_needs_the_permission_and_the_tenant_grant(conflict, viewer):
    with pytest.raises(PermissionDenied, match="ledger.resolve_factconflict"):
        facts.resolve_conflict(conflict, winner="candidate", user=viewer, reason="x")
    outsider = UserFactory(username="outsider", role="reviewer", tenants=["acme"])
    with pytest.raises(PermissionDenied, match="granted tenant 'default'"):
        facts.resolve_conflict(conflict, winner="candidate", user=outsider, reason="x")
    conflict.refresh_from_db()
    assert conflict.is_open and FactDecision.objects.count() == 0


@pytest.mark.django_db
def test_admins_may_decide_conflicts(conflict, admin_user):
    written = facts.resolve_conflict(conflict, winner="candidate", user=admin_user,
                                     reason="checked")
    assert written.source == "reviewer:admin"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reason": "  "}, "expected a non-empty reason"),
        ({"winner": "neither"}, "expected winner to be the conflict's current fact"),
    ],
)
def test_a_decision_without_a_reason_or_a_side_is_refused(conflict, reviewer, kwargs, message):
    args = {"winner": "candidate", "user": reviewer, "reason": "ok"}
    args.update(kwargs)
    with pytest.raises(InvalidInput, match=message):
        facts.resolve_conflict(conflict, **args)
    assert FactDecision.objects.count() == 0


@pytest.mark.django_db
def test_decisions_and_settled_conflicts_cannot_be_changed_by_a_raw_query(conflict, reviewer):
    facts.resolve_conflict(conflict, winner="candidate", user=reviewer, reason="refund")
    decision = FactDecision.objects.get()
    with pytest.raises(DatabaseError, match="Cannot update or delete"):
        raw("UPDATE ledger_factdecision SET reason = 'edited' WHERE id = %s", [decision.pk])
    with pytest.raises(DatabaseError, match="Cannot update or delete"):
        raw("DELETE FROM ledger_factdecision WHERE id = %s", [decision.pk])
    with pytest.raises(IntegrityError, match="expected only an open conflict to change"):
        raw("UPDATE ledger_factconflict SET state = 'open' WHERE id = %s", [conflict.pk])


@pytest.mark.django_db
def test_open_conflicts_lists_both_sides_in_two_queries(django_assert_num_queries):
    for n in range(3):
        facts.assert_fact(f"order:{n}", "status", "paid", source="api")
        facts.assert_fact(f"order:{n}", "status", "lost", source="rumour")
    facts.assert_fact("order:9", "status", "paid", source="api", tenant="acme")
    facts.assert_fact("order:9", "status", "lost", source="rumour", tenant="acme")
    with django_assert_num_queries(1):
        rows = [(c.subject, c.current.value, c.candidate.value, c.candidate.source)
                for c in facts.open_conflicts(tenants={"default"})]
    assert rows == [(f"order:{n}", "paid", "lost", "rumour") for n in range(3)]


@pytest.mark.django_db
def test_an_observation_from_the_future_is_refused_and_writes_nothing(settings):
    with pytest.raises(InvalidInput, match=r"expected observed_at at most 300 s after the "
                                           r"ledger's clock \(LEDGER_FACT_MAX_FUTURE_SECONDS\), "
                                           r"found 9999-01-01T00:00:00\+00:00, .* days beyond"):
        status("paid", observed_at=datetime(9999, 1, 1, tzinfo=UTC))
    assert not Fact.objects.exists()
    settings.LEDGER_FACT_MAX_FUTURE_SECONDS = 60
    with pytest.raises(InvalidInput, match="at most 60 s after"):
        status("paid", observed_at=timezone.now() + timedelta(seconds=120))
    # A real observation afterwards is the current version, not a candidate.
    fact = status("paid", observed_at=timezone.now() + timedelta(seconds=30))
    assert fact.version == 1 and not fact.is_candidate


@pytest.mark.django_db
def test_a_fact_of_a_leased_run_without_the_current_token_is_refused_and_nothing_written():
    from ledger.errors import StaleFencingToken

    run = runs.start("fenced facts", run_id="run-fenced-facts")
    facts.assert_fact("order:1", "status", "paid", source="a", run=run)  # never leased yet
    first = runs.resume(run.run_id, worker="w1")
    with pytest.raises(StaleFencingToken):
        facts.assert_fact("order:1", "status", "late", source="a", run=run,
                          expected_version=1)
    second = runs.resume(run.run_id, worker="w1")
    with pytest.raises(StaleFencingToken):
        facts.assert_fact("order:1", "status", "late", source="a", run=run,
                          expected_version=1, fencing_token=first.token)
    assert Fact.objects.filter(subject="order:1").count() == 1
    fact = facts.assert_fact("order:1", "status", "late", source="a", run=run,
                             expected_version=1, fencing_token=second.token)
    assert fact.version == 2
