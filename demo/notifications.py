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
    items stuck for an hour), created once; None when the demo secret is not configured."""
    secret_name = settings.DEMO_WEBHOOK_SECRET_NAME
    if secret_name not in conf.WEBHOOK_SECRETS:
        stdout.write(f"No demo notification channel: LEDGER_WEBHOOK_SECRET_{secret_name} is "
                     "not set (the demo sets a default only when DEBUG).")
        return None
    existing = NotificationChannel.objects.filter(tenant="default", name=CHANNEL_NAME).first()
    if existing is None:
        existing = notifications.create_channel(
            CHANNEL_NAME, user=user, kind="webhook", tenant="default", pattern="*",
            url=catcher_url(), secret_name=secret_name, stuck_after=timedelta(hours=1))
    stdout.write(f"Notification channel {CHANNEL_NAME}: deliveries to {existing.url} "
                 f"(see {catcher_url()}), sent by `manage.py notify`.")
    return existing


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
