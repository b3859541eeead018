"""P1: what a receipt costs an agent.

N operations go through intent -> submitted -> succeeded with the ledger API (checks,
redaction, fingerprint, compare-and-set, one event per transition, triggers), against the
same three commits written as minimal bare Django ORM statements on a copy of the table
without triggers (no events, no checks). Beside them, interleaved in the same rounds, the
lifecycle in two commits: `record_intent(submit=True)` (the intent and its submission in
one transaction, as the decorator does by default) then succeeded, against two bare ORM
commits (the row inserted submitted, then updated). All four sides interleave operation by
operation.
The claim is the ratio of the median lifecycles (a stall of the shared machine lands on one
side or the other at random and moves a ratio of totals by itself); the ratio of the
totals is printed beside it.
Then the same again with `synchronous_commit = off`, to show what the fsync at each commit
costs. Last, the ledger's lifecycle as the agent's role (ledger_agent, `manage.py
db_roles`: its grants, and the role checks of migration 0030), as a login PostgreSQL
limits to one tenant (row-level security, migration 0048) and as the tables' owner,
interleaved, each on a connection of its own.
"""

from __future__ import annotations

import itertools
import uuid

if __package__ in (None, ""):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Stopwatch,
    analyzer,
    interleave,
    ms,
    parse_args,
    print_table,
    quiet_server,
    record,
    setup_django,
)
from bench.p2_queue import reset

SCALES = {"quick": 300, "full": 3000}


def bare_model():
    from django.db import connection, models

    from ledger.models import Operation

    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS bench_bare_operation (LIKE ledger_operation INCLUDING ALL)"
        )
    attrs = {"__module__": __name__}
    for field in Operation._meta.local_fields:
        clone = field.clone()
        if isinstance(clone, models.ForeignKey):
            clone.remote_field.related_name = "+"
            clone.db_constraint = False
        attrs[field.name] = clone
    attrs["Meta"] = type("Meta", (), {"app_label": "ledger", "managed": False,
                                      "db_table": "bench_bare_operation"})
    return type("BareOperation", (models.Model,), attrs)


