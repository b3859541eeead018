"""P3: how reconciliation scales with workers.

1, 2 and 4 workers drain the same number of outcome_unknown operations with a reconciler
whose look-up waits 20 ms (an I/O-bound read of the external system): throughput ratios
against one worker, and a check that every operation was looked up exactly once and none
was skipped. Workers run two ways, as they are deployed: as processes (one `manage.py
reconcile` each; the claim) and as threads of one process (`manage.py reconcile
--workers N`), where Python's GIL serializes the CPU part of every claim. The operations
tables of the bench database are emptied first, so the workers drain only these. Each
run starts on a quiet server: the tables its seeding wrote are vacuumed and analyzed and a
checkpoint is taken, so that autovacuum's and the checkpointer's work on what the seeding
left does not land in one run's few seconds and not in another's.
"""

from __future__ import annotations

import collections
import multiprocessing
import threading
import time
import uuid

if __package__ in (None, ""):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import parse_args, print_table, quiet_server, record, setup_django
from bench.p2_queue import reset

SCALES = {"quick": 600, "full": 2000}
WORKERS = (1, 2, 4)
LOOKUP_WAIT = 0.020
LIMIT = 100  # operations per pass, as `manage.py reconcile` takes by default
OPERATION = "bench.reconcile"


def register(looked_up: collections.Counter, lock: threading.Lock) -> None:
    """Register the slow reconciler, counting look-ups into `looked_up`."""
    from ledger import reconcile

    @reconcile.register(OPERATION)
    class SlowLookup(reconcile.Reconciler):
        def lookup(self, op):
            time.sleep(LOOKUP_WAIT)
            with lock:
                looked_up[op.pk] += 1
            return reconcile.Found(f"ext-{op.pk}", matched_by="idempotency_key")

        def search(self, op):
            raise AssertionError("lookup always answers")


def drain_loop(name: str) -> None:
    from django.db import connections

    from ledger import reconcile

    try:
        while reconcile.run_once(worker=name, limit=LIMIT):
            pass
    finally:
        connections.close_all()


def process_worker(name: str, ready, start, results) -> None:
    """One worker process: set up, wait for the start, drain, report look-ups and end time."""
    setup_django()
    looked_up: collections.Counter = collections.Counter()
    register(looked_up, threading.Lock())
    ready.put(name)
    start.wait()
    drain_loop(name)
    results.put((dict(looked_up), time.monotonic()))


def main() -> dict:
    args = parse_args(__doc__.splitlines()[0])
    setup_django()
    from django.db import connection, connections

    from ledger import receipts
    from ledger.models import Operation
    from ledger.states import State

    n = SCALES[args.scale]
    reset()  # run_once claims every due operation: P2 leaves thousands behind
    looked_up: collections.Counter = collections.Counter()
    register(looked_up, threading.Lock())

    def seed(tag: str) -> set[int]:
        pks = set()
        for i in range(n):
            op = receipts.record_intent(OPERATION, "https://svc.example", {"i": i},
                                        idempotency_key=f"p3-{tag}-{i}")
            receipts.mark_submitted(op)
            receipts.mark_outcome_unknown(op, error_code="timeout")
            pks.add(op.pk)
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE ledger_operation, ledger_operationevent, "
                           "ledger_evidence, ledger_lease")
        quiet_server()
        return pks

    def check(pks: set[int], counts: collections.Counter) -> None:
        left = Operation.objects.filter(pk__in=pks).exclude(state=State.SUCCEEDED).count()
        seen = {counts[pk] for pk in pks}
        if left or seen != {1} or set(counts) - pks:
            raise SystemExit(f"expected {len(pks)} operations each reconciled exactly once, "
                             f"found {left} unfinished and look-up counts {sorted(seen)}")

    def threads(workers: int) -> float:
        pks = seed(uuid.uuid4().hex[:8])
        looked_up.clear()
        pool = [threading.Thread(target=drain_loop, args=(f"p3-t{i}",)) for i in range(workers)]
        started = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        elapsed = time.perf_counter() - started
        check(pks, looked_up)
        return n / elapsed

    def processes(workers: int) -> float:
        pks = seed(uuid.uuid4().hex[:8])
        connections.close_all()
        context = multiprocessing.get_context("spawn")
        ready, results, start = context.Queue(), context.Queue(), context.Event()
        pool = [context.Process(target=process_worker, args=(f"p3-p{i}", ready, start, results))
                for i in range(workers)]
        for p in pool:
            p.start()
        for _ in pool:
            ready.get(timeout=120)
        started = time.monotonic()
        start.set()
        reports = [results.get(timeout=600) for _ in pool]
        for p in pool:
            p.join()
        elapsed = max(ended for _, ended in reports) - started
        counts: collections.Counter = collections.Counter()
        for report, _ in reports:
            counts.update(report)
        check(pks, counts)
        return n / elapsed

    throughput = {"processes": {}, "threads": {}}
    for workers in WORKERS:
        throughput["processes"][workers] = processes(workers)
        throughput["threads"][workers] = threads(workers)
    rows = []
    for mode, label in (("processes", "process"), ("threads", "thread")):
        base = throughput[mode][1]
        rows += [(f"{w} worker {label}{'es' if w > 1 and mode == 'processes' else ''}"
                  f"{'s' if w > 1 and mode == 'threads' else ''}",
                  f"{throughput[mode][w]:7.1f} ops/s  {throughput[mode][w] / base:.2f}x one")
                 for w in WORKERS]
    rows.append(("each operation reconciled", "exactly once (checked, every run)"))
    print_table(f"P3 reconcile scaling, {n} operations a run, look-up waits "
                f"{LOOKUP_WAIT * 1000:.0f} ms", rows)
    procs, thrs = throughput["processes"], throughput["threads"]
    summary = {"scale": args.scale, "operations": n, "ratio": procs[4] / procs[1],
               "ratio_2_workers": procs[2] / procs[1],
               "ratio_threads": thrs[4] / thrs[1],
               "throughput_ops_per_s": {mode: {str(w): t for w, t in by.items()}
                                        for mode, by in throughput.items()}}
    record("P3", summary)
    return summary


if __name__ == "__main__":
    main()
