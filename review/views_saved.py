"""Saved views of the queue (`ledger.saved_views`): a named filter set, one person's, shared
with everyone who may see its tenant. The queue loads the menu (`saved_views` below, its
`menu` fragment) after the page, so the queue itself runs no query more; every URL also
works whole, without script."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.shortcuts import redirect
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from ledger import access, errors, saved_views, selectors
from review.http import ledger_errors
from review.views import _render, view_context

view_required = permission_required("ledger.view_operation", raise_exception=True)


class SavedViewForm(forms.Form):
    name = forms.CharField(max_length=saved_views.NAME_MAX_LENGTH, strip=True, label="Name",
                           widget=forms.TextInput(attrs={"placeholder": "payments stuck > 1 h"}),
                           error_messages={"required": "Name: give the view a name."})
    # Not "tenant": that name is the queue's tenant filter, which the form carries too.
    shared_in = forms.CharField(max_length=100, strip=True, label="Shared in tenant",
                             error_messages={"required": "Shared in tenant: name a tenant."})


def _tenants(user, filter_tenant: str) -> tuple[list[str], str]:
    """The tenants `user` may share a view in, and the one offered first: the filter's
    own, else the only or first one (a superuser's list is empty: any tenant)."""
    tenants = access.tenants_for(user)
    known = sorted(tenants) if tenants is not None else []
    first = filter_tenant or (known[0] if known else "default")
    return known, first


@require_GET
@view_required
@ledger_errors
def saved_views_page(request):
    """The saved views of the user's tenants (links to the queue with their filters), and
    a form saving the current filter (carried in the query) under a name. Two queries
    besides the session's: the views, and the user's tenants."""
    view = view_context(request.GET)
    known, first = _tenants(request.user, request.GET.get("tenant", ""))
    context = {
        "views": list(selectors.saved_views_for(request.user)),
        "form": SavedViewForm(initial={"shared_in": first}),
        "tenants": known,
        **view,
    }
    return _render(request, "review/saved_views.html", "menu", context)


@require_POST
@view_required
@ledger_errors
def save_view(request):
    """Save the filter carried in the form under its name; back to the queue showing it."""
    form = SavedViewForm(request.POST)
    view = view_context(request.POST)
    if not form.is_valid():
        for errs in form.errors.values():
            for error in errs:
                messages.error(request, f"Not saved: {error}")
        return redirect(reverse("review:queue") + view["view_suffix"])
    try:
        saved = saved_views.save(request.user, form.cleaned_data["name"],
                                 tenant=form.cleaned_data["shared_in"],
                                 filters=dict(view["view_params"].items()))
    except errors.InvalidInput as exc:
        messages.error(request, f"Not saved: {exc}")
    else:
        messages.success(request, f"Saved the view “{saved.name}” in tenant {saved.tenant}; "
                                  "everyone who may see that tenant can use it.")
    return redirect(reverse("review:queue") + view["view_suffix"])


@require_POST
@view_required
@ledger_errors
def delete_view(request, view_id: int):
    saved = selectors.access_saved_view(request.user, view_id)
    saved_views.delete(saved, user=request.user)
    messages.info(request, f"Deleted the view “{saved.name}”.")
    return redirect("review:saved_views")
