"""`manage.py reconcile`: the reconciliation loop (one line per verdict)."""

import logging
import os
import signal
import threading

from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from ledger import reconcile, sealer

logger = logging.getLogger("ledger.reconcile")


class Command(BaseCommand):
    help = (
        "Reconcile outcome_unknown operations by reading the external systems, and turn "
        "stale submissions of dead senders into outcome_unknown, while a sealer thread links "
        "committed events into the audit chain (--no-seal: not here). Stops cleanly on SIGTERM."
    )

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true",
                            help="one pass per worker, then exit")
        parser.add_argument("--workers", type=int, default=1, help="worker threads (default 1)")
        parser.add_argument("--limit", type=int, default=100,
                            help="operations per pass and worker (default 100)")
        parser.add_argument("--interval", type=float, default=5.0,
                            help="seconds to wait when nothing is due (default 5)")
        parser.add_argument("--worker-name", default="",
                            help="prefix of the worker names (default reconcile-<pid>)")
        parser.add_argument("--no-seal", action="store_true",
                            help="do not run the audit trail's sealer thread beside the "
                                 "workers (run `manage.py seal` elsewhere)")

    def handle(self, *args, once, workers, limit, interval, worker_name, no_seal,
               **options):
        if workers < 1 or limit < 1 or interval < 0:
            raise CommandError(
                f"expected --workers >= 1, --limit >= 1 and --interval >= 0, found "
                f"{workers}, {limit} and {interval}"
            )
        prefix = worker_name or f"reconcile-{os.getpid()}"
        stop = threading.Event()
        print_lock = threading.Lock()
        totals = {"finished": 0}
        crashed: list[str] = []

        def report(op, outcome):
            with print_lock:
                self.stdout.write(
                    f"{op.operation_id} {op.operation} {outcome.verdict} -> {op.state}: "
                    f"{outcome.detail}"
                )

        def work(name):
            try:
                while not stop.is_set():
                    try:
                        finished = reconcile.run_once(worker=name, limit=limit,
                                                      on_verdict=report)
                    except Exception:  # keep the loop alive; the next pass retries
                        logger.exception("reconcile pass of %s failed", name)
                        # a connection the server dropped (a failover) is not reused
                        connections["default"].close_if_unusable_or_obsolete()
                        if once:
                            with print_lock:
                                crashed.append(name)
                            return
                        stop.wait(interval)
                        continue
                    with print_lock:
                        totals["finished"] += finished
                    if once:
                        return
                    if finished == 0:
                        stop.wait(interval)
            finally:
                connections.close_all()

        previous = {sig: signal.signal(sig, lambda *_: stop.set())
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        names = [f"{prefix}-{i}" for i in range(1, workers + 1)]
        self.stdout.write(f"reconcile: started {', '.join(names)}"
                          + (" (one pass)" if once else ""))
        threads = [threading.Thread(target=work, args=(name,), name=name) for name in names]
        # The sealer links the events these workers (and every agent) commit into the chain.
        seal_stop = threading.Event()
        sealing = None if no_seal or once else sealer.start_thread(seal_stop)
        try:
            for thread in threads:
                thread.start()
            while any(t.is_alive() for t in threads):
                for thread in threads:
                    thread.join(timeout=0.2)
        finally:
            seal_stop.set()
            if sealing is not None:
                sealing.join(timeout=10)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if once and not no_seal:
            try:
                sealer.run(threading.Event(), once=True)  # the pass's events, sealed
            except Exception as exc:
                raise CommandError(f"expected the pass's events sealed into the audit chain, "
                                   f"found the sealer failing: {exc}") from exc
        self.stdout.write(
            f"reconcile: stopped; finished {totals['finished']} operation(s)"
        )
        if crashed:
            # A one-shot run is a job whose caller must learn that the pass did not finish.
            raise CommandError(
                f"expected every worker's pass to finish, found {', '.join(sorted(crashed))} "
                "crashed (see the log above)"
            )

