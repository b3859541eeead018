"""Forms of the execution-state pages (fact conflicts, overdue obligations, runs)."""

from __future__ import annotations

from django import forms

from review.forms import _PageForm

SIDES = {"current": "the current value", "candidate": "the candidate value"}


class ExecutionListForm(_PageForm):
    """The tenant filter and keyset position of the conflict and obligation lists."""

    tenant = forms.CharField(required=False, max_length=100)

    def tenant_filter(self) -> str:
        data = self.cleaned_data if self.is_valid() else {}
        return (data.get("tenant") or "").strip()


class ConflictDecisionForm(forms.Form):
    """"Use this value" on one side. `expected_version` is the current version the page
    was rendered against: if the fact moved on since, `facts.resolve_conflict` refuses."""

    winner = forms.ChoiceField(choices=list(SIDES.items()))
    reason = forms.CharField(
        max_length=2000, strip=True,
        widget=forms.Textarea(attrs={"rows": 2, "placeholder": "Why this value? (required)"}),
        error_messages={"required": "A reason is required for every decision."},
    )
    expected_version = forms.IntegerField(min_value=1, widget=forms.HiddenInput)


class FactCorrectionForm(forms.Form):
    """A person's correction of a fact: the new value (JSON), why, and the version the page
    was rendered against (`facts.correct_fact` refuses if the fact moved on since)."""

    value = forms.JSONField(
        widget=forms.Textarea(attrs={"rows": 4, "placeholder": '{"paid": true}'}),
        error_messages={"required": "The corrected value is required (JSON).",
                        "invalid": "Enter the corrected value as JSON, e.g. \"paid\" or "
                                   "{\"paid\": true}."},
    )
    reason = forms.CharField(
        max_length=2000, strip=True,
        widget=forms.Textarea(attrs={"rows": 2, "placeholder": "Why is this the value? "
                                                               "(required)"}),
        error_messages={"required": "A reason is required for every correction."},
    )
    expires_at = forms.DateTimeField(required=False)
    version = forms.IntegerField(min_value=1, widget=forms.HiddenInput)
