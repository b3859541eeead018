"""P5: purging resolved history while agents keep writing.

Bulk-loads resolved operations completed 400 days ago (past the default policy's 365),
three events each, then measures `record_intent` latency of an agent while another process
runs `manage.py purge`'s code, removing all of them in batches, and of the same agent alone
afterwards (the baseline, as many calls). Reports batches/s, the longest batch (its
transaction: pick, purge, commit), the longest step (the purge seals what the agent
committed meanwhile before each batch), and the agent's p50/p99 during the purge against
the baseline.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import uuid
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Stopwatch,
    ms,
    parse_args,
    print_table,
    quiet_server,
    record,
    setup_django,
)
from bench.p2_queue import reset, seed

SCALES = {"quick": 100_000, "full": 1_000_000}


def purge_process(ready, start, results) -> None:
    """Purge everything due as `manage.py purge` does by default (its batch size, target and pause);
    report each step's duration (sealing what agents committed meanwhile, then one batch),
    each batch transaction's alone and when each batch ended (time.monotonic, which every
    process of the machine shares), and first the purge's backend pid."""
    setup_django()
    from django.db import connection

    from ledger import retention

    pause = retention.POLITE_PAUSE
    batch_times: list[float] = []
    batch_ends: list[float] = []
    last = [0.0]

    def on_progress(message: str) -> None:
        now = time.perf_counter()
        if "so far" in message:  # reported right after each batch's transaction
            batch_ends.append(time.monotonic())
            if "purged" in message:
                batch_times.append(now - last[0])
        last[0] = now + pause.total_seconds()  # the purge sleeps right after reporting

    connection.ensure_connection()
    ready.put(connection.connection.info.backend_pid)
    start.wait()
    last[0] = time.perf_counter()
    result = retention.purge(actor="bench-p5", progress=on_progress, pause=pause)
    results.put((batch_times, result.batch_seconds, batch_ends, result.batch_sizes))


# One sample: the WAL insert position, and every other server process at work (pid, backend
# type, wait event type or CPU, wait event, start of its query): the idle ones, and the
# background processes waiting for something to do (wait type Activity), are left out.
_SAMPLE = """
    SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn,
           coalesce(array_agg(ARRAY[pid::text, backend_type, coalesce(wait_event_type, 'CPU'),
                                    coalesce(wait_event, '-'), left(query, 60)]), '{}')
      FROM pg_stat_activity
     WHERE pid <> pg_backend_pid() AND state IS DISTINCT FROM 'idle'
       AND wait_event_type IS DISTINCT FROM 'Activity'
"""


def wait_sampler(ready, stop, results, pids: tuple[int, ...], every: float = 0.004) -> None:
    """Sample `_SAMPLE`, and the CPU time of `pids` (on a CPU, waiting for one), every
    `every` seconds until `stop` is set; return the samples."""
    setup_django()
    from django.db import connection

    samples = []
    with connection.cursor() as cursor:
        ready.put("ready")
        while not stop.is_set():
            cursor.execute(_SAMPLE)
            lsn, rows = cursor.fetchone()
            samples.append((time.monotonic(), int(lsn), rows, [_cpu(pid) for pid in pids]))
            time.sleep(every)
    results.put(samples)


def _cpu(pid: int) -> tuple[int, int] | None:
    """Nanoseconds `pid` has run on a CPU and waited for one (Linux's schedstat), if this
    machine runs it (not so with a DATABASE_URL server elsewhere)."""
    try:
        on_cpu, waiting, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
    except (OSError, ValueError):
        return None
    return int(on_cpu), int(waiting)


def explain_batches(samples, batches: list[float], ends: list[float], purge_pid: int,
                    started: float, longest: int = 6) -> list[tuple[str, str]]:
    """For the `longest` batches: when each began (seconds into the purge), the WAL written
    during it, the CPU time of the purge's backend and process (run / waited for a CPU), and
    what was sampled meanwhile (the purge's wait events; the other processes')."""
    rows = []
    for index in sorted(range(len(batches)), key=batches.__getitem__)[-longest:][::-1]:
        end = ends[index]
        begin = end - batches[index]
        inside = [s for s in samples if begin <= s[0] <= end]
        wal = (inside[-1][1] - inside[0][1]) if len(inside) > 1 else 0
        own, others = Counter(), Counter()
        for _, _, active, _ in inside:
            for pid, kind, wait_type, wait, query in active:
                if int(pid) == purge_pid:
                    own[f"{wait_type}:{wait}"] += 1
                else:
                    what = query.split("(")[0] if kind == "autovacuum worker" else kind
                    others[f"{what} {wait_type}:{wait}"] += 1
        rows.append((
            f"batch {index + 1}, {ms(batches[index])}",
            f"at {begin - started:.1f} s, {wal / 1e6:.1f} MB WAL, {len(inside)} samples; "
            f"{_cpu_spent(inside)}purge {_top(own)}; others {_top(others)}",
        ))
    return rows


def _cpu_spent(inside) -> str:
    if len(inside) < 2 or None in inside[0][3] + inside[-1][3]:
        return ""
    (backend_first, process_first), (backend_last, process_last) = inside[0][3], inside[-1][3]
    return "".join(
        f"{name} ran {(last[0] - first[0]) / 1e6:.0f} ms, waited for a CPU "
        f"{(last[1] - first[1]) / 1e6:.0f} ms; "
        for name, first, last in (("backend", backend_first, backend_last),
                                  ("process", process_first, process_last)))


def _top(counts: Counter, n: int = 4) -> str:
    return ", ".join(f"{what} x{count}" for what, count in counts.most_common(n)) or "-"


