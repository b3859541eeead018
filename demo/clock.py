"""The demo's history, replayed at moments in the past, so its queue has realistic ages.

Every time the ledger writes for a receipt, an event, a piece of evidence or an approval
request comes from `django.utils.timezone.now` in Python; `backdated` shifts that clock
while the seed writes one chapter of its story, through the same public functions an agent
calls. What the database times itself (leases: `clock_timestamp()`) stays real, and no
trigger compares a row's time with the database's clock. The event chain hashes the times
as written, so a backdated history verifies like any other. Chapters are written oldest
first, so every chain's times only move forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta

from django.utils import timezone


@contextmanager
def backdated(ago: timedelta) -> Iterator[None]:
    """While inside, `timezone.now()` reads `ago` earlier than the real time (and still
    moves). For the demo seed only: never in a web request or a worker."""
    real = timezone.now

    def shifted() -> datetime:
        return real() - ago

    timezone.now = shifted
    try:
        yield
    finally:
        timezone.now = real