def main() -> dict:
    args = parse_args(__doc__.splitlines()[0])
    setup_django()
    from django.db import connection
    from django.utils import timezone

    from ledger import receipts

    BareOperation = bare_model()
    # Both sides start from empty tables on a quiet server: after a large purge (P5 of an
    # earlier run) autovacuum and the checkpointer work on the ledger's tables for minutes,
    # and measured meanwhile the ledger side ran 1.6-1.9x the bare one instead of ~1.15x.
    reset()
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE bench_bare_operation")
    quiet_server()
    n = SCALES[args.scale]
    counter = itertools.count()
    run = uuid.uuid4().hex[:10]  # keys never collide with an earlier run's

    def intent(i: int) -> dict:
        # A different article each time, as an agent sends: one intent repeated under new
        # keys would make every success a duplicate of the last (which the ledger flags).
        return {"title": f"Quarterly report {run}-{i}", "body": "x" * 400, "tags": ["a", "b"],
                "headers": {"Authorization": "Bearer secret", "Content-Type": "json"}}

    def ledger_lifecycle():
        i = next(counter)
        op = receipts.record_intent("bench.lifecycle", "https://cms.example/api", intent(i),
                                    idempotency_key=f"p1-{run}-{i}")
        receipts.mark_submitted(op)
        receipts.mark_succeeded(op, external_id=f"ext-{i}")

    def ledger_two_commits():
        i = next(counter)
        op = receipts.record_intent("bench.lifecycle", "https://cms.example/api", intent(i),
                                    idempotency_key=f"p1-{run}-{i}", submit=True)
        receipts.mark_succeeded(op, external_id=f"ext-{i}")

    def bare_two_commits():
        i = next(counter)
        now = timezone.now()
        row = BareOperation.objects.create(
            operation_id=f"bare-{run}-{i}", tenant="default", operation="bench.bare",
            target="https://cms.example/api", intent=intent(i), intent_fingerprint="sha256:0",
            idempotency_key=f"bare-{run}-{i}", state="submitted", version=1,
            created_at=now, state_changed_at=now, submitted_at=now,
        )
        BareOperation.objects.filter(pk=row.pk).update(
            state="succeeded", version=2, external_id=f"ext-{i}", completed_at=now,
            state_changed_at=now,
        )

    def bare_lifecycle():
        i = next(counter)
        now = timezone.now()
        row = BareOperation.objects.create(
            operation_id=f"bare-{run}-{i}", tenant="default", operation="bench.bare",
            target="https://cms.example/api", intent=intent(i), intent_fingerprint="sha256:0",
            idempotency_key=f"bare-{run}-{i}", state="planned", version=1,
            created_at=now, state_changed_at=now,
        )
        BareOperation.objects.filter(pk=row.pk).update(
            state="submitted", version=2, submitted_at=now, state_changed_at=now
        )
        BareOperation.objects.filter(pk=row.pk).update(
            state="succeeded", version=3, external_id=f"ext-{i}", completed_at=now,
            state_changed_at=now,
        )

    for _ in range(20):  # warm caches, plans and connections on every side
        ledger_lifecycle()
        bare_lifecycle()
        ledger_two_commits()
        bare_two_commits()

    analyze = analyzer(["ledger_operation", "ledger_operationevent", "ledger_operationsearch",
                        "bench_bare_operation"])
    if analyze is not None:
        analyze()
    results = {}
    for label, sync in (("fsync on", "on"), ("synchronous_commit off", "off")):
        with connection.cursor() as cursor:
            cursor.execute(f"SET synchronous_commit TO {sync}")
        ours, bare = Stopwatch("ledger"), Stopwatch("bare")
        ours2, bare2 = Stopwatch("ledger, 2 commits"), Stopwatch("bare, 2 commits")
        interleave(n, [(ours, ledger_lifecycle), (bare, bare_lifecycle),
                       (ours2, ledger_two_commits), (bare2, bare_two_commits)],
                   between=analyze)
        results[sync] = {
            "ledger_ops_per_s": n / ours.total,
            "bare_ops_per_s": n / bare.total,
            "ledger_median_ms": ours.median * 1000,
            "bare_median_ms": bare.median * 1000,
            "ledger_p99_ms": ours.percentile(0.99) * 1000,
            "ratio": ours.median / bare.median,
            "ratio_of_totals": ours.total / bare.total,
            "two_commits": {
                "ledger_ops_per_s": n / ours2.total,
                "bare_ops_per_s": n / bare2.total,
                "ledger_median_ms": ours2.median * 1000,
                "bare_median_ms": bare2.median * 1000,
                "ledger_p99_ms": ours2.percentile(0.99) * 1000,
                "ratio": ours2.median / bare2.median,
                "ratio_of_totals": ours2.total / bare2.total,
                "vs_three_commits": ours2.median / ours.median,
            },
        }
        print_table(f"P1 lifecycle, {n} operations each, {label}", [
            ("ledger API (3 commits + 3 events)", f"{n / ours.total:8.0f} ops/s, "
                                                  f"median {ms(ours.median)}, "
                                                  f"p99 {ms(ours.percentile(0.99))}"),
            ("bare ORM (3 commits)", f"{n / bare.total:8.0f} ops/s, median {ms(bare.median)}"),
            ("ratio ledger / bare", f"{ours.median / bare.median:.2f}x of the medians, "
                                    f"{ours.total / bare.total:.2f}x of the totals"),
            ("ledger API, submit=True (2 commits + 3 events)",
             f"{n / ours2.total:8.0f} ops/s, median {ms(ours2.median)}, "
             f"p99 {ms(ours2.percentile(0.99))}"),
            ("bare ORM (2 commits)", f"{n / bare2.total:8.0f} ops/s, "
                                     f"median {ms(bare2.median)}"),
            ("ratio ledger / bare, 2 commits", f"{ours2.median / bare2.median:.2f}x of the "
                                               f"medians, {ours2.total / bare2.total:.2f}x of "
                                               "the totals"),
            ("ledger 2 commits / 3 commits", f"{ours2.median / ours.median:.2f}x of the medians"),
        ])
    with connection.cursor() as cursor:
        cursor.execute("SET synchronous_commit TO on")
    as_agent, as_limited, as_owner = agent_beside_owner(n, ledger_lifecycle)
    print_table(f"P1 lifecycle, {n} operations each, as the agent's role / as the owner", [
        ("as ledger_agent", f"{n / as_agent.total:8.0f} ops/s, median {ms(as_agent.median)}"),
        ("as a login limited to one tenant", f"{n / as_limited.total:8.0f} ops/s, "
                                             f"median {ms(as_limited.median)}"),
        ("as the tables' owner", f"{n / as_owner.total:8.0f} ops/s, "
                                 f"median {ms(as_owner.median)}"),
        ("ratio agent / owner", f"{as_agent.median / as_owner.median:.3f}x of the medians, "
                                f"{as_agent.total / as_owner.total:.3f}x of the totals"),
        ("ratio one-tenant login / agent", f"{as_limited.median / as_agent.median:.3f}x of the "
                                           f"medians, {as_limited.total / as_agent.total:.3f}x "
                                           "of the totals"),
    ])
    results["agent_role"] = {"ratio": as_agent.median / as_owner.median,
                             "ratio_of_totals": as_agent.total / as_owner.total,
                             "agent_median_ms": as_agent.median * 1000,
                             "owner_median_ms": as_owner.median * 1000}
    results["one_tenant_login"] = {"ratio": as_limited.median / as_agent.median,
                                   "ratio_of_totals": as_limited.total / as_agent.total,
                                   "limited_median_ms": as_limited.median * 1000}
    summary = {
        "scale": args.scale,
        "operations": n,
        "ratio": results["on"]["ratio"],
        "ratio_two_commits": results["on"]["two_commits"]["ratio"],
        "two_vs_three_commits": results["on"]["two_commits"]["vs_three_commits"],
        "ratio_sync_off": results["off"]["ratio"],
        "ratio_two_commits_sync_off": results["off"]["two_commits"]["ratio"],
        "fsync_cost_ledger": results["off"]["ledger_ops_per_s"] / results["on"]["ledger_ops_per_s"],
        "agent_role_ratio": results["agent_role"]["ratio"],
        "one_tenant_login_ratio": results["one_tenant_login"]["ratio"],
        "details": results,
    }
    print(f"fsync: the ledger does {summary['fsync_cost_ledger']:.2f}x more lifecycles/s "
          "with synchronous_commit off")
    record("P1", summary)
    return summary


