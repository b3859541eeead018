"""The Notifications page (admins): channels per tenant and operation pattern, their
audited changes, and the delivery log of every attempt.

Thin like the rest of the desk: every write is one `ledger.notifications` call, which checks
the permission and the tenant again, validates and audits; its `InvalidInput` is shown as it
is and nothing is written. Deliveries never happen here: `manage.py notify` sends them.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.shortcuts import redirect
from django.views.decorators.http import require_GET, require_POST

from ledger import errors, notifications
from ledger.selectors.notifications import access_channel, delivery_page, notification_channels
from review.forms import form_errors, labelled
from review.forms_notifications import ChannelForm
from review.http import ledger_errors
from review.views import _render

# What migration 0024_notifications grants the admin group (and no other role).
view_required = permission_required("ledger.view_notificationchannel", raise_exception=True)
add_required = permission_required("ledger.add_notificationchannel", raise_exception=True)
change_required = permission_required("ledger.change_notificationchannel",
                                      raise_exception=True)


@require_GET
@view_required
@ledger_errors
def channels(request):
    return _page(request)


def _page(request, *, form: ChannelForm | None = None, status: int = 200):
    context = {**notification_channels(request.user), "form": form or ChannelForm(),
               "secret_names": notifications.secret_names()}
    return _render(request, "review/notifications.html", "channels", context, status=status)


@require_POST
@add_required
@ledger_errors
def add_channel(request):
    form = ChannelForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Nothing written: " + form_errors(form))
        return _page(request, form=form, status=422)
    values = form.channel_values()
    try:
        channel = notifications.create_channel(values.pop("name"), user=request.user, **values)
    except errors.InvalidInput as exc:
        messages.error(request, f"Nothing written: {labelled(exc, form)}")
        return _page(request, form=form, status=422)
    messages.success(request, f"Channel {channel} created.")
    return _done(request)


@require_POST
@change_required
@ledger_errors
def set_active(request, pk: int):
    channel = access_channel(request.user, pk)
    is_active = request.POST.get("is_active") == "1"
    channel = notifications.set_channel_active(channel, user=request.user, is_active=is_active)
    messages.success(request, f"Channel {channel} {'enabled' if is_active else 'disabled'}.")
    return _done(request)


def _done(request):
    """POST/redirect/GET, or the fresh fragment for htmx."""
    if request.htmx:
        return _page(request)
    return redirect("review:notifications")


@require_GET
@view_required
@ledger_errors
def deliveries(request):
    try:
        page = delivery_page(request.user, cursor=request.GET.get("cursor", ""),
                             before=request.GET.get("before", ""))
    except errors.InvalidInput as exc:
        messages.error(request, str(exc))
        page = delivery_page(request.user)
    return _render(request, "review/notification_deliveries.html", "deliveries",
                   {"page": page})
