"""`manage.py notify`: the notification loop (collect what channels were not told, deliver
what is due; one line per delivery attempt)."""

import logging
import os
import signal
import threading

from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from ledger import notifications

logger = logging.getLogger("ledger.notifications")


class Command(BaseCommand):
    help = (
        "Tell the configured notification channels about items waiting for a person (queue, "
        "approval, stuck), one batched message per channel and pass, and deliver them with "
        "retries. Stops cleanly on SIGTERM."
    )

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="one pass, then exit")
        parser.add_argument("--interval", type=float, default=10.0,
                            help="seconds between passes (default 10)")
        parser.add_argument("--worker-name", default="",
                            help="name in the delivery log (default notify-<pid>)")

    def handle(self, *args, once, interval, worker_name, **options):
        if interval < 0:
            raise CommandError(f"expected --interval >= 0, found {interval}")
        worker = worker_name or f"notify-{os.getpid()}"
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set())
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        self.stdout.write(f"notify: started {worker}" + (" (one pass)" if once else ""))
        totals = {"batches": 0, "attempts": 0}
        failed = False
        try:
            while not stop.is_set():
                try:
                    batches = notifications.collect()
                    attempts = notifications.deliver_due(worker=worker)
                except Exception:  # keep the loop alive; the next pass retries
                    logger.exception("notify pass of %s failed", worker)
                    failed = True
                    if once:
                        break
                    for conn in connections.all(initialized_only=True):
                        conn.close_if_unusable_or_obsolete()
                    stop.wait(interval)
                    continue
                totals["batches"] += len(batches)
                totals["attempts"] += len(attempts)
                for attempt in attempts:
                    outcome = "delivered" if attempt.is_ok else f"failed: {attempt.error}"
                    self.stdout.write(
                        f"batch {attempt.batch_id} to {attempt.channel_id} attempt "
                        f"{attempt.attempt} ({attempt.status_code or '-'}, "
                        f"{attempt.duration_ms} ms): {outcome}")
                if once:
                    break
                stop.wait(interval)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.stdout.write(f"notify: stopped; {totals['batches']} batch(es), "
                          f"{totals['attempts']} delivery attempt(s)")
        if failed and once:
            raise CommandError("expected the pass to finish, found it crashed (see the log "
                               "above)")