# A login PostgreSQL limits to the one tenant the lifecycles write (`db_roles --login
# NAME=agent --tenants default`): its row-level security against ledger_agent's, which no
# tenant limits (the login every agent had before).
ONE_TENANT_LOGIN = "ledger_bench_one_tenant"


def agent_beside_owner(n: int, lifecycle) -> tuple[Stopwatch, Stopwatch, Stopwatch]:
    """`lifecycle` n times as ledger_agent, n times as a login limited to one tenant and n
    times as the owner, the order rotating each round. Each side has a connection of its
    own, its role set once (`SET ROLE`: the limited login's policies key on the current
    user too), as a process logged in as that role would: switching roles on one
    connection would re-plan every cached statement of a table under row-level security
    at each switch, which no real process does. The sides' connections take turns as the
    default one between lifecycles, outside the timing."""
    from django.db import connections

    from ledger import db_roles

    db_roles.apply(logins=[(ONE_TENANT_LOGIN, (db_roles.AGENT,), ("default",))])
    agent, limited, owner = Stopwatch("agent"), Stopwatch("one tenant"), Stopwatch("owner")
    shared = connections["default"]
    sides = []
    for watch, role in ((agent, db_roles.ROLE[db_roles.AGENT]), (limited, ONE_TENANT_LOGIN),
                        (owner, None)):
        own = connections.create_connection("default")
        with own.cursor() as cursor:
            cursor.execute(f"SET ROLE {role}" if role else "RESET ROLE")
        sides.append((watch, own))
    try:
        for _ in range(20):  # warm each connection's caches and plans
            for _, own in sides:
                connections["default"] = own
                lifecycle()
        for r in range(n):
            for watch, own in sides[r % 3:] + sides[:r % 3]:
                connections["default"] = own
                watch.time(lifecycle)
    finally:
        connections["default"] = shared
        for _, own in sides:
            own.close()
    return agent, limited, owner


if __name__ == "__main__":
    main()
