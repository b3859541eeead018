"""P6: obligation contention.

16 threads each commit an obligation: first 16 distinct obligations (no contention), then
all 16 the same one (exactly one wins; the 15 losers get AlreadyCommitted with the winner's
result). Rounds alternate between the two cases; the ratio is the time a round takes with
everyone on one obligation over a round on distinct ones.
"""

from __future__ import annotations

import threading
import time
import uuid

if __package__ in (None, ""):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ms, parse_args, print_table, record, setup_django

THREADS = 16
SCALES = {"quick": 15, "full": 100}


def main() -> dict:
    args = parse_args(__doc__.splitlines()[0])
    setup_django()
    from django.db import connections

    from ledger import errors, obligations, runs

    rounds = SCALES[args.scale]
    run = runs.start("P6 obligation contention", run_id=f"p6-{uuid.uuid4().hex[:10]}")
    tag = uuid.uuid4().hex[:8]

    def one_round(keys: list[str]) -> tuple[float, int, int]:
        for key in set(keys):
            obligations.open(run, "bench.commit", key)
        barrier = threading.Barrier(THREADS + 1)
        outcome = {"won": 0, "lost": 0}
        lock = threading.Lock()

        def body(key: str, i: int) -> None:
            try:
                barrier.wait()
                try:
                    obligations.commit(key, {"by": i})
                    won = True
                except errors.AlreadyCommitted:
                    won = False
                with lock:
                    outcome["won" if won else "lost"] += 1
            finally:
                connections.close_all()

        threads = [threading.Thread(target=body, args=(k, i)) for i, k in enumerate(keys)]
        for t in threads:
            t.start()
        barrier.wait()
        started = time.perf_counter()
        for t in threads:
            t.join()
        return time.perf_counter() - started, outcome["won"], outcome["lost"]

    distinct_times, same_times = [], []
    for r in range(rounds):
        distinct = [f"p6-{tag}-{r}-d{i}" for i in range(THREADS)]
        same = [f"p6-{tag}-{r}-same"] * THREADS
        cases = [(distinct, distinct_times), (same, same_times)]
        for keys, sink in cases if r % 2 == 0 else reversed(cases):
            elapsed, won, lost = one_round(keys)
            expected = (THREADS, 0) if keys is distinct else (1, THREADS - 1)
            if (won, lost) != expected:
                raise SystemExit(f"expected {expected} (won, lost) in round {r}, found "
                                 f"{(won, lost)}")
            sink.append(elapsed)
    distinct_total, same_total = sum(distinct_times), sum(same_times)
    ratio = same_total / distinct_total
    print_table(f"P6 obligation contention, {THREADS} threads, {rounds} rounds each", [
        ("16 distinct obligations", f"{rounds * THREADS / distinct_total:8.0f} commits/s, "
                                    f"round {ms(distinct_total / rounds)}"),
        ("16 threads, one obligation", f"1 winner + 15 AlreadyCommitted, round "
                                       f"{ms(same_total / rounds)}"),
        ("ratio same / distinct (round time)", f"{ratio:.2f}x"),
    ])
    summary = {"scale": args.scale, "rounds": rounds, "threads": THREADS, "ratio": ratio,
               "distinct_round_ms": distinct_total / rounds * 1000,
               "same_round_ms": same_total / rounds * 1000}
    record("P6", summary)
    return summary


if __name__ == "__main__":
    main()
