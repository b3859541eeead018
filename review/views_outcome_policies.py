"""The unknown-outcome policies page (admins): what an unproven outcome of each kind of
operation may become, the defaults from the setting, and the audited changes.

Thin like the rest of the desk: the write is one `ledger.outcome_policies.set_policy` call,
which checks the permission and the tenant again and records who, why, before and after.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.shortcuts import redirect
from django.views.decorators.http import require_GET, require_POST

from ledger import errors, outcome_policies
from review.forms_outcome_policies import UnknownOutcomePolicyForm
from review.http import ledger_errors
from review.views import _render

view_required = permission_required("ledger.view_unknownoutcomepolicy", raise_exception=True)
change_required = permission_required("ledger.change_unknownoutcomepolicy",
                                      raise_exception=True)


@require_GET
@view_required
@ledger_errors
def policies(request):
    return _policies(request)


def _policies(request, *, form: UnknownOutcomePolicyForm | None = None, status: int = 200):
    context = {**outcome_policies.policies_page(request.user),
               "form": form or UnknownOutcomePolicyForm()}
    return _render(request, "review/outcome_policies.html", "policies", context,
                   status=status)


@require_POST
@change_required
@ledger_errors
def set_policy(request):
    form = UnknownOutcomePolicyForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Nothing written: " + " ".join(
            error for errors_ in form.errors.values() for error in errors_))
        return _policies(request, form=form, status=422)
    values = form.policy_values()
    try:
        policy = outcome_policies.set_policy(values.pop("pattern"), user=request.user,
                                             **values)
    except errors.InvalidInput as exc:
        messages.error(request, f"Nothing written: {exc}")
        return _policies(request, form=form, status=422)
    messages.success(request, f"Unknown-outcome policy {policy} saved.")
    if request.htmx:
        return _policies(request)
    return redirect("review:outcome_policies")
