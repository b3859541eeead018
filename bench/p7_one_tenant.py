"""P7: many writers on one tenant, with a 2 ms commit, against many tenants and bare ORM.

16 writer processes each run receipt lifecycles (intent, submitted, succeeded: three
commits) in a loop for a fixed time, in three modes: all on one tenant, each on its own
tenant, and the same three commits as bare ORM statements on a copy of the operations
table without triggers or events (P1's bare side). Every session of the measurement sets
`commit_delay` = 2000 us and `commit_siblings` = 0 through PGOPTIONS, so each WAL flush
waits 2 ms, as on a managed server whose commits wait for a synchronous standby (needs a
superuser role and fsync on, as the embedded server and a default server have).

While a ledger mode runs, one sealer process (`ledger.sealer`, its sessions delayed too)
links the committed events into the chain; its lag is sampled every half second, and the
time it takes to catch up after the writers stop is printed. The modes alternate over
rounds; each figure is the sum of its rounds. The claims: one tenant / many tenants
(`one_tenant_vs_many`, goal >= 0.8) and one tenant / bare (`one_tenant_vs_bare`, goal
>= 0.6).
"""

from __future__ import annotations

import multiprocessing
import os
import time
import uuid

if __package__ in (None, ""):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import parse_args, print_table, quiet_server, record, setup_django

WRITERS = 16
# seconds per mode and round, rounds
SCALES = {"quick": (6.0, 2), "full": (20.0, 3)}
SLOW_COMMIT = "-c commit_delay=2000 -c commit_siblings=0"
MODES = ("bare", "one_tenant", "many_tenants")


def _delayed_session() -> None:
    os.environ["PGOPTIONS"] = (os.environ.get("PGOPTIONS", "") + " " + SLOW_COMMIT).strip()
    setup_django()


def writer(index: int, jobs, results) -> None:
    """One writer process: runs each (mode, start, end) job it is given; reports counts."""
    _delayed_session()
    from django.db import connection
    from django.utils import timezone

    from bench.p1_lifecycle import bare_model
    from ledger import receipts

    BareOperation = bare_model()
    run = uuid.uuid4().hex[:8]
    counter = iter(range(10**9))
    with connection.cursor() as cursor:
        cursor.execute("SELECT setting FROM pg_settings WHERE name = 'commit_delay'")
        results.put(("ready", index, cursor.fetchone()[0]))

    def intent(i: int) -> dict:
        return {"title": f"Report {run}-{i}", "body": "x" * 400, "tags": ["a", "b"]}

    def ledger_lifecycle(tenant: str) -> None:
        i = next(counter)
        op = receipts.record_intent("bench.p7", "https://cms.example/api", intent(i),
                                    tenant=tenant, idempotency_key=f"p7-{run}-{i}")
        receipts.mark_submitted(op)
        receipts.mark_succeeded(op, external_id=f"ext-{run}-{i}")

    def bare_lifecycle(tenant: str) -> None:
        i = next(counter)
        now = timezone.now()
        row = BareOperation.objects.create(
            operation_id=f"bare-{run}-{i}", tenant=tenant, operation="bench.bare",
            target="https://cms.example/api", intent=intent(i), intent_fingerprint="sha256:0",
            idempotency_key=f"bare-{run}-{i}", state="planned", version=1,
            created_at=now, state_changed_at=now,
        )
        BareOperation.objects.filter(pk=row.pk).update(
            state="submitted", version=2, submitted_at=now, state_changed_at=now)
        BareOperation.objects.filter(pk=row.pk).update(
            state="succeeded", version=3, external_id=f"ext-{i}", completed_at=now,
            state_changed_at=now)

    while True:
        job = jobs.get()
        if job is None:
            return
        mode, start, end = job
        tenant = f"p7-{index}" if mode == "many_tenants" else "p7"
        step = bare_lifecycle if mode == "bare" else ledger_lifecycle
        step(tenant)  # warm this mode's statements before the clock starts
        while time.time() < start:
            time.sleep(0.001)
        done = 0
        while True:
            step(tenant)
            if time.time() > end:
                break  # finished after the end: not counted
            done += 1
        results.put(("done", index, done))


