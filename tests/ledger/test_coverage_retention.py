"""Retention of coverage readings (kind `coverage`): a reading goes its policy's days after it
was taken, never the latest of its tenant, operation, target and account (what `/metrics`
reports); PostgreSQL refuses every other DELETE, raw, as the owner or as each role."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from ledger import coverage, metrics, reconcile, retention, retention_state
from ledger.errors import InvalidInput
from ledger.models import CoverageReading, PurgeRun, RetentionChange, StateRetentionPolicy
from tests.conftest import TEST_LOGINS
from tests.support.processes import tries_as
from tests.support.retention import retention_admin

NAME = "cover.retain"
TARGET = "https://cms.example/api/articles"
OTHER = "https://cms.example/api/pages"


@reconcile.register(NAME)
class Listing(reconcile.Reconciler):
    """Lists `effects` (set by the test before each reading): every one unexplained, since
    no receipt exists in these tests."""

    effects: list[str] = []

    def list_effects(self, scope, since, until):
        return reconcile.Effects([{"external_id": e} for e in Listing.effects],
                                 query={"request": f"GET {scope.target}"})


def reading(target: str = TARGET, *, found: int = 1, days: int = 0, tenant: str = "default",
            account: str = "") -> CoverageReading:
    """One reading of `target` through `ledger.coverage.read` that found `found` unexplained
    effects, then taken `days` ago."""
    Listing.effects = [f"e-{n}" for n in range(found)]
    [summary] = coverage.read(target, since=timezone.now() - timedelta(hours=1),
                              operation=NAME, tenant=tenant, account=account)
    if days:
        age([summary.reading.pk], days)
    return CoverageReading.objects.get(pk=summary.reading.pk)


def raw(sql, params=()):
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else None


def age(ids, days: int) -> None:
    """Move the readings `ids` `days` into the past, triggers off (as a superuser would: a
    reading is immutable)."""
    raw("SET session_replication_role = replica")
    raw("UPDATE ledger_coveragereading SET created_at = now() - make_interval(days => %s) "
        "WHERE id = ANY(%s)", [days, list(ids)])
    raw("RESET session_replication_role")


def remaining() -> set[int]:
    return set(CoverageReading.objects.values_list("pk", flat=True))


def unexplained_lines() -> list[str]:
    return sorted(line for line in metrics.render().decode().splitlines()
                  if line.startswith("ledger_unexplained_effects{"))


def history() -> dict:
    """Readings of several keys, with their ages against the default policy (90 days)."""
    return {
        # three old readings of one key: the older two go, the latest stays
        "articles": [reading(found=3, days=200), reading(found=2, days=150),
                     reading(found=1, days=100)],
        # an old reading and a young latest one: the old one goes
        "pages": [reading(OTHER, found=5, days=200), reading(OTHER, found=0, days=10)],
        # the only reading of another account, very old: the latest of its key, kept
        "account": [reading(account="acct-2", found=4, days=400)],
        # another tenant's old readings of the same target: the older goes
        "acme": [reading(tenant="acme", found=7, days=300),
                 reading(tenant="acme", found=6, days=200)],
        # young readings: kept
        "young": [reading("https://cms.example/api/young", found=1, days=20),
                  reading("https://cms.example/api/young", found=2, days=10)],
    }


@pytest.mark.django_db
def test_purge_removes_old_readings_and_keeps_young_ones_and_the_latest_of_each_target(
        capsys):
    taken = history()
    before, shown = remaining(), unexplained_lines()
    assert len(shown) == 4, shown  # one line per tenant, operation and target

    call_command("purge", "--dry-run", actor="cron")
    assert remaining() == before
    [dry] = PurgeRun.objects.filter(state_policy__kind="coverage", dry_run=True)
    assert (dry.rows_purged, dry.policy_snapshot) == (
        4, {"kind": "coverage", "tenant": "", "purge_after_days": 90})
    assert {p.kind: n for p, n in retention_state.preview()}["coverage"] == 4
    assert "coverage (every tenant): would purge 4 coverage readings" in capsys.readouterr().out

    call_command("purge", actor="cron")
    gone = {taken["articles"][0].pk, taken["articles"][1].pk, taken["pages"][0].pk,
            taken["acme"][0].pk}
    assert remaining() == before - gone
    [run] = PurgeRun.objects.filter(state_policy__kind="coverage", dry_run=False)
    assert (run.rows_purged, run.actor, run.finished_at is not None) == (4, "cron", True)
    out = capsys.readouterr().out
    assert "coverage (every tenant): purged 4 coverage readings" in out
    assert re.search(r"purged 4 superseded facts, episodes, settled obligations and coverage "
                     r"readings, in 4 state policies", out), out
    # /metrics reads the latest reading per key: the same before and after
    assert unexplained_lines() == shown
    assert 'operation="cover.retain",target="https://cms.example/api/articles",' \
           'tenant="default"} 5.0' in "\n".join(shown)  # 1 (latest) + 4 (acct-2's only one)
    # what is left is each key's latest and the young: a second purge finds nothing
    assert retention.purge(actor="again").purged_state_ids == []


@pytest.mark.django_db
def test_the_coverage_policy_is_set_like_the_others_and_every_change_is_audited():
    admin = retention_admin()
    default = StateRetentionPolicy.objects.get(kind="coverage", tenant="")
    assert default.purge_after_days == 90
    assert RetentionChange.objects.filter(state_policy_id=default.pk).values_list(
        "action", "changed_by_name").get() == ("created", "migration 0058_coverage_retention")
    with pytest.raises(InvalidInput, match="expected a tenant's policy to delete"):
        retention_state.delete_state_policy(default, user=admin)
    acme = retention_state.set_state_policy("coverage", tenant="acme", purge_after_days=1000,
                                            user=admin)
    retention_state.set_state_policy("coverage", tenant="acme", purge_after_days=1000,
                                     user=admin)  # no change: nothing written
    ours = [reading(found=2, days=400), reading(found=1, days=10)]
    theirs = [reading(tenant="acme", found=2, days=400), reading(tenant="acme", days=10)]

    assert retention.purge(actor="t").purged_state_ids == [ours[0].pk]
    retention_state.set_state_policy("coverage", tenant="acme", purge_after_days=30,
                                     user=admin)
    assert retention.purge(actor="t").purged_state_ids == [theirs[0].pk]
    assert remaining() == {ours[1].pk, theirs[1].pk}
    changes = RetentionChange.objects.filter(state_policy_id=acme.pk).order_by("id")
    assert [(c.action, c.changed_by_name, c.before, c.after) for c in changes] == [
        ("created", admin.username, None,
         {"kind": "coverage", "tenant": "acme", "purge_after_days": 1000}),
        ("updated", admin.username,
         {"kind": "coverage", "tenant": "acme", "purge_after_days": 1000},
         {"kind": "coverage", "tenant": "acme", "purge_after_days": 30})]


def refused(sql, params=(), *, match):
    with pytest.raises(DatabaseError, match=match), transaction.atomic():
        raw(sql, params)


@pytest.mark.django_db
def test_postgresql_refuses_every_other_delete_even_the_owner_s_inside_the_purge():
    old, latest = reading(found=2, days=200), reading(found=1, days=100)
    young = [reading(OTHER, days=10), reading(OTHER, days=5)]
    acme = [reading(tenant="acme", days=200), reading(tenant="acme")]
    retention_state.set_state_policy("coverage", tenant="acme", purge_after_days=365,
                                     user=retention_admin())

    # outside the purge: refused, old or latest, DELETE or UPDATE
    for pk in (old.pk, latest.pk):
        refused("DELETE FROM ledger_coveragereading WHERE id = %s", [pk],
                match="expected readings never to change and only the retention purge")
    refused("UPDATE ledger_coveragereading SET unexplained_count = 0 WHERE id = %s",
            [old.pk], match="found UPDATE of an older reading")
    # inside it (the setting the purge function sets, as the tables' owner): never the
    # latest reading of its key, however old, nor an UPDATE
    refused("SET LOCAL ledger.sanctioned = 'retention'; "
            "DELETE FROM ledger_coveragereading WHERE id = %s", [latest.pk],
            match="found DELETE of the latest reading")
    refused("SET LOCAL ledger.sanctioned = 'retention'; "
            "DELETE FROM ledger_coveragereading WHERE id = ANY(%s)", [[old.pk, latest.pk]],
            match="found DELETE of the latest reading")
    refused("SET LOCAL ledger.sanctioned = 'retention'; "
            "UPDATE ledger_coveragereading SET listed = 0 WHERE id = %s", [old.pk],
            match="found UPDATE")
    # the purge function checks each reading again by the database's clock
    policy = StateRetentionPolicy.objects.get(kind="coverage", tenant="")
    run = PurgeRun.objects.create(state_policy=policy, policy_snapshot={}, actor="t",
                                  batch_size=1, started_at=timezone.now())
    for pk, found in ((latest.pk, r"\(governed by it, the latest\)"),
                      (young[0].pk, r"\(governed by it, a later one exists\)"),
                      (acme[0].pk, r"\(governed by another policy, a later one exists\)")):
        refused("SELECT ledger_retention_purge_state(%s, %s)", [run.pk, [old.pk, pk]],
                match=f"expected a reading taken more than 90 days ago.*{found}")
    assert remaining() == {old.pk, latest.pk, *(r.pk for r in young), *(r.pk for r in acme)}
    assert raw("SELECT ledger_retention_purge_state(%s, %s)", [run.pk, [old.pk]]) == [(old.pk,)]
    run.refresh_from_db()
    assert run.rows_purged == 1


ROLE_TRIES = {  # name -> SQL, its ids filled in by the test
    "delete": "DELETE FROM ledger_coveragereading WHERE id = %(old)s",
    "delete_all": "DELETE FROM ledger_coveragereading",
    "update": "UPDATE ledger_coveragereading SET unexplained_count = 0",
    "function": "SELECT ledger_retention_purge_state(%(run)s, ARRAY[%(latest)s]::bigint[])",
}


@pytest.mark.django_db(transaction=True)
def test_no_role_deletes_a_reading_and_the_purge_function_is_the_reconciler_s_alone():
    old, latest = reading(found=2, days=200), reading(found=1, days=100)
    policy = StateRetentionPolicy.objects.get(kind="coverage", tenant="")
    run = PurgeRun.objects.create(state_policy=policy, policy_snapshot={}, actor="t",
                                  batch_size=1, started_at=timezone.now())
    ids = {"old": old.pk, "latest": latest.pk, "run": run.pk}
    before = remaining()
    for kind in ("agent", "reconciler", "desk", "web"):
        found = tries_as(TEST_LOGINS[kind], {name: sql % ids for name, sql in ROLE_TRIES.items()})
        for name in ("delete", "delete_all", "update"):
            assert found[name][0] == "42501", (kind, name, found[name])
            assert "permission denied for table ledger_coveragereading" in found[name][1], (
                kind, name, found[name])
        if kind == "reconciler":
            assert found["function"][0] == "23514", found["function"]
            assert "expected a reading taken more than 90 days ago" in found["function"][1]
        else:
            assert found["function"][0] == "42501", (kind, found["function"])
    assert remaining() == before
