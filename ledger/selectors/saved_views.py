"""Reads of saved views of the queue (`ledger.saved_views` writes them)."""

from __future__ import annotations

from django.db.models import QuerySet

from ledger.models import SavedView
from ledger.selectors.base import fetch_one, visible


def saved_views_for(user) -> QuerySet[SavedView]:
    """The views `user` may use: every view of the tenants `user` may see (theirs and
    their colleagues'), by name then owner. Read it once: one query."""
    return visible(user, SavedView).order_by("name", "owner_name", "tenant", "id")


def access_saved_view(user, view_id: int) -> SavedView:
    """The view `view_id` if `user` may see its tenant; errors.NotFound otherwise."""
    return fetch_one(saved_views_for(user), f"saved view {view_id}", pk=view_id)
