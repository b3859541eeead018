"""The desk's execution-state pages: fact conflicts, one fact, overdue obligations, one run.

Thin, like `review.views`: objects are fetched through `ledger.selectors.access_*` (another
tenant's conflict, fact or run is a 404, by `review.http.ledger_errors`), and every decision
goes through `ledger.facts.resolve_conflict` or `ledger.facts.correct_fact`, which check the
permission and the tenant again.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.shortcuts import redirect
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from ledger import coverage as ledger_coverage
from ledger import errors, facts, selectors
from ledger.canonical import scrub_text
from ledger.models import FactConflict
from review.forms_execution import (
    SIDES,
    ConflictDecisionForm,
    ExecutionListForm,
    FactCorrectionForm,
)
from review.http import ledger_errors
from review.views import _render

view_conflicts_required = permission_required("ledger.view_factconflict", raise_exception=True)
view_obligations_required = permission_required("ledger.view_obligation", raise_exception=True)
view_runs_required = permission_required("ledger.view_run", raise_exception=True)
resolve_conflict_required = permission_required(
    "ledger.resolve_factconflict", raise_exception=True
)


def _list_context(request, form: ExecutionListForm, page) -> dict:
    return {
        "form": form,
        "page": page,
        "exec_counts": selectors.execution_counts(request.user, tenant=form.tenant_filter()),
    }


@require_GET
@view_conflicts_required
@ledger_errors
def conflicts(request):
    form = ExecutionListForm(request.GET)
    page = selectors.conflict_page(request.user, tenant=form.tenant_filter(),
                                   **form.page_args())
    return _render(request, "review/conflicts.html", "results",
                   _list_context(request, form, page))


@require_GET
@view_obligations_required
@ledger_errors
def overdue(request):
    form = ExecutionListForm(request.GET)
    page = selectors.overdue_page(request.user, tenant=form.tenant_filter(),
                                  **form.page_args())
    return _render(request, "review/overdue.html", "results",
                   _list_context(request, form, page))


@require_GET
@permission_required("ledger.view_operation", raise_exception=True)
@ledger_errors
def coverage(request):
    """The latest coverage readings: effects at a target no receipt explains, each with
    the reading that found them (`manage.py coverage` writes them)."""
    target = (request.GET.get("target") or "").strip()[:2000]
    context = {"readings": ledger_coverage.readings(request.user, target=target),
               "target": target}
    return _render(request, "review/coverage.html", "results", context)


@require_GET
@view_conflicts_required
@ledger_errors
def conflict_detail(request, conflict_id: int):
    return _conflict(request, conflict_id)


def _conflict(request, conflict_id: int, *, form: ConflictDecisionForm | None = None,
              status: int = 200):
    detail = selectors.conflict_detail(request.user, conflict_id)
    if form is None and detail.live is not None:
        form = ConflictDecisionForm(initial={"expected_version": detail.live.version})
    context = {"detail": detail, "conflict": detail.conflict, "form": form}
    return _render(request, "review/conflict.html", "decision", context, status=status)


@require_POST
@resolve_conflict_required
@ledger_errors
def resolve_conflict(request, conflict_id: int):
    """"Use this value": POST/redirect/GET, or the fresh decision fragment for htmx."""
    conflict = selectors.access_conflict(request.user, conflict_id)
    form = ConflictDecisionForm(request.POST)
    if not form.is_valid():
        return _conflict(request, conflict_id, form=form, status=422)
    side = form.cleaned_data["winner"]
    try:
        written = facts.resolve_conflict(
            conflict, winner=side, user=request.user, reason=form.cleaned_data["reason"],
            expected_version=form.cleaned_data["expected_version"],
        )
    except errors.StaleVersion as exc:
        messages.warning(request, decided_first_message(exc))
    except errors.StaleFact as exc:
        messages.warning(request, moved_on_message(exc))
    except errors.InvalidInput as exc:
        messages.error(request, f"Nothing recorded: {exc}")
    else:
        messages.success(
            request, f"Recorded: used {SIDES[side]} for {conflict.subject} "
            f"{conflict.predicate}; it is now version {written.version}."
        )
    if request.htmx:
        return _conflict(request, conflict_id)
    return redirect(reverse("review:conflict", args=[conflict_id]))


@require_GET
@view_conflicts_required
@ledger_errors
def fact_detail(request, fact_id: int):
    return _fact(request, fact_id)


def _fact(request, fact_id: int, *, form: FactCorrectionForm | None = None,
          status: int = 200):
    detail = selectors.fact_detail(request.user, fact_id)
    if form is None and detail.can_correct:
        current = detail.current
        form = FactCorrectionForm(initial={"version": current.version,
                                           "value": current.value})
    context = {"detail": detail, "fact": detail.fact, "form": form}
    return _render(request, "review/fact.html", "correction", context, status=status)


@require_POST
@resolve_conflict_required
@ledger_errors
def correct_fact(request, fact_id: int):
    """"Correct this fact": a new version written as the person, with the reason;
    POST/redirect/GET, or the fresh correction fragment for htmx."""
    fact = selectors.access_fact(request.user, fact_id)
    form = FactCorrectionForm(request.POST)
    if not form.is_valid():
        return _fact(request, fact_id, form=form, status=422)
    data = form.cleaned_data
    try:
        written = facts.correct_fact(fact, version=data["version"], value=data["value"],
                                     user=request.user, reason=data["reason"],
                                     expires_at=data["expires_at"])
    except errors.StaleFact as exc:
        messages.warning(request, moved_on_message(exc))
    except errors.InvalidInput as exc:
        messages.error(request, f"Nothing recorded: {exc}")
    else:
        messages.success(
            request, f"Recorded: {fact.subject} {fact.predicate} corrected by "
            f"{request.user.get_username()}; it is now version {written.version}."
        )
        fact_id = written.pk
    if request.htmx:
        return _fact(request, fact_id)
    return redirect(reverse("review:fact", args=[fact_id]))


def decided_first_message(exc: errors.StaleVersion) -> str:
    """Who decided the conflict first, when, and which value they kept."""
    locked = exc.current
    if not isinstance(locked, FactConflict) or locked.resolved_at is None:
        return f"Nothing recorded: {exc}"
    who = locked.resolved_by.get_username() if locked.resolved_by else "someone"
    side = "current" if locked.chosen_id == locked.current_id else "candidate"
    return (
        f"Nothing recorded: {who} already decided this conflict at "
        f"{locked.resolved_at:%Y-%m-%d %H:%M:%S} UTC and used {SIDES[side]}"
        + (f" (reason: {locked.resolution_reason})" if locked.resolution_reason else "")
        + "."
    )


def moved_on_message(exc: errors.StaleFact) -> str:
    """The fact changed after the page was rendered: what it is now, decide again."""
    current = exc.current
    if current is None:
        return f"Nothing recorded: {exc}"
    return (
        f"Nothing recorded: {current.subject} {current.predicate} moved on since you loaded "
        f"the page; it is now version {current.version} = "
        f"{scrub_text(repr(current.value))[:200]} from {current.source}, observed "
        f"{current.observed_at:%Y-%m-%d %H:%M:%S} UTC. Decide again against the current value."
    )


@require_GET
@view_runs_required
@ledger_errors
def run_detail(request, run_id: str):
    # Run ids are unique per tenant: the desk's links name the run's tenant (?tenant=).
    tenant = request.GET.get("tenant") or None
    detail = selectors.run_detail(request.user, run_id, tenant=tenant)
    return _render(request, "review/run.html", "records", {"detail": detail,
                                                           "run": detail.run})
