"""Retention of execution state: superseded fact versions, episodes and settled obligations
go after their policy's days; never a current fact, a candidate, an open obligation or
anything of an unfinished run; PostgreSQL refuses every other DELETE, raw or as each role."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction

from ledger import (
    episodes,
    facts,
    leases,
    obligations,
    receipts,
    retention,
    retention_state,
    runs,
)
from ledger.errors import InvalidInput
from ledger.models import (
    Episode,
    Fact,
    Obligation,
    PurgeRun,
    RetentionChange,
    Run,
    StateRetentionPolicy,
)
from tests.conftest import TEST_LOGINS
from tests.support.processes import tries_as
from tests.support.retention import retention_admin


def raw(sql, params=()):
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else None


def age(table: str, column: str, ids, days: int) -> None:
    """Move `column` of rows `ids` `days` into the past, triggers off (as a superuser would:
    the rows are immutable)."""
    raw("SET session_replication_role = replica")
    raw(f"UPDATE {table} SET {column} = now() - make_interval(days => %s) WHERE id = ANY(%s)",
        [days, list(ids)])
    raw("RESET session_replication_role")


def history(run, subject: str) -> list[Fact]:
    """Three versions of `subject` status; returns them, the third current."""
    versions = [facts.assert_fact(subject, "status", "draft", source="billing", run=run)]
    for version, value in ((1, "sent"), (2, "paid")):
        versions.append(facts.assert_fact(subject, "status", value, source="billing", run=run,
                                          expected_version=version))
    return versions


def state_of(run, *, days: int = 400) -> dict:
    """A run's execution state, all of it `days` old: three fact versions, an episode, a
    committed obligation."""
    versions = history(run, f"invoice:{run.run_id}")
    episode = episodes.record(run, "user", content="my password is hunter2")
    obligation = obligations.open(run, "email.send", f"{run.run_id}-receipt")
    obligations.commit(obligation.key, "sent")
    age("ledger_fact", "created_at", [f.pk for f in versions], days)
    age("ledger_episode", "created_at", [episode.pk], days)
    age("ledger_obligation", "committed_at", [obligation.pk], days)
    return {"facts": versions, "episode": episode, "obligation": obligation}


def remaining() -> set:
    return (set(Fact.objects.values_list("pk", flat=True))
            | {("e", pk) for pk in Episode.objects.values_list("pk", flat=True)}
            | {("o", pk) for pk in Obligation.objects.values_list("pk", flat=True)})


@pytest.mark.django_db
def test_purge_removes_old_state_of_finished_runs_and_keeps_the_rest(capsys):
    done = state_of(runs.start("finished", run_id="done"))
    cancelled = obligations.open("done", "email.send", "done-young")
    obligations.cancel(cancelled.key, reason="not needed")
    busy_run = runs.start("unfinished", run_id="busy")
    state_of(busy_run)
    obligations.open(busy_run, "email.send", "busy-open")
    state_of(runs.start("a step to go", run_id="stepped"))
    runs.add_step("stepped", "review")
    # a conflict names version 1 (its candidate contradicted it), so 1 and 2 stay
    contested = [facts.assert_fact("invoice:9", "status", "draft", source="billing")]
    facts.assert_fact("invoice:9", "status", "void", source="bank-feed")
    contested.append(facts.assert_fact("invoice:9", "status", "sent", source="billing",
                                       expected_version=1))
    contested.append(facts.assert_fact("invoice:9", "status", "paid", source="billing",
                                       expected_version=2))
    age("ledger_fact", "created_at", [f.pk for f in contested], 400)
    # an operation still kept relied on version 2: version 1 goes, 2 stays
    relied = [facts.assert_fact("invoice:7", "status", "draft", source="billing")]
    relied.append(facts.assert_fact("invoice:7", "status", "sent", source="billing",
                                    expected_version=1))
    receipts.record_intent("mail.send", "smtp://m", {"n": 1}, relies_on=[relied[1]])
    relied.append(facts.assert_fact("invoice:7", "status", "paid", source="billing",
                                    expected_version=2))
    age("ledger_fact", "created_at", [f.pk for f in relied], 400)
    before = remaining()

    call_command("purge", "--dry-run", actor="cron")
    assert remaining() == before
    would = {r.policy_snapshot["kind"]: r.rows_purged
             for r in PurgeRun.objects.filter(state_policy__isnull=False)}
    assert would == {"facts": 3, "episodes": 1, "obligations": 1, "coverage": 0}
    assert {p.kind: n for p, n in retention_state.preview()} == would

    call_command("purge", actor="cron")
    gone = {done["facts"][0].pk, done["facts"][1].pk, relied[0].pk, ("e", done["episode"].pk),
            ("o", done["obligation"].pk)}
    assert remaining() == before - gone
    assert Fact.objects.get(pk=done["facts"][2].pk).status == "current"
    out = capsys.readouterr().out
    assert ("purged 5 superseded facts, episodes, settled obligations and coverage readings, "
            "in 4 state policies") in out
    assert "facts (every tenant): purged 3 superseded fact versions" in out
    runs_ = PurgeRun.objects.filter(state_policy__isnull=False, dry_run=False)
    assert sorted((r.policy_snapshot["kind"], r.rows_purged, r.actor) for r in runs_) == [
        ("coverage", 0, "cron"), ("episodes", 1, "cron"), ("facts", 3, "cron"),
        ("obligations", 1, "cron")]
    assert all(r.finished_at for r in runs_)
    # what stays behind still verifies, and a second run finds nothing
    assert retention.purge(actor="again").purged_state_ids == []


@pytest.mark.django_db
def test_a_tenant_s_policy_governs_its_rows_and_every_change_is_audited():
    admin = retention_admin()
    with pytest.raises(InvalidInput, match="expected kind one of"):
        retention_state.set_state_policy("operations", purge_after_days=30, user=admin)
    with pytest.raises(InvalidInput, match="expected purge_after_days"):
        retention_state.set_state_policy("episodes", purge_after_days=0, user=admin)
    with pytest.raises(InvalidInput, match="expected a tenant's policy to delete"):
        retention_state.delete_state_policy(
            StateRetentionPolicy.objects.get(kind="episodes", tenant=""), user=admin)
    acme = retention_state.set_state_policy("episodes", tenant="acme", purge_after_days=1000,
                                            user=admin)
    ours = episodes.record(runs.start("x", run_id="ours"), "user", content="hi")
    theirs = episodes.record(runs.start("x", run_id="theirs", tenant="acme"), "user",
                             content="hi")
    age("ledger_episode", "created_at", [ours.pk, theirs.pk], 400)

    assert retention.purge(actor="t").purged_state_ids == [ours.pk]
    assert list(Episode.objects.values_list("pk", flat=True)) == [theirs.pk]
    retention_state.delete_state_policy(acme, user=admin)
    assert retention.purge(actor="t").purged_state_ids == [theirs.pk]
    changes = RetentionChange.objects.filter(state_policy_id=acme.pk).order_by("id")
    assert [(c.action, c.changed_by_name, c.before, c.after) for c in changes] == [
        ("created", admin.username, None,
         {"kind": "episodes", "tenant": "acme", "purge_after_days": 1000}),
        ("deleted", admin.username,
         {"kind": "episodes", "tenant": "acme", "purge_after_days": 1000}, None)]


def refused(sql, params=(), *, match):
    with pytest.raises(DatabaseError, match=match), transaction.atomic():
        raw(sql, params)


@pytest.mark.django_db
def test_postgresql_refuses_every_other_delete_even_the_owner_s_inside_the_purge():
    done = state_of(runs.start("finished", run_id="done"))
    busy_run = runs.start("unfinished", run_id="busy")
    busy = state_of(busy_run)
    open_one = obligations.open(busy_run, "email.send", "busy-open")
    superseded = done["facts"][0].pk
    leased = state_of(runs.start("held by a worker", run_id="leased"))
    leases.acquire(Run.objects.get(run_id="leased").lease_resource, "worker-1",
                   timedelta(minutes=5))

    # outside the purge: refused, whatever the row
    for table, pk in (("ledger_fact", superseded), ("ledger_episode", done["episode"].pk),
                      ("ledger_obligation", done["obligation"].pk)):
        refused(f"DELETE FROM {table} WHERE id = %s", [pk], match="expected .*only the retention")
    # inside it (the setting the purge function sets, as the tables' owner): still never a
    # current fact, an open obligation or anything of an unfinished run
    for table, pk, found in (
        ("ledger_fact", done["facts"][2].pk, "a current version"),
        ("ledger_fact", busy["facts"][0].pk, "unfinished"),
        ("ledger_obligation", open_one.pk, "a open obligation"),
        ("ledger_obligation", busy["obligation"].pk, "unfinished"),
        ("ledger_episode", busy["episode"].pk, "unfinished"),
        ("ledger_episode", leased["episode"].pk, "unfinished"),
    ):
        refused(f"SET LOCAL ledger.sanctioned = 'retention'; DELETE FROM {table} WHERE id = %s",
                [pk], match=found)
    # the purge function checks each row again by the database's clock
    policy = StateRetentionPolicy.objects.get(kind="facts", tenant="")
    run = PurgeRun.objects.create(state_policy=policy, policy_snapshot={}, actor="t",
                                  batch_size=1, started_at=done["episode"].created_at)
    for pk, found in ((done["facts"][2].pk, "found a current version"),
                      (busy["facts"][0].pk, "unfinished")):
        refused("SELECT ledger_retention_purge_state(%s, %s)", [run.pk, [pk]],
                match=f"expected a superseded version of a finished run.*{found}")
    age("ledger_fact", "created_at", [f.pk for f in done["facts"]], 10)
    refused("SELECT ledger_retention_purge_state(%s, %s)", [run.pk, [superseded]],
            match="more than 365 days ago")
    assert Fact.objects.filter(pk=superseded).exists()


ROLE_TRIES = {  # name -> SQL, its ids filled in by the test
    "fact": "DELETE FROM ledger_fact WHERE id = %(fact)s",
    "episode": "DELETE FROM ledger_episode WHERE id = %(episode)s",
    "obligation": "DELETE FROM ledger_obligation WHERE id = %(obligation)s",
    "function": "SELECT ledger_retention_purge_state(%(run)s, ARRAY[%(current)s]::bigint[])",
}


@pytest.mark.django_db(transaction=True)
def test_no_role_deletes_state_and_the_purge_function_is_the_reconciler_s_alone():
    done = state_of(runs.start("finished", run_id="done"))
    policy = StateRetentionPolicy.objects.get(kind="facts", tenant="")
    run = PurgeRun.objects.create(state_policy=policy, policy_snapshot={}, actor="t",
                                  batch_size=1, started_at=done["episode"].created_at)
    ids = {"fact": done["facts"][0].pk, "episode": done["episode"].pk,
           "obligation": done["obligation"].pk, "run": run.pk, "current": done["facts"][2].pk}
    before = remaining()
    for kind in ("agent", "reconciler", "desk"):
        found = tries_as(TEST_LOGINS[kind], {name: sql % ids for name, sql in ROLE_TRIES.items()})
        for name in ("fact", "episode", "obligation"):
            assert found[name][0] == "42501", (kind, name, found[name])
        if kind == "reconciler":
            assert found["function"][0] == "23514", found["function"]
            assert "expected a superseded version" in found["function"][1]
        else:
            assert found["function"][0] == "42501", (kind, found["function"])
    assert remaining() == before
