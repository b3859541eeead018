"""`manage.py demo_ready`: once the demo's desk answers, say where it is and who to be."""

import signal
import threading
import time
import urllib.error
import urllib.request

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from demo.management.commands.demo_seed import banner


class Command(BaseCommand):
    help = ("Wait until the desk at LEDGER_DESK_URL answers /healthz, print the URL and the "
            "demo logins, then wait for SIGTERM or Ctrl-C (Procfile.demo runs it last, so "
            "that `make demo`'s output ends with where to go).")

    def add_arguments(self, parser):
        parser.add_argument("--timeout", type=float, default=120.0,
                            help="seconds to wait for the desk (default 120)")

    def handle(self, *args, timeout, **options):
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        url = settings.LEDGER_DESK_URL.rstrip("/")
        deadline = time.monotonic() + timeout
        while not stop.is_set():
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=5):
                    break
            except urllib.error.HTTPError:
                break  # it answers (a 503 says what is wrong: /healthz shows it)
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise CommandError(f"expected the desk to answer at {url}/healthz within "
                                       f"{timeout:.0f} s, found {exc}") from None
                stop.wait(0.5)
        if not stop.is_set():
            self.stdout.write(banner(url))
        stop.wait()
