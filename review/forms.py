"""Forms of the review desk: they parse and validate; the rules live in `ledger`."""

from __future__ import annotations

import re
from datetime import datetime, time, timedelta

from django import forms
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from ledger import selectors
from ledger.states import QUEUE_STATES, RESOLUTIONS, State

AGES = {
    "": None,
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "3h": timedelta(hours=3),
    "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
}
AGE_CHOICES = [
    ("", "any age"), ("15m", "waiting > 15 min"), ("1h", "stuck > 1 h"),
    ("3h", "stuck > 3 h"), ("24h", "stuck > 24 h"), ("7d", "stuck > 7 d"),
]
QUEUE_STATE_CHOICES = [
    ("", "all waiting"),
    *((state, State(state).label) for state in QUEUE_STATES),
    (selectors.CONFLICTING, "Conflicting"),
    # Browsing: every other state of the table (safe_to_retry waits for its agent, a
    # submitted one older than "stuck > 1 h" lost its sender, ...).
    ("Every state", [(state, State(state).label) for state in State.values
                     if state not in QUEUE_STATES]),
]
# The button of each decision a reviewer may take (`ledger.states.RESOLUTIONS`, derived
# from the state table): a decision the table gains without a label here stops the import.
ACTION_LABELS = {
    State.SUCCEEDED: "Mark succeeded",
    State.SAFE_TO_RETRY: "Safe to retry",
    State.ABANDONED: "Abandon",
}
if set(ACTION_LABELS) != set(RESOLUTIONS):
    raise ImproperlyConfigured(
        f"expected a button label for each decision of the state table {sorted(RESOLUTIONS)}, "
        f"found labels for {sorted(ACTION_LABELS)}"
    )


class _PageForm(forms.Form):
    cursor = forms.CharField(required=False, widget=forms.HiddenInput)
    per_page = forms.IntegerField(
        required=False, min_value=1, max_value=selectors.MAX_PAGE_SIZE, widget=forms.HiddenInput
    )

    def clean_cursor(self):
        cursor = self.cleaned_data["cursor"]
        if cursor:
            try:
                selectors.parse_cursor(cursor)
            except ValueError as exc:
                raise forms.ValidationError(str(exc)) from None
        return cursor

    def page_args(self) -> dict:
        data = self.cleaned_data if self.is_valid() else {}
        return {"cursor": data.get("cursor") or "", "per_page": data.get("per_page") or 50}


class QueueFilterForm(_PageForm):
    # `previous_cursor` of the page after: the queue pages back as well as forward.
    before = forms.CharField(required=False, widget=forms.HiddenInput)

    def clean_before(self):
        before = self.cleaned_data["before"]
        if before:
            try:
                selectors.parse_cursor(before)
            except ValueError as exc:
                raise forms.ValidationError(str(exc)) from None
        return before

    def page_args(self) -> dict:
        args = super().page_args()
        args["before"] = self.cleaned_data.get("before", "") if self.is_valid() else ""
        if args["before"]:
            args["cursor"] = ""
        return args

    q = forms.CharField(
        required=False, max_length=500, label="Search",
        widget=forms.TextInput(attrs={"placeholder": "operation id, external id or key",
                                      "type": "search"}),
    )
    state = forms.ChoiceField(required=False, choices=QUEUE_STATE_CHOICES)
    operation = forms.CharField(required=False, max_length=200, label="Operation",
                                widget=forms.TextInput(attrs={"placeholder": "articles.create"}))
    tenant = forms.CharField(required=False, max_length=100)
    account = forms.CharField(required=False, max_length=200, label="Account",
                              widget=forms.TextInput(attrs={"placeholder": "acct_1Nx..."}))
    age = forms.ChoiceField(required=False, choices=AGE_CHOICES)
    order = forms.ChoiceField(
        required=False, choices=[("", "newest stuck first"), ("oldest", "oldest first")]
    )

    def filters(self) -> selectors.QueueFilters:
        data = self.cleaned_data if self.is_valid() else {}
        return selectors.QueueFilters(
            state=data.get("state", ""),
            operation=(data.get("operation") or "").strip(),
            tenant=(data.get("tenant") or "").strip(),
            account=(data.get("account") or "").strip(),
            older_than=AGES.get(data.get("age", "")),
            search=(data.get("q") or "").strip(),
            oldest_first=data.get("order") == "oldest",
        )


