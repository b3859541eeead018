"""P10: the ledger's action beside DBOS Transact's workflow with one step, on one server.

The same action on both sides: a call to an external system (here a function that returns
its id at once, so that only what each side records is measured), made at most once per
key. The ledger's side is a `@receipts.action` (the intent and its submission in one
commit, then the outcome: two commits, three events; and, beside it, the same with
`submit=False`, three commits); DBOS's is a workflow whose id is the key, with one step
that makes the call (its status, the step's output, the workflow's result, in DBOS's
system tables on the same PostgreSQL server, schema `dbos` of the bench database).

At 1 writer and at 8 (threads of this process, each side in turn for a few seconds,
alternating who goes first, in interleaved rounds), it prints each side's throughput and
latency, and the ratios ledger / DBOS (throughput; above 1, the ledger does more actions
a second). DBOS is a benchmark-only extra (`pip install -e '.[bench]'`); without it, P10
says so and skips.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid

if __package__ in (None, ""):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Stopwatch, ms, parse_args, print_table, quiet_server, record, setup_django

# (rounds, seconds per side and round)
SCALES = {"quick": (3, 3.0), "full": (5, 6.0)}
WRITERS = (1, 8)


def dbos_or_none():
    try:
        import dbos
    except ImportError:
        return None
    return dbos


def system_database_url() -> str:
    """The bench database, as a SQLAlchemy URL for DBOS's system tables."""
    from django.conf import settings
    from sqlalchemy.engine import URL

    db = settings.DATABASES["default"]
    return URL.create("postgresql+psycopg", username=db.get("USER") or None,
                      password=db.get("PASSWORD") or None, host=db.get("HOST") or None,
                      port=int(db["PORT"]) if db.get("PORT") else None,
                      database=db["NAME"]).render_as_string(hide_password=False)


def run_side(fn, writers: int, seconds: float, watch: Stopwatch) -> tuple[int, float]:
    """`fn` in a loop on `writers` threads for `seconds`: (calls made, seconds taken)."""
    from django.db import connection

    stop = time.monotonic() + seconds
    samples: list[list[float]] = [[] for _ in range(writers)]
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            while time.monotonic() < stop:
                started = time.perf_counter()
                fn()
                samples[k].append(time.perf_counter() - started)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            connection.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=writer, args=(k,)) for k in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    for part in samples:
        watch.samples.extend(part)
    return sum(len(part) for part in samples), elapsed


def main() -> dict | None:
    args = parse_args(__doc__.splitlines()[0])
    dbos = dbos_or_none()
    if dbos is None:
        print("P10 skipped: DBOS Transact is not installed; it is a benchmark-only extra: "
              "pip install -e '.[bench]' (or pip install dbos)")
        return None
    setup_django()
    from ledger import receipts

    rounds, seconds = SCALES[args.scale]
    run = uuid.uuid4().hex[:10]
    counter = itertools.count()

    def external_call(title: str) -> dict:
        return {"id": f"ext-{title}"}

    @receipts.action("bench.p10", target="https://cms.example/api",
                     key=lambda title: f"p10-{run}-{title}",
                     external_id=lambda value: value["id"])
    def publish(title: str) -> dict:
        return external_call(title)

    @receipts.action("bench.p10", target="https://cms.example/api", submit=False,
                     key=lambda title: f"p10-{run}-{title}",
                     external_id=lambda value: value["id"])
    def publish_three_commits(title: str) -> dict:
        return external_call(title)

    dbos_app = dbos.DBOS(config={
        "name": "ledger-bench-p10", "system_database_url": system_database_url(),
        "log_level": "WARNING", "sys_db_pool_size": 20,
    })

    @dbos.DBOS.step()
    def dbos_step(title: str) -> dict:
        return external_call(title)

    @dbos.DBOS.workflow()
    def dbos_workflow(title: str) -> dict:
        return dbos_step(title)

    dbos.DBOS.launch()

    def ledger_action():
        publish(str(next(counter)))

    def ledger_action_three_commits():
        publish_three_commits(str(next(counter)))

    def dbos_action():
        title = str(next(counter))
        with dbos.SetWorkflowID(f"p10-{run}-{title}"):
            dbos_workflow(title)

    for _ in range(20):  # warm both sides
        ledger_action()
        ledger_action_three_commits()
        dbos_action()
    quiet_server()
    sides = [("ledger", ledger_action), ("ledger, 3 commits", ledger_action_three_commits),
             ("DBOS", dbos_action)]
    results: dict = {"scale": args.scale}
    try:
        for writers in WRITERS:
            watches = {name: Stopwatch(name) for name, _ in sides}
            done = {name: [0, 0.0] for name, _ in sides}
            for r in range(rounds):
                for name, fn in sides if r % 2 == 0 else sides[::-1]:
                    calls, took = run_side(fn, writers, seconds, watches[name])
                    done[name][0] += calls
                    done[name][1] += took
            per_s = {name: calls / took for name, (calls, took) in done.items()}
            entry = {
                name: {"actions_per_s": per_s[name],
                       "median_ms": watches[name].median * 1000,
                       "p99_ms": watches[name].percentile(0.99) * 1000}
                for name, _ in sides
            }
            entry["ratio"] = per_s["ledger"] / per_s["DBOS"]
            entry["ratio_three_commits"] = per_s["ledger, 3 commits"] / per_s["DBOS"]
            results[f"writers_{writers}"] = entry
            print_table(f"P10 an action, {writers} writer(s), {rounds} rounds of "
                        f"{seconds:g} s a side", [
                *((name, f"{per_s[name]:8.0f} actions/s, median "
                         f"{ms(watches[name].median)}, p99 {ms(watches[name].percentile(0.99))}")
                  for name, _ in sides),
                ("ledger / DBOS (throughput)", f"{entry['ratio']:.2f}x; in 3 commits "
                                               f"{entry['ratio_three_commits']:.2f}x"),
            ])
    finally:
        dbos.DBOS.destroy()
        del dbos_app
    results["ratio"] = results["writers_1"]["ratio"]
    results["ratio_8"] = results["writers_8"]["ratio"]
    record("P10", results)
    return results


if __name__ == "__main__":
    main()
