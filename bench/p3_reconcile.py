"""P3: how reconciliation scales with workers.

1, 2 and 4 worker threads drain the same number of outcome_unknown operations with a
reconciler whose look-up waits 20 ms (an I/O-bound read of the external system). Throughput
ratios against one worker, and a check that every operation was looked up exactly once
and none was skipped.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid

if __package__ in (None, ""):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import parse_args, print_table, record, setup_django

SCALES = {"quick": 300, "full": 2000}
WORKERS = (1, 2, 4)
LOOKUP_WAIT = 0.020


def main() -> dict:
    args = parse_args(__doc__.splitlines()[0])
    setup_django()
    from django.db import connections

    from ledger import receipts, reconcile
    from ledger.models import Operation
    from ledger.states import State

    n = SCALES[args.scale]
    looked_up: collections.Counter = collections.Counter()
    lock = threading.Lock()

    @reconcile.register("bench.reconcile")
    class SlowLookup(reconcile.Reconciler):
        def lookup(self, op):
            time.sleep(LOOKUP_WAIT)
            with lock:
                looked_up[op.pk] += 1
            return reconcile.Found(f"ext-{op.pk}", matched_by="idempotency_key")

        def search(self, op):
            raise AssertionError("lookup always answers")

    def seed(tag: str) -> set[int]:
        pks = set()
        for i in range(n):
            op = receipts.record_intent("bench.reconcile", "https://svc.example", {"i": i},
                                        idempotency_key=f"p3-{tag}-{i}")
            receipts.mark_submitted(op)
            receipts.mark_outcome_unknown(op, error_code="timeout")
            pks.add(op.pk)
        return pks

    def drain(workers: int, pks: set[int]) -> float:
        def body(name: str) -> None:
            try:
                while reconcile.run_once(worker=name, limit=5):
                    pass
            finally:
                connections.close_all()

        threads = [threading.Thread(target=body, args=(f"p3-w{i}",)) for i in range(workers)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - started
        left = Operation.objects.filter(pk__in=pks).exclude(state=State.SUCCEEDED).count()
        counts = [looked_up[pk] for pk in pks]
        if left or set(counts) != {1}:
            raise SystemExit(f"expected {len(pks)} operations each reconciled exactly once, "
                             f"found {left} unfinished and look-up counts {sorted(set(counts))}")
        return elapsed

    throughput = {}
    for workers in WORKERS:
        pks = seed(f"{uuid.uuid4().hex[:8]}-{workers}")
        elapsed = drain(workers, pks)
        throughput[workers] = n / elapsed
    base = throughput[1]
    rows = [(f"{w} worker{'s' if w > 1 else ''}",
             f"{throughput[w]:7.1f} ops/s  {throughput[w] / base:.2f}x one worker")
            for w in WORKERS]
    rows.append(("each operation reconciled", "exactly once (checked)"))
    print_table(f"P3 reconcile scaling, {n} operations, look-up waits "
                f"{LOOKUP_WAIT * 1000:.0f} ms", rows)
    summary = {"scale": args.scale, "operations": n, "ratio": throughput[4] / base,
               "ratio_2_workers": throughput[2] / base,
               "throughput_ops_per_s": {str(w): t for w, t in throughput.items()}}
    record("P3", summary)
    return summary


if __name__ == "__main__":
    main()