class AuditFilterForm(_PageForm):
    actor = forms.CharField(required=False, max_length=200, label="User or actor")
    operation = forms.CharField(required=False, max_length=200,
                                label="Operation id or name")
    state = forms.ChoiceField(required=False, label="To state",
                              choices=[("", "any state"), *State.choices])
    since = forms.DateField(required=False, label="From",
                            widget=forms.DateInput(attrs={"type": "date"}))
    until = forms.DateField(required=False, label="Until (inclusive)",
                            widget=forms.DateInput(attrs={"type": "date"}))

    def filters(self) -> selectors.AuditFilters:
        data = self.cleaned_data if self.is_valid() else {}
        return selectors.AuditFilters(
            actor=(data.get("actor") or "").strip(),
            operation=(data.get("operation") or "").strip(),
            state=data.get("state", ""),
            since=_start_of(data.get("since")),
            until=_start_of(data["until"] + timedelta(days=1)) if data.get("until") else None,
        )


def _start_of(day) -> datetime | None:
    if day is None:
        return None
    return datetime.combine(day, time.min, tzinfo=timezone.get_current_timezone())


class ResolveForm(forms.Form):
    """One decision. Any resolution parses; `receipts.resolve` decides whether it is allowed
    (so a reviewer whose page went stale learns who decided first, not "invalid choice")."""

    to_state = forms.ChoiceField(choices=[(s, ACTION_LABELS[s]) for s in RESOLUTIONS])
    reason = forms.CharField(
        max_length=2000, strip=True,
        widget=forms.Textarea(attrs={"rows": 2, "placeholder": "Why? (required)"}),
        error_messages={"required": "A reason is required for every decision."},
    )
    external_id = forms.CharField(
        required=False, max_length=500, label="External id (optional)",
        widget=forms.TextInput(attrs={"placeholder": "article-123"}),
    )
    version = forms.IntegerField(min_value=1, widget=forms.HiddenInput)


class AcknowledgeForm(forms.Form):
    """A person settles the conflict flag of a terminal operation; `receipts.acknowledge`
    decides whether it may."""

    reason = forms.CharField(
        max_length=2000, strip=True,
        widget=forms.Textarea(attrs={"rows": 2, "placeholder": "Why? (required)"}),
        error_messages={"required": "A reason is required to acknowledge a conflict."},
    )
    version = forms.IntegerField(min_value=1, widget=forms.HiddenInput)


class BulkDecisionForm(forms.Form):
    """One decision for the ticked operations ("<operation_id>@<version seen>"), or for all
    the queue's operations matching the filter (at most `ledger.bulk.BULK_CAP`)."""

    to_state = forms.ChoiceField(choices=[(s, ACTION_LABELS[s]) for s in RESOLUTIONS])
    reason = forms.CharField(
        max_length=2000, strip=True,
        error_messages={"required": "A reason is required for every decision."},
    )
    items = forms.Field(required=False)  # read as a list in clean_items
    all_matching = forms.BooleanField(required=False)

    def clean_items(self):
        parsed = []
        for item in self.data.getlist("items") if hasattr(self.data, "getlist") else []:
            operation_id, sep, version = item.rpartition("@")
            if not sep or not operation_id or not version.isdigit():
                raise forms.ValidationError(
                    f"expected items like <operation id>@<version>, found {item!r}")
            parsed.append((operation_id, int(version)))
        return parsed

    def clean(self):
        data = super().clean()
        if not data.get("all_matching") and not data.get("items"):
            raise forms.ValidationError("Tick at least one operation, or all matching.")
        return data


def labelled(message: str, form: forms.Form) -> str:
    """A ledger refusal as people read it on `form`: each argument name the message uses
    (`purge_after_days`) becomes the label of its field ("Purge after (days)")."""
    text = str(message)
    # Only snake_case names: a plain word ("pattern", "tenant") is also the message's prose.
    for name in sorted((n for n in form.fields if "_" in n), key=len, reverse=True):
        label = form.fields[name].label or name.replace("_", " ").capitalize()
        text = re.sub(rf"\b{re.escape(name)}\b", f"“{label}”", text)
    return text


def form_errors(form: forms.Form) -> str:
    """Every error of `form`, each after its field's label ("Stuck after (minutes): ...")
    unless the error already begins with it."""
    parts = []
    for name, errors_ in form.errors.items():
        label = "" if name == "__all__" else (
            form.fields[name].label or name.replace("_", " ").capitalize())
        for error in errors_:
            named = not label or str(error).startswith(label.split(" (")[0])
            parts.append(str(error) if named else f"{label}: {error}")
    return " ".join(parts)
