"""The sealer's loop: link committed operation events, fact decisions and record links
into their chains, continuously.

`ledger.chain.seal` does one sweep; `run` repeats it every `interval` seconds until `stop`
is set, so that the chain trails the writers by about that much (the audit page, /healthz
and /metrics show by how much). `manage.py seal` runs it on its own; `manage.py reconcile`
runs it in a thread beside its workers unless told not to. Several sealers may run: each
chain of a tenant is sealed by one at a time (`chain._lock_tenant`, the one place its lock
is taken).
Each tenant is sealed in isolation: a tenant whose batch fails is logged and tried again on
the next sweep, and the other tenants are sealed meanwhile (`chain.seal`); a sweep that
fails as a whole (the database gone) is logged and tried again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.db import connections

from ledger import chain

logger = logging.getLogger("ledger.sealer")

# Seconds between sweeps: the delay the chain trails the writers by, at most about this
# plus one sweep (the "maximum merge delay" of the audit trail).
DEFAULT_INTERVAL = 0.5


def run(
    stop: threading.Event,
    *,
    interval: float = DEFAULT_INTERVAL,
    limit: int = chain.SEAL_BATCH,
    once: bool = False,
    on_sealed: Callable[[int], None] | None = None,
) -> int:
    """Sweep until `stop` is set (one sweep with `once`); the events sealed in all."""
    total = 0
    try:
        while not stop.is_set():
            try:
                sealed = chain.seal(limit=limit)
            except Exception:  # keep sealing: the next sweep retries the batch
                logger.exception("sealing failed; retrying in %.1f s", interval)
                connections["default"].close_if_unusable_or_obsolete()
                if once:
                    raise
                stop.wait(interval)
                continue
            total += sealed
            if sealed and on_sealed is not None:
                on_sealed(sealed)
            if once:
                break
            stop.wait(interval)
    finally:
        connections.close_all()
    return total


def start_thread(stop: threading.Event, **options) -> threading.Thread:
    """`run` in a daemon thread named "sealer" (its own database connection)."""
    thread = threading.Thread(target=run, args=(stop,), kwargs=options, name="sealer",
                              daemon=True)
    thread.start()
    return thread
