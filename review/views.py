"""The review desk's pages. Thin: parse the form, call one `ledger` function, render.

Every page renders whole, or only its `{% partialdef %}` fragment for an htmx request.
Objects are fetched through `ledger.selectors.access_*` (another tenant's operation is not
found: `review.http.ledger_errors` makes that a 404, and a refused permission a 403) and
every decision goes through `ledger.receipts.resolve`, which checks permissions again.
"""

from __future__ import annotations

import csv
from datetime import datetime

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.http import QueryDict, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from ledger import bulk, errors, receipts, saved_views, selectors, shapes, states
from ledger.states import State
from review.forms import (
    ACTION_LABELS,
    AcknowledgeForm,
    AuditFilterForm,
    BulkDecisionForm,
    QueueFilterForm,
    ResolveForm,
)
from review.forms_approvals import DECISION_LABELS, ApprovalDecisionForm
from review.http import ledger_errors
from review.templatetags.desk import operation_url

view_required = permission_required("ledger.view_operation", raise_exception=True)
resolve_required = permission_required("ledger.resolve_operation", raise_exception=True)
BULK_FILTER_FIELDS = ("q", "state", "operation", "tenant", "age", "order")


def _render(request, template: str, fragment: str, context: dict, *, status: int = 200):
    """The fragment for htmx, the whole page otherwise (history restores get the page)."""
    partial = request.htmx and not request.htmx.history_restore_request
    name = f"{template}#{fragment}" if partial else template
    return render(request, name, context, status=status)


@require_GET
@view_required
@ledger_errors
def queue(request):
    form = QueueFilterForm(request.GET)
    now = timezone.now()
    page = selectors.review_queue(request.user, form.filters(), now=now, **form.page_args())
    context = {"form": form, "page": page, "states": State, "query": request.GET}
    # The live queue (queue_live below) polls with when this page was read and its counts.
    context["live"] = {"since": now.isoformat(), "seen": selectors.queue_signature(page),
                       "seconds": poll_seconds()}
    # The fact-conflict and overdue-obligation tabs (review/views_execution.py).
    context["exec_counts"] = selectors.execution_counts(request.user,
                                                        tenant=form.filters().tenant)
    context["bulk_cap"] = bulk.BULK_CAP
    context["queue_values"] = [*selectors.QUEUE_STATES, selectors.CONFLICTING]
    # The filter, carried by the bulk form for "all operations matching this filter".
    context["bulk_filters"] = [(name, request.GET[name]) for name in BULK_FILTER_FIELDS
                               if request.GET.get(name)]
    context["bulk_actions"] = [(state, ACTION_LABELS[state]) for state in ACTION_LABELS]
    context.update(view_context(request.GET))
    return _render(request, "review/queue.html", "results", context)


def view_context(params) -> dict:
    """The queue filter a page was reached with (`view_params`, a QueryDict of
    saved_views.FILTER_NAMES) and the same as a URL suffix (`view_suffix`, "" or
    "?state=..."): the operation page carries it to "Next item" and back to the queue."""
    view = QueryDict(mutable=True)
    for name in saved_views.FILTER_NAMES:
        if params.get(name):
            view[name] = params[name]
    return {"view_params": view, "view_suffix": f"?{view.urlencode()}" if view else ""}


@require_GET
@view_required
@ledger_errors
def queue_next(request):
    """The next item of the queue under the filter carried in the query (after `after`,
    the one just decided): its page, keeping the filter; the queue itself, with a note,
    when nothing is left."""
    form = QueueFilterForm(request.GET)
    after = request.GET.get("after", "")[:40]
    view = view_context(request.GET)
    next_id = selectors.queue_next(request.user, form.filters(), after=after)
    if next_id is None:
        messages.info(request, "Nothing else waits in this view.")
        return redirect(reverse("review:queue") + view["view_suffix"])
    return redirect(reverse("review:operation", args=[next_id]) + view["view_suffix"])


def poll_seconds() -> float:
    """How often an open queue asks whether it changed (setting REVIEW_QUEUE_POLL_SECONDS,
    10 s by default; the browser tests shorten it)."""
    return getattr(settings, "REVIEW_QUEUE_POLL_SECONDS", 10)


LIVE_PARAMS = ("since", "seen")


