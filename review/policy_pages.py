"""A policy page of the desk, built once for each kind of policy: the page lists the
policies, their defaults and their audited changes (what `read(user)` returns, with the
form), and its POST writes one policy through the ledger's one writer for that kind, which
checks the permission and the tenant again and records who, why, before and after.

Approval policies (review/views_approvals.py) and unknown-outcome policies
(review/views_outcome_policies.py) are two such pages: they differ in their form, their
ledger calls, their template and their permissions, and in nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.shortcuts import redirect
from django.views.decorators.http import require_GET, require_POST

from ledger import errors
from review.http import ledger_errors
from review.views import _render


def policy_page(*, form_class: type[forms.Form], read: Callable[[Any], dict[str, Any]],
                write: Callable[..., Any], template: str, noun: str, url_name: str,
                view_permission: str, change_permission: str):
    """(the page's GET view, its POST view). `read(user)`: the page's context; `write(
    pattern, user=, **values)`: the ledger's writer, given the form's `policy_values()`;
    `noun`: what the saved message calls a policy ("Approval policy")."""
    def page(request, *, form: forms.Form | None = None, status: int = 200):
        context = {**read(request.user), "form": form or form_class()}
        return _render(request, template, "policies", context, status=status)

    @require_GET
    @permission_required(view_permission, raise_exception=True)
    @ledger_errors
    def policies(request):
        return page(request)

    @require_POST
    @permission_required(change_permission, raise_exception=True)
    @ledger_errors
    def set_policy(request):
        form = form_class(request.POST)
        if not form.is_valid():
            messages.error(request, "Nothing written: " + " ".join(
                error for errors_ in form.errors.values() for error in errors_))
            return page(request, form=form, status=422)
        values = form.policy_values()
        try:
            policy = write(values.pop("pattern"), user=request.user, **values)
        except errors.InvalidInput as exc:
            messages.error(request, f"Nothing written: {exc}")
            return page(request, form=form, status=422)
        messages.success(request, f"{noun} {policy} saved.")
        if request.htmx:
            return page(request)
        return redirect(url_name)

    return policies, set_policy