def main() -> dict:
    args = parse_args(__doc__.splitlines()[0], waits={
        "action": "store_true",
        "help": "sample the server's wait events during the purge and explain the longest batches"})
    setup_django()
    from django.db import connections

    from ledger import receipts, retention
    from ledger.models import Operation

    n = SCALES[args.scale]
    pause_ms = retention.POLITE_PAUSE.total_seconds() * 1000
    target_ms = retention.BATCH_TARGET.total_seconds() * 1000
    tag = uuid.uuid4().hex[:6]
    reset()
    print(f"seeding {n:,} resolved operations", flush=True)
    seed(tag, 1, n, unresolved=0, days_ago=400)
    quiet_server()  # the bulk load's checkpoint is not part of the purge

    intent = {"to": "customer@example.com", "subject": "Receipt", "body": "x" * 300}
    counter = iter(range(10**9))

    def agent(watch: Stopwatch, keep_going) -> None:
        try:
            while keep_going():
                watch.time(lambda: receipts.record_intent(
                    "email.send", "smtp://mail.example", intent,
                    idempotency_key=f"p5-{tag}-{next(counter)}"))
        finally:
            connections.close_all()

    # Baseline: the agent alone, for as many calls as it makes during the purge below.
    baseline = Stopwatch("alone")
    warm = Stopwatch("warm-up")
    agent(warm, lambda: len(warm.samples) < 50)

    # The purge runs in a process of its own, as `manage.py purge` does beside the agents
    # (a thread here would share the agent's interpreter lock, which production never does).
    context = multiprocessing.get_context("spawn")
    ready, results, start = context.Queue(), context.Queue(), context.Event()
    purger = context.Process(target=purge_process, args=(ready, start, results))
    purger.start()
    purge_pid = ready.get(timeout=120)
    if args.waits:
        sampled, stop_sampling = context.Queue(), context.Event()
        sampler = context.Process(target=wait_sampler, args=(
            ready, stop_sampling, sampled, (purge_pid, purger.pid)))
        sampler.start()
        ready.get(timeout=120)
    during = Stopwatch("during purge")
    started, started_at = time.perf_counter(), time.monotonic()
    start.set()
    agent(during, lambda: purger.is_alive() and results.empty())
    try:  # before join: a process that put a large result exits once it has been read
        steps, batches = Stopwatch("sealing + batch"), Stopwatch("batch")
        steps.samples, batches.samples, batch_ends, sizes = results.get(timeout=60)
    except queue.Empty:
        purger.join(timeout=10)
        raise SystemExit(f"expected the purge process to report its batches, found none "
                         f"(exit code {purger.exitcode}; its traceback is above)") from None
    purger.join()
    purge_seconds = time.perf_counter() - started
    if args.waits:
        stop_sampling.set()
        samples = sampled.get(timeout=120)
        sampler.join()
        print_table(f"P5 the longest batches and what was sampled meanwhile "
                    f"({len(samples)} samples)",
                    explain_batches(samples, batches.samples, batch_ends, purge_pid, started_at))
    left = Operation.objects.filter(operation_id__startswith=f"p2-{tag}-").count()
    if left:
        raise SystemExit(f"expected every seeded operation purged, found {left} left")

    calls = max(len(during.samples), 200)
    agent(baseline, lambda: len(baseline.samples) < calls)

    p99_ratio = during.percentile(0.99) / baseline.percentile(0.99)
    print_table(f"P5 purge of {n:,} resolved operations (batches of {retention.DEFAULT_BATCH}, "
                f"{pause_ms:.0f} ms apart)", [
        ("purge", f"{len(batches.samples)} batches in {purge_seconds:.1f} s: "
                  f"{len(batches.samples) / purge_seconds:.1f} batches/s"),
        ("longest batch", ms(max(batches.samples))),
        ("batch sizes", f"{min(sizes)}-{max(sizes)}: {sum(s < max(sizes) for s in sizes)} batches "
                        f"made smaller after one over {target_ms:.0f} ms"),
        ("median batch", ms(batches.median)),
        ("p99 batch", ms(batches.percentile(0.99))),
        ("sealing + batch, longest", f"{ms(max(steps.samples))} (median "
                                     f"{ms(steps.median)}, p99 {ms(steps.percentile(0.99))})"),
        ("record_intent alone", f"p50 {ms(baseline.median)}, p99 "
                                f"{ms(baseline.percentile(0.99))} ({len(baseline.samples)} calls)"),
        ("record_intent during purge", f"p50 {ms(during.median)}, p99 "
                                       f"{ms(during.percentile(0.99))} "
                                       f"({len(during.samples)} calls)"),
        ("ratio p99 during / alone", f"{p99_ratio:.2f}x"),
    ])
    summary = {
        "scale": args.scale, "operations": n, "batch": retention.DEFAULT_BATCH, "ratio": p99_ratio,
        "pause_ms": pause_ms,
        "batches_per_s": len(batches.samples) / purge_seconds,
        "longest_batch_ms": max(batches.samples) * 1000,
        "batch_target_ms": target_ms, "smallest_batch": min(sizes),
        "smaller_batches": sum(s < max(sizes) for s in sizes),
        "p99_batch_ms": batches.percentile(0.99) * 1000,
        "longest_step_ms": max(steps.samples) * 1000,
        "p50_ratio": during.median / baseline.median,
        "baseline_p99_ms": baseline.percentile(0.99) * 1000,
        "during_p99_ms": during.percentile(0.99) * 1000,
    }
    record("P5", summary)
    return summary


if __name__ == "__main__":
    main()
