"""The approval desk: the "Awaiting approval" list, the decision on one operation (approve,
deny, approve an edited intent) and the approval policies (admins).

Thin like the rest of the desk: every write is one `ledger.approvals` call, which checks
the permission and the tenant again. A decision on a version that moved on, or a second
approval by the same person, is a 409 that says so; nothing is written.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.shortcuts import redirect
from django.views.decorators.http import require_GET, require_POST

from ledger import approvals, errors, selectors
from review.forms_approvals import (
    DECISION_LABELS,
    DENY,
    ApprovalDecisionForm,
    ApprovalPolicyForm,
)
from review.forms_execution import ExecutionListForm
from review.http import ledger_errors
from review.policy_pages import policy_page
from review.templatetags.desk import operation_url
from review.views import _detail, _render, stale_message, view_required

resolve_required = permission_required("ledger.resolve_operation", raise_exception=True)


@require_GET
@view_required
@ledger_errors
def awaiting(request):
    form = ExecutionListForm(request.GET)
    tenant = form.tenant_filter()
    context = {
        "form": form,
        "page": selectors.awaiting_page(request.user, tenant=tenant, **form.page_args()),
    }
    return _render(request, "review/awaiting.html", "results", context)


@require_POST
@resolve_required
@ledger_errors
def decide(request, operation_id: str):
    """One approval decision; POST/redirect/GET, or the fresh decision fragment for htmx."""
    op = selectors.access_operation(request.user, operation_id)
    form = ApprovalDecisionForm(request.POST)
    if not form.is_valid():
        return _detail(request, operation_id, approval_form=form, status=422)
    data = form.cleaned_data
    action, version = data["action"], data["version"]
    try:
        if action == DENY:
            approvals.deny(op, user=request.user, reason=data["reason"],
                           expected_version=version)
        else:
            approvals.approve(op, user=request.user, reason=data["reason"],
                              intent=data["intent"], expected_version=version)
    except errors.StaleVersion as exc:  # the reason (and an edited intent) stay typed
        messages.warning(request, stale_message(exc))
        return _detail(request, operation_id, approval_form=form, status=409)
    except (errors.SecondPersonRequired, errors.IllegalTransition) as exc:
        messages.warning(request, f"Nothing recorded: {exc}")
        return _detail(request, operation_id, approval_form=form, status=409)
    except errors.InvalidInput as exc:
        messages.error(request, f"Nothing recorded: {exc}")
        return _detail(request, operation_id, approval_form=form, status=422)
    messages.success(request, f"Recorded: {DECISION_LABELS[action]} on {op.operation_id}.")
    if request.htmx:
        return _detail(request, operation_id)
    return redirect(operation_url(op))


# The approval policies page (admins): review/policy_pages.py.
policies, set_policy = policy_page(
    form_class=ApprovalPolicyForm, read=selectors.approval_policies,
    write=approvals.set_policy, template="review/approval_policies.html",
    noun="Approval policy", url_name="review:approval_policies",
    view_permission="ledger.view_approvalpolicy",
    change_permission="ledger.change_approvalpolicy",
)
