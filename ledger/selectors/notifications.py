"""Reads of the desk's Notifications page (admins): channels, their audited changes, and
the delivery log, each limited to the tenants the user may see."""

from __future__ import annotations

from ledger import access
from ledger.models import DeliveryAttempt, NotificationChannel, NotificationChannelChange
from ledger.selectors.base import fetch_one, visible
from ledger.selectors.pagination import Page, keyset_page


def notification_channels(user) -> dict:
    """The channels of the user's tenants and their latest changes."""
    access.require_perm(user, "ledger.view_notificationchannel",
                        doing="see notification channels")
    return {
        "channels": list(visible(user, NotificationChannel).select_related("updated_by")),
        "changes": list(visible(user, NotificationChannelChange)
                        .select_related("channel")[:50]),
    }


def access_channel(user, pk: int) -> NotificationChannel:
    access.require_perm(user, "ledger.view_notificationchannel",
                        doing="see notification channels")
    return fetch_one(visible(user, NotificationChannel), f"notification channel #{pk}", pk=pk)


def delivery_page(user, *, cursor: str = "", before: str = "", per_page: int = 50) -> Page:
    """Delivery attempts, newest first, keyset-paged: one query for the page."""
    access.require_perm(user, "ledger.view_deliveryattempt", doing="see notification deliveries")
    qs = (visible(user, DeliveryAttempt).select_related("channel", "batch")
          .order_by("-started_at", "-id"))
    return Page(**keyset_page(qs, "started_at", cursor=cursor, before=before,
                              per_page=per_page, descending=True))