@require_GET
@view_required
@ledger_errors
def queue_live(request):
    """What an open queue polls: its counts (the same fragment, refreshed in place) and,
    out of band, a notice when its rows changed since the page was read ("3 new items —
    show"); the browser loads the rows itself only while the reviewer is not working in
    them (review/static/desk/desk.js). Read-only, a fixed number of queries."""
    form = QueueFilterForm(request.GET)
    since = _aware_or_none(request.GET.get("since", ""))
    pulse = selectors.queue_pulse(request.user, form.filters(), since=since)
    query = request.GET.copy()
    for name in LIVE_PARAMS:
        query.pop(name, None)
    changed = pulse.new > 0 or pulse.signature != request.GET.get("seen", "")
    context = {
        "form": form, "page": pulse, "query": query, "changed": changed,
        "show_url": reverse("review:queue") + (f"?{query.urlencode()}" if query else ""),
        "exec_counts": selectors.execution_counts(request.user, tenant=form.filters().tenant),
    }
    return render(request, "review/queue.html#live", context)


def _aware_or_none(text: str) -> datetime | None:
    """An ISO time with its offset, as the queue wrote it; None for anything else (the
    notice then counts no new items, and still compares the counts)."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    return moment if timezone.is_aware(moment) else None


@require_POST
@resolve_required
@ledger_errors
def bulk_resolve(request):
    """One decision on the ticked operations, or on all matching the queue's filter (up
    to bulk.BULK_CAP); each through receipts.resolve with the version the page showed.
    Shows what was decided and what was skipped, and why."""
    form = BulkDecisionForm(request.POST)
    if not form.is_valid():
        return _render(request, "review/bulk_result.html", "result",
                       {"form": form, "result": None}, status=422)
    data = form.cleaned_data
    if data["all_matching"]:
        filters = QueueFilterForm(request.POST).filters()
        items = selectors.queue_selection(request.user, filters, limit=bulk.BULK_CAP)
    else:
        items = data["items"]
    try:
        result = bulk.resolve_many(items, data["to_state"], user=request.user,
                                   reason=data["reason"])
    except errors.InvalidInput as exc:
        form.add_error(None, f"Nothing recorded: {exc}")
        return _render(request, "review/bulk_result.html", "result",
                       {"form": form, "result": None}, status=422)
    context = {"form": form, "result": result, "label": ACTION_LABELS[data["to_state"]]}
    return _render(request, "review/bulk_result.html", "result", context)


@require_GET
@view_required
@ledger_errors
def operation_detail(request, operation_id: str):
    return _detail(request, operation_id)


def _detail(request, operation_id: str, *, form: ResolveForm | None = None,
            ack_form: AcknowledgeForm | None = None, status: int = 200, approval_form=None,
            just_decided: bool = False, refused: dict | None = None):
    detail = selectors.operation_detail(request.user, operation_id)
    op = detail.operation
    if refused is not None:
        # A refused decision comes back as typed (reason, external id, the chosen
        # decision), on the version the page now shows: nothing the reviewer wrote is lost.
        form = ResolveForm(initial={"version": op.version, **refused["typed"]})
    elif form is None:
        form = ResolveForm(initial={"version": op.version})
    reconfirm = None
    if refused is not None and refused["stale"]:
        to_state = refused["typed"]["to_state"]
        if to_state in detail.resolutions:
            # Only moves that left the same decision open happened (e.g. the reconciler's
            # reconciling -> outcome_unknown): offered again, one key records it.
            reconfirm = {"to_state": to_state, "label": ACTION_LABELS[to_state],
                         "why": refused["why"].removeprefix("Nothing recorded: ")}
    if refused is not None and reconfirm is None:
        add = messages.warning if refused["stale"] else messages.error
        add(request, refused["why"] + kept_reason(refused["typed"]["reason"],
                                                  shown=bool(detail.resolutions)))
    context = {
        "detail": detail,
        "op": op,
        "form": form,
        "ack_form": ack_form or AcknowledgeForm(initial={"version": op.version}),
        "actions": [(state, ACTION_LABELS[state]) for state in detail.resolutions],
        "offers_external_id": State.SUCCEEDED in detail.resolutions,
        # Approval before the call (review/views_approvals.py decides).
        "approval": selectors.approval_panel(request.user, op),
        "approval_form": approval_form or ApprovalDecisionForm(),
        "approval_actions": DECISION_LABELS,
        # A decision was just recorded: "Next item" takes the focus.
        "just_decided": just_decided,
        # How it was settled, in words, from the events already read.
        "settlement": settlement(op, detail.events),
        # The decision was refused as stale but is still open: confirm it with one key.
        "reconfirm": reconfirm,
        "chosen": form["to_state"].value(),
        # Safe to retry is legal but not this reviewer's to take: say why (the policy).
        "retry_needs_admin": bool(detail.resolutions)
        and State.SAFE_TO_RETRY in states.resolutions_from(op.state)
        and State.SAFE_TO_RETRY not in detail.resolutions,
        **view_context(request.GET),
    }
    # The two-person rule of receipts.resolve: every proposal with its status, the pending one.
    proposals = selectors.proposals_of(op, detail.events)
    context["proposals"], context["proposal"] = proposals.rows, proposals.pending
    return _render(request, "review/operation.html", "decision", context, status=status)


@require_POST
@resolve_required
@ledger_errors
def resolve(request, operation_id: str):
    """Record one decision; POST/redirect/GET, or the fresh decision fragment for htmx."""
    op = selectors.access_operation(request.user, operation_id)
    form = ResolveForm(request.POST)
    if not form.is_valid():
        return _detail(request, operation_id, form=form, status=422)
    to_state = form.cleaned_data["to_state"]
    typed = {name: form.cleaned_data[name] for name in ("to_state", "reason", "external_id")}
    try:
        receipts.resolve(
            op, to_state, user=request.user, reason=form.cleaned_data["reason"],
            external_id=(form.cleaned_data["external_id"] or None)
            if to_state == State.SUCCEEDED else None,
            expected_version=form.cleaned_data["version"],
        )
    except errors.StaleVersion as exc:
        return _detail(request, operation_id, status=409,
                       refused={"typed": typed, "stale": True, "why": stale_message(exc)})
    except (errors.IllegalTransition, errors.InvalidInput, errors.SecondPersonRequired) as exc:
        # Re-rendered, not redirected: the reason typed stays in the form.
        return _detail(request, operation_id, status=409,
                       refused={"typed": typed, "stale": False, "why": f"Nothing recorded: {exc}"})
    else:
        if op.proposal_recorded:  # the first of two people
            messages.info(
                request, f"Proposed: {ACTION_LABELS[to_state]} on {op.operation_id}; it takes "
                "a second person: a different reviewer choosing the same decision completes it."
            )
        else:
            messages.success(
                request, f"Recorded: {ACTION_LABELS[to_state]} on {op.operation_id}."
            )
    if request.htmx:
        return _detail(request, operation_id, just_decided=True)
    return redirect(operation_url(op) + view_context(request.GET)["view_suffix"])


@require_POST
@resolve_required
@ledger_errors
def acknowledge(request, operation_id: str):
    """Settle the conflict flag of a terminal operation (and of its duplicate twins);
    POST/redirect/GET, or the fresh decision fragment for htmx."""
    op = selectors.access_operation(request.user, operation_id)
    form = AcknowledgeForm(request.POST)
    if not form.is_valid():
        return _detail(request, operation_id, ack_form=form, status=422)
    try:
        receipts.acknowledge(op, user=request.user, reason=form.cleaned_data["reason"],
                             expected_version=form.cleaned_data["version"])
    except errors.StaleVersion as exc:  # re-rendered: the reason typed is kept
        messages.warning(request, stale_message(exc) + kept_reason(
            form.cleaned_data["reason"], shown=bool(exc.current and exc.current.conflict)))
        return _detail(request, operation_id, ack_form=form, status=409)
    except (errors.IllegalTransition, errors.InvalidInput) as exc:
        messages.error(request, f"Nothing recorded: {exc}"
                       + kept_reason(form.cleaned_data["reason"], shown=False))
        return _detail(request, operation_id, ack_form=form, status=409)
    messages.success(request, f"Recorded: conflict acknowledged on {op.operation_id}; "
                              "it has left the queue.")
    if request.htmx:
        return _detail(request, operation_id, just_decided=True)
    return redirect(operation_url(op) + view_context(request.GET)["view_suffix"])


SETTLED_STATES = frozenset({*states.TERMINAL, State.SAFE_TO_RETRY})


def settlement(op, events) -> str:
    """How `op` came to its settled state, in words ("" while it is not settled): who
    moved it there (its agent, a reconciler, a person) and the reason they recorded.
    `events`: the operation's events, oldest first (no query here)."""
    if op.state not in SETTLED_STATES:
        return ""
    move = next((ev for ev in reversed(events)
                 if ev.to_state == op.state and ev.from_state != ev.to_state), None)
    if move is None:
        return f"{State(op.state).label}; no event records the move (retention removed it?)."
    who = {
        "agent": f"by its agent{f' {move.actor_id}' if move.actor_id else ''}, which reported "
                 "the call's outcome itself",
        "reconciler": f"by the reconciler {move.actor_id}, from what the external "
                      "system showed (see Evidence)",
        "human": f"by {move.actor_id}, a person, on the desk",
        "system": "by the ledger itself",
    }.get(move.actor_kind, f"by {move.actor_id}")
    why = f": {move.reason}" if move.reason else ""
    return (f"{State(op.state).label} {who}, at "
            f"{move.created_at:%Y-%m-%d %H:%M:%S} UTC{why}.")


