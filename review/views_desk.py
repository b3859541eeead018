"""Claims and notes on an operation (`ledger.claims`): POST/redirect/GET, or the fresh
decision fragment of the operation page for htmx. Thin: `ledger.claims` checks the
permission and the tenant again."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.shortcuts import redirect
from django.utils import timezone
from django.views.decorators.http import require_POST

from ledger import claims, durations, errors, selectors
from review.http import ledger_errors
from review.templatetags.desk import operation_url
from review.views import _detail

resolve_required = permission_required("ledger.resolve_operation", raise_exception=True)


class NoteForm(forms.Form):
    text = forms.CharField(
        max_length=claims.NOTE_MAX_LENGTH, strip=True, label="Note",
        widget=forms.Textarea(attrs={"rows": 2, "placeholder": "What you found, for the "
                                                              "next person"}),
        error_messages={"required": "A note needs some text."},
    )


def _left(until) -> str:
    """How long until `until`, in words (relative, like every other time on the desk)."""
    return durations.in_words(until - timezone.now(), units=1)


def _answer(request, op):
    if request.htmx:
        return _detail(request, op.operation_id)
    return redirect(operation_url(op))


@require_POST
@resolve_required
@ledger_errors
def claim(request, operation_id: str):
    """Claim the operation for 15 minutes (or renew one's claim); refused naming the
    reviewer whose claim is live."""
    op = selectors.access_operation(request.user, operation_id)
    try:
        held = claims.claim(op, user=request.user)
    except errors.ClaimHeld as exc:
        messages.warning(request, f"Not claimed: {exc.holder} is looking at this; the "
                                  f"claim expires in {_left(exc.expires_at)}.")
    else:
        messages.success(request, f"Claimed for {_left(held.expires_at)}; others see you "
                                  "are looking at this.")
    return _answer(request, op)


@require_POST
@resolve_required
@ledger_errors
def release(request, operation_id: str):
    op = selectors.access_operation(request.user, operation_id)
    try:
        released = claims.release(op, user=request.user)
    except errors.ClaimHeld as exc:
        messages.warning(request, f"Not released: the claim is {exc.holder}'s.")
    else:
        messages.info(request, "Claim released." if released else "You held no claim.")
    return _answer(request, op)


@require_POST
@resolve_required
@ledger_errors
def add_note(request, operation_id: str):
    op = selectors.access_operation(request.user, operation_id)
    form = NoteForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Nothing recorded: " + " ".join(form.errors.get("text", [])))
        if request.htmx:
            return _detail(request, operation_id, status=422)
        return redirect(operation_url(op))
    try:
        claims.add_note(op, user=request.user, text=form.cleaned_data["text"])
    except errors.InvalidInput as exc:
        messages.error(request, f"Nothing recorded: {exc}")
    else:
        messages.success(request, "Note added to the timeline.")
    return _answer(request, op)