def sealer_process(stop) -> None:
    _delayed_session()
    from ledger import sealer

    sealer.run(stop, interval=0.5)


def main() -> dict:
    args = parse_args(__doc__.splitlines()[0])
    setup_django()
    from django.db import connection

    from bench.p1_lifecycle import bare_model
    from bench.p2_queue import reset
    from ledger import chain

    bare_model()
    reset()
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE bench_bare_operation")
        cursor.execute("DELETE FROM ledger_chainhead WHERE chain = 'operation_events'")
    quiet_server()
    seconds, rounds = SCALES[args.scale]

    spawn = multiprocessing.get_context("spawn")
    jobs = [spawn.Queue() for _ in range(WRITERS)]
    results = spawn.Queue()
    writers = [spawn.Process(target=writer, args=(i, jobs[i], results), daemon=True)
               for i in range(WRITERS)]
    for process in writers:
        process.start()
    delays = {results.get(timeout=300)[2] for _ in writers}
    if delays != {"2000"}:
        raise SystemExit(f"expected every writer's session at commit_delay 2000 us, found "
                         f"{delays}")

    totals = dict.fromkeys(MODES, 0)
    lag_max, drains = 0.0, []
    for round_ in range(rounds):
        order = MODES[round_ % 3:] + MODES[:round_ % 3]  # each mode goes first once
        for mode in order:
            stop = spawn.Event()
            sealing = None
            if mode != "bare":
                sealing = spawn.Process(target=sealer_process, args=(stop,), daemon=True)
                sealing.start()
            start = time.time() + 3.0  # every writer warmed and waiting
            for queue in jobs:
                queue.put((mode, start, start + seconds))
            counts = []
            while len(counts) < WRITERS:
                time.sleep(0.5)
                if mode != "bare" and time.time() > start:
                    lag_max = max(lag_max, chain.seal_lag_seconds())
                while not results.empty():
                    counts.append(results.get()[2])
            totals[mode] += sum(counts)
            if sealing is not None:
                began = time.monotonic()
                while chain.unsealed() and time.monotonic() - began < 120:
                    time.sleep(0.1)
                drains.append(time.monotonic() - began)
                stop.set()
                sealing.join(30)
            print(f"round {round_ + 1} {mode:<13} {sum(counts) / seconds:8.1f} lifecycles/s",
                  flush=True)
    for queue in jobs:
        queue.put(None)
    for process in writers:
        process.join(30)

    elapsed = seconds * rounds
    rate = {mode: totals[mode] / elapsed for mode in MODES}
    summary = {
        "scale": args.scale,
        "writers": WRITERS,
        "seconds_per_mode": elapsed,
        "lifecycles_per_s": rate,
        "one_tenant_vs_many": rate["one_tenant"] / rate["many_tenants"],
        "one_tenant_vs_bare": rate["one_tenant"] / rate["bare"],
        "sealer_max_lag_s": lag_max,
        "sealer_catch_up_s": max(drains, default=0.0),
        "unsealed_after": sum(tail.events for tail in chain.unsealed()),
    }
    summary["ratio"] = summary["one_tenant_vs_many"]
    print_table(f"P7 {WRITERS} writers, 2 ms commits, {elapsed:.0f} s per mode", [
        ("bare ORM (3 commits)", f"{rate['bare']:8.1f} lifecycles/s"),
        ("ledger, one tenant", f"{rate['one_tenant']:8.1f} lifecycles/s"),
        ("ledger, one tenant per writer", f"{rate['many_tenants']:8.1f} lifecycles/s"),
        ("one tenant / many tenants", f"{summary['one_tenant_vs_many']:.2f}x (goal >= 0.8)"),
        ("one tenant / bare", f"{summary['one_tenant_vs_bare']:.2f}x (goal >= 0.6)"),
        ("sealer lag, max sampled", f"{lag_max:.2f} s; caught up "
                                    f"{summary['sealer_catch_up_s']:.2f} s after the writers"),
    ])
    record("P7", summary)
    return summary


if __name__ == "__main__":
    main()