def kept_reason(reason: str, *, shown: bool) -> str:
    """What a refusal adds when the form the reason was typed in is gone (nothing is left
    to decide): the reason itself, to copy; nothing when the form shows it again."""
    return "" if shown or not reason else f" Your reason, not recorded: “{reason}”."


def stale_message(exc: errors.StaleVersion) -> str:
    """Who decided first, and when: the reviewer who lost the race reads this."""
    event, current = exc.last_event, exc.current
    if event is None or current is None:
        return f"Nothing recorded: {exc}"
    who = event.actor_id or event.get_actor_kind_display().lower()
    if event.from_state == event.to_state:  # a change of the conflict flag, not the state
        return (
            f"Nothing recorded: {who} ({event.get_actor_kind_display().lower()}) already "
            f"changed the conflict flag of this operation at "
            f"{event.created_at:%Y-%m-%d %H:%M:%S} UTC"
            + (f" (reason: {event.reason})" if event.reason else "")
            + f". It is now {State(current.state).label.lower()}"
            + (f", flagged {current.conflict}" if current.conflict else ", no longer flagged")
            + f", version {current.version}."
        )
    return (
        f"Nothing recorded: {who} ({event.get_actor_kind_display().lower()}) already moved "
        f"this operation {event.from_state or '-'} -> {event.to_state} at "
        f"{event.created_at:%Y-%m-%d %H:%M:%S} UTC"
        + (f" (reason: {event.reason})" if event.reason else "")
        + f". It is now {State(current.state).label.lower()}, version {current.version}."
    )


