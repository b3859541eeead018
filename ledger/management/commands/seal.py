"""`manage.py seal`: link committed operation events into their tenants' hash chains."""

import signal
import threading

from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from ledger import chain, sealer


class Command(BaseCommand):
    help = (
        "Link committed operation events into their tenants' hash chains (the audit trail's "
        "sealer), every --interval seconds until SIGTERM; --once for one sweep. "
        "`manage.py reconcile` runs a sealer too unless given --no-seal."
    )

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="one sweep, then exit")
        parser.add_argument("--interval", type=float, default=sealer.DEFAULT_INTERVAL,
                            help=f"seconds between sweeps (default {sealer.DEFAULT_INTERVAL})")
        parser.add_argument("--limit", type=int, default=chain.SEAL_BATCH,
                            help=f"events per transaction (default {chain.SEAL_BATCH})")

    def handle(self, *args, once, interval, limit, **options):
        if limit < 1 or interval <= 0:
            raise CommandError(f"expected --limit >= 1 and --interval > 0, found {limit} "
                               f"and {interval}")
        with connection.cursor() as cursor:  # named in pg_stat_activity
            cursor.execute("SET application_name = 'ledger seal'")
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set())
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        self.stdout.write("seal: started" + (" (one sweep)" if once else ""))
        try:
            total = sealer.run(stop, interval=interval, limit=limit, once=once,
                               on_sealed=lambda n: self.stdout.write(f"sealed {n} event(s)"))
        except Exception as exc:
            raise CommandError(f"expected the sweep to finish, found {exc}") from exc
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.stdout.write(f"seal: stopped; sealed {total} event(s)")
