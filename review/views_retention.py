"""The retention page (admins): policies with what the next purge would do, their audited
changes, the recent purge runs and how much the ledger holds.

Thin like the rest of the desk: every write is one `ledger.retention` call, which checks the
permission again, validates, and audits; its `InvalidInput` is shown as it is and nothing is
written.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.shortcuts import redirect
from django.views.decorators.http import require_GET, require_POST

from ledger import errors, retention, retention_state, selectors
from review.forms import form_errors, labelled
from review.forms_retention import (
    NewPolicyForm,
    NewStatePolicyForm,
    PolicyDaysForm,
    StatePolicyDaysForm,
)
from review.http import ledger_errors
from review.templatetags.desk_retention import policy_days
from review.views import _render

# What migration 0004_retention grants the admin group (and no other role).
view_required = permission_required("ledger.view_retentionpolicy", raise_exception=True)
change_required = permission_required("ledger.change_retentionpolicy", raise_exception=True)
delete_required = permission_required("ledger.delete_retentionpolicy", raise_exception=True)


@require_GET
@view_required
@ledger_errors
def retention_page(request):
    return _page(request)


def _page(request, *, new_form: NewPolicyForm | None = None,
          edit_form: PolicyDaysForm | None = None, edit_pk: int | None = None,
          new_state_form: NewStatePolicyForm | None = None,
          edit_state_form: StatePolicyDaysForm | None = None, edit_state_pk: int | None = None,
          status: int = 200):
    """The page (or its fragment) from fresh database state; a bound form that failed is
    shown again with what the admin typed."""
    overview = selectors.retention_overview(request.user)
    rows = [
        (preview, edit_form if preview.policy.pk == edit_pk and edit_form is not None
         else PolicyDaysForm.for_policy(preview.policy))
        for preview in overview["previews"]
    ]
    state_rows = [
        (policy, count, edit_state_form if policy.pk == edit_state_pk
         and edit_state_form is not None else StatePolicyDaysForm.for_policy(policy))
        for policy, count in overview["state_previews"]
    ]
    context = {
        **overview,
        "rows": rows,
        "state_rows": state_rows,
        "new_form": new_form or NewPolicyForm(),
        "new_state_form": new_state_form or NewStatePolicyForm(),
        "total_rows": sum(t.rows for t in overview["tables"]),
        "total_bytes": sum(t.total_bytes for t in overview["tables"]),
    }
    return _render(request, "review/retention.html", "retention", context, status=status)


@require_POST
@change_required
@ledger_errors
def add_policy(request):
    form = NewPolicyForm(request.POST)
    return _set(request, form, pattern=None, tenant=None, edit_pk=None)


@require_POST
@change_required
@ledger_errors
def edit_policy(request, pk: int):
    try:
        policy = selectors.access_policy(request.user, pk)
    except errors.NotFound:
        return _gone(request, pk)
    form = PolicyDaysForm.for_policy(policy, request.POST)
    return _set(request, form, pattern=policy.pattern, tenant=policy.tenant, edit_pk=pk)


def _set(request, form, *, pattern: str | None, tenant: str | None, edit_pk: int | None):
    """Call `retention.set_policy` with the form's values; show the form again on error."""
    failed = {"new_form": form} if edit_pk is None else {"edit_form": form, "edit_pk": edit_pk}
    if not form.is_valid():
        messages.error(request, "Nothing written: " + form_errors(form))
        return _page(request, status=422, **failed)
    values = form.policy_values()
    if pattern is not None:
        values.update(pattern=pattern, tenant=tenant)
    try:
        policy = retention.set_policy(values.pop("pattern"), tenant=values.pop("tenant"),
                                      user=request.user, **values)
    except errors.InvalidInput as exc:
        messages.error(request, f"Nothing written: {labelled(exc, form)}")
        return _page(request, status=422, **failed)
    messages.success(request, f"Policy {policy}: {policy_days(policy.as_audit_dict())}.")
    return _done(request)


@require_POST
@delete_required
@ledger_errors
def delete_policy(request, pk: int):
    return _delete(request, pk, selectors.access_policy, retention.delete_policy)


@require_POST
@change_required
@ledger_errors
def add_state_policy(request):
    return _set_state(request, NewStatePolicyForm(request.POST), policy=None)


@require_POST
@change_required
@ledger_errors
def edit_state_policy(request, pk: int):
    try:
        policy = selectors.access_state_policy(request.user, pk)
    except errors.NotFound:
        return _gone(request, pk)
    return _set_state(request, StatePolicyDaysForm.for_policy(policy, request.POST),
                      policy=policy)


def _set_state(request, form, *, policy):
    """Call `retention_state.set_state_policy` with the form's values; show the form again
    on error."""
    failed = ({"new_state_form": form} if policy is None
              else {"edit_state_form": form, "edit_state_pk": policy.pk})
    if not form.is_valid():
        messages.error(request, "Nothing written: " + form_errors(form))
        return _page(request, status=422, **failed)
    values = form.policy_values()
    if policy is not None:
        values.update(kind=policy.kind, tenant=policy.tenant)
    try:
        saved = retention_state.set_state_policy(values.pop("kind"), tenant=values.pop("tenant"),
                                                 user=request.user, **values)
    except errors.InvalidInput as exc:
        messages.error(request, f"Nothing written: {labelled(exc, form)}")
        return _page(request, status=422, **failed)
    messages.success(request, f"Policy {saved}: purge after {saved.purge_after_days} d.")
    return _done(request)


@require_POST
@delete_required
@ledger_errors
def delete_state_policy(request, pk: int):
    return _delete(request, pk, selectors.access_state_policy,
                   retention_state.delete_state_policy)


def _delete(request, pk: int, access, delete):
    """Find policy `pk` with `access(user, pk)` and `delete(policy, user=)` it (audited);
    an error leaves it and says why."""
    try:
        policy = access(request.user, pk)
    except errors.NotFound:
        return _gone(request, pk)
    try:
        delete(policy, user=request.user)
    except errors.InvalidInput as exc:
        messages.error(request, f"Nothing deleted: {exc}")
        return _page(request, status=422) if request.htmx else redirect("review:retention")
    messages.success(request, f"Deleted policy {policy}.")
    return _done(request)


def _gone(request, pk: int):
    messages.error(request, f"Nothing written: expected retention policy #{pk}, found none "
                            "(someone may have deleted it); the page now shows the current "
                            "policies.")
    return _page(request, status=422) if request.htmx else redirect("review:retention")


def _done(request):
    """POST/redirect/GET, or the fresh fragment for htmx."""
    if request.htmx:
        return _page(request)
    return redirect("review:retention")