@require_GET
@view_required
@ledger_errors
def audit(request):
    form = AuditFilterForm(request.GET)
    page = selectors.audit_page(request.user, form.filters(), **form.page_args())
    context = {"form": form, "page": page}
    # Chain heads and last verification of the user's tenants (two queries).
    context["chain_status"] = selectors.audit_status_for(request.user)
    return _render(request, "review/audit.html", "results", context)


CSV_COLUMNS = list(shapes.AUDIT_COLUMNS)


@require_GET
@view_required
@ledger_errors
def audit_csv(request):
    """The filtered audit log as CSV, streamed in keyset batches."""
    form = AuditFilterForm(request.GET)
    events = selectors.iter_audit_events(request.user, form.filters())
    writer = csv.writer(_Echo())

    def rows():
        yield writer.writerow(CSV_COLUMNS)
        for event in events:
            yield writer.writerow([csv_safe(value)
                                   for value in shapes.audit_event(event).values()])

    response = StreamingHttpResponse(rows(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="audit-log.csv"'
    return response


class _Echo:
    def write(self, value):
        return value


_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "\n")


def csv_safe(value) -> str:
    """Text a spreadsheet will not run: a leading = + - @ tab or CR gets a quote mark."""
    text = "" if value is None else str(value)
    if text.startswith(_FORMULA_STARTS):
        return "'" + text
    return text
