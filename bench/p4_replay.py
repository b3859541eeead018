"""P4: what an idempotent replay costs.

`record_intent` with a key that already names an operation (the agent retrying after a
crash, which must learn "do not send again") against a first record with a new key.
Both interleave call by call.
"""

from __future__ import annotations

import itertools
import uuid

if __package__ in (None, ""):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Stopwatch, interleave, ms, parse_args, print_table, record, setup_django

SCALES = {"quick": 500, "full": 5000}


def main() -> dict:
    args = parse_args(__doc__.splitlines()[0])
    setup_django()
    from ledger import receipts

    n = SCALES[args.scale]
    run = uuid.uuid4().hex[:10]  # keys never collide with an earlier run's
    intent = {"to": "customer@example.com", "subject": "Your invoice", "body": "x" * 300}
    fresh = itertools.count()
    seen: list[str] = []

    def first_record():
        key = f"p4-{run}-{next(fresh)}"
        receipts.record_intent("email.send", "smtp://mail.example", intent,
                               idempotency_key=key)
        seen.append(key)

    replays = itertools.count()

    def replay():
        key = seen[next(replays) % len(seen)]
        receipts.record_intent("email.send", "smtp://mail.example", intent,
                               idempotency_key=key)

    for _ in range(20):
        first_record()
        replay()
    first, again = Stopwatch("first"), Stopwatch("replay")
    interleave(n, [(first, first_record), (again, replay)])
    ratio = again.total / first.total
    print_table(f"P4 idempotent replay, {n} calls each", [
        ("first record (insert + event + commit)", f"median {ms(first.median)}"),
        ("replay of an existing key", f"median {ms(again.median)}"),
        ("ratio replay / first", f"{ratio:.2f}x"),
    ])
    summary = {"scale": args.scale, "calls": n, "ratio": ratio,
               "first_median_ms": first.median * 1000, "replay_median_ms": again.median * 1000}
    record("P4", summary)
    return summary


if __name__ == "__main__":
    main()
