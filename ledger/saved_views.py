"""Saved views of the review queue: a named set of the queue's filters, saved by one
person and shared with everyone who may see its tenant ("payments stuck > 1 h").

Saving needs `ledger.view_operation` and a grant for the view's tenant; saving a name one
already used in that tenant replaces one's own view (two people may each have a view of
the same name). Only the owner deletes a view. Reads: `ledger.selectors.saved_views_for`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from ledger import access
from ledger.errors import InvalidInput, PermissionDenied
from ledger.inputs import check_identifier, check_string, check_user, storable_text
from ledger.models import SavedView

# The queue's filter parameters a view keeps (review.forms.QueueFilterForm's fields);
# paging is never part of a view.
FILTER_NAMES = ("q", "state", "operation", "tenant", "account", "age", "order")
NAME_MAX_LENGTH = 100


def save(user, name: str, *, tenant: str, filters: Mapping[str, str],
         now: datetime | None = None) -> SavedView:
    """Save (or replace one's own) view `name` in `tenant` with `filters`: only the names
    of FILTER_NAMES with a non-empty value are kept. Raises InvalidInput for an empty or
    overlong name or a filter that is not one of FILTER_NAMES, PermissionDenied without
    `ledger.view_operation` or the tenant's grant."""
    check_user(user, "save a view of the queue")
    access.require_perm(user, "ledger.view_operation", doing="save a view of the queue")
    tenant = check_identifier(tenant, "tenant", 100)
    access.require_tenant(user, tenant)
    name = storable_text(name, "name", NAME_MAX_LENGTH).strip()
    if not name:
        raise InvalidInput("expected a name for the view, found an empty one")
    if not isinstance(filters, Mapping):
        raise InvalidInput(f"expected the view's filters as a mapping, found "
                           f"{type(filters).__name__}")
    unknown = sorted(set(filters) - set(FILTER_NAMES))
    if unknown:
        raise InvalidInput(f"expected filters among {', '.join(FILTER_NAMES)}, found "
                           f"{', '.join(map(str, unknown))}")
    kept = {key: check_string(filters[key], key, 500) for key in FILTER_NAMES
            if filters.get(key)}
    now = now or timezone.now()
    with transaction.atomic(durable=True):
        view, _ = SavedView.objects.update_or_create(
            tenant=tenant, owner=user, name=name,
            defaults={"owner_name": user.get_username(), "filters": kept, "updated_at": now},
            create_defaults={"owner_name": user.get_username(), "filters": kept,
                             "created_at": now, "updated_at": now},
        )
    return view


def delete(view: SavedView, *, user) -> None:
    """Delete `view`; only its owner may (PermissionDenied names the owner)."""
    check_user(user, "delete a saved view")
    if view.owner_id != user.pk:
        raise PermissionDenied(
            f"expected the owner of view {view.name!r} ({view.owner_name}) to delete it, "
            f"found {user.get_username()}")
    with transaction.atomic(durable=True):
        SavedView.objects.filter(pk=view.pk, owner=user).delete()
