"""The demo's notification channel: a webhook pointed at the catcher the demo serves
(`/demo/webhook-catcher/`, demo/views.py), so a newcomer sees a signed delivery arrive.

The catcher keeps what it received in a small JSON-lines file under `.local/` (the last
`KEEP` deliveries); the demo has no table of its own.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

from django.conf import settings

from ledger import conf, notifications
from ledger.models import NotificationChannel

CHANNEL_NAME = "demo-catcher"
KEEP = 50
_lock = threading.Lock()


def catcher_url() -> str:
    return notifications.desk_link("demo/webhook-catcher/")


def seed_notification_channel(stdout, *, user) -> NotificationChannel | None:
    """The demo's webhook channel (tenant default, every operation, queue, approvals and
    items stuck for an hour) to the catcher this demo serves; None when the demo secret is not
    configured.

    A channel's URL never changes (its deliveries refer to it), so a demo served on another
    port than before (`PORT=8741 make demo`) gets a channel of its own, named after the
    port, and the demo channels to other addresses are disabled: deliveries go where the
    demo now listens. Seeding again on the same address changes nothing."""
    secret_name = settings.DEMO_WEBHOOK_SECRET_NAME
    if secret_name not in conf.WEBHOOK_SECRETS:
        stdout.write(f"No demo notification channel: LEDGER_WEBHOOK_SECRET_{secret_name} is "
                     "not set (the demo sets a default only when DEBUG).")
        return None
    url = catcher_url()
    demo = NotificationChannel.objects.filter(tenant="default", name__startswith=CHANNEL_NAME)
    for elsewhere in demo.filter(is_active=True).exclude(url=url):
        notifications.set_channel_active(elsewhere, user=user, is_active=False)
        stdout.write(f"Notification channel {elsewhere.name} disabled: it delivers to "
                     f"{elsewhere.url}, where this demo no longer listens.")
    channel = demo.filter(url=url).order_by("id").first()
    if channel is None:
        channel = notifications.create_channel(
            _free_name(demo, url), user=user, kind="webhook", tenant="default", pattern="*",
            url=url, secret_name=secret_name, stuck_after=timedelta(hours=1))
    elif not channel.is_active:
        channel = notifications.set_channel_active(channel, user=user, is_active=True)
    stdout.write(f"Notification channel {channel.name}: deliveries to {channel.url} "
                 f"(see {url}), sent by `manage.py notify`.")
    return channel


def _free_name(demo, url: str) -> str:
    """demo-catcher, or demo-catcher-<port> when a channel to another address has the name
    (then -2, -3... after it, should that be taken too)."""
    taken = set(demo.values_list("name", flat=True))
    if CHANNEL_NAME not in taken:
        return CHANNEL_NAME
    base = f"{CHANNEL_NAME}-{urlsplit(url).port or 'default'}"
    return next(name for name in (base, *(f"{base}-{n}" for n in range(2, len(taken) + 2)))
                if name not in taken)


def received_path() -> Path:
    return Path(settings.DEMO_CATCHER_FILE)


def store(record: dict) -> None:
    """Append what the catcher received; keep the last KEEP."""
    path = received_path()
    with _lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = path.read_text().splitlines() if path.exists() else []
        lines = [*lines, json.dumps(record, sort_keys=True)][-KEEP:]
        path.write_text("\n".join(lines) + "\n")


def received() -> list[dict]:
    """What the catcher received, newest first."""
    path = received_path()
    with _lock:
        lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in reversed(lines) if line.strip()]
