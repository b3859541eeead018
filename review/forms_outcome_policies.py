"""The form of the unknown-outcome policies page: it parses; `ledger.outcome_policies` rules."""

from __future__ import annotations

from datetime import timedelta

from django import forms

from ledger.outcome_policies import MAX_ATTEMPTS, MAX_WINDOW


class UnknownOutcomePolicyForm(forms.Form):
    pattern = forms.CharField(max_length=200, strip=True)
    tenant = forms.CharField(max_length=100, strip=True, initial="default")
    automatic_retry = forms.BooleanField(
        required=False, initial=True,
        help_text="Unchecked: a proven absence goes to a person, never safe_to_retry alone.")
    attempts = forms.IntegerField(
        required=False, min_value=1, max_value=MAX_ATTEMPTS,
        label="Readings before manual review",
        help_text="Empty: the reconciler's own max_failures.")
    window_minutes = forms.IntegerField(
        required=False, min_value=1, max_value=int(MAX_WINDOW.total_seconds() // 60),
        label="Not-yet window (minutes)",
        help_text="Empty: the reconciler's own grace period.")
    reason = forms.CharField(max_length=2000, strip=True, widget=forms.Textarea(attrs={"rows": 2}))

    def policy_values(self) -> dict:
        data = self.cleaned_data
        minutes = data.get("window_minutes")
        return {"pattern": data["pattern"], "tenant": data["tenant"],
                "automatic_retry": data["automatic_retry"], "attempts": data.get("attempts"),
                "window": timedelta(minutes=minutes) if minutes else None,
                "reason": data["reason"]}
