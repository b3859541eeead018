"""Forms of the retention page: they parse text into numbers; `ledger.retention` decides
what is allowed (pattern syntax, day ranges, redact before purge) and says so."""

from __future__ import annotations

from django import forms

from ledger.models import RetentionPolicy, StateKind, StateRetentionPolicy


def _days(label: str, *, required: bool, placeholder: str = "") -> forms.IntegerField:
    return forms.IntegerField(
        label=label, required=required,
        widget=forms.NumberInput(attrs={"placeholder": placeholder, "inputmode": "numeric"}),
        error_messages={"invalid": f"{label}: expected a whole number of days."},
    )


class PolicyDaysForm(forms.Form):
    """The days of one policy; the edit form of an existing policy (its pattern and tenant
    are the policy's own and cannot change: a new pattern is a new policy)."""

    purge_after_days = _days("Purge after (days)", required=True)
    redact_after_days = _days("Redact after (days)", required=False, placeholder="never")
    keep_events_days = _days("Keep events (days)", required=False,
                             placeholder="same as purge")

    @classmethod
    def for_policy(cls, policy: RetentionPolicy, data=None) -> PolicyDaysForm:
        return cls(data, prefix=f"policy-{policy.pk}", initial={
            "purge_after_days": policy.purge_after_days,
            "redact_after_days": policy.redact_after_days,
            "keep_events_days": policy.keep_events_days,
        })

    def policy_values(self) -> dict:
        data = self.cleaned_data
        return {
            "purge_after_days": data["purge_after_days"],
            "redact_after_days": data.get("redact_after_days"),
            "keep_events_days": data.get("keep_events_days"),
        }


class NewPolicyForm(PolicyDaysForm):
    """A policy for a pattern (and tenant) that may not have one yet; an existing
    (pattern, tenant) is updated, as `retention.set_policy` does."""

    pattern = forms.CharField(
        label="Operation pattern", max_length=1000,
        widget=forms.TextInput(attrs={"placeholder": "articles.* or mail.send"}),
        error_messages={"required": "Operation pattern: expected a glob such as articles.*"},
    )
    tenant = forms.CharField(
        label="Tenant", required=False, max_length=1000,
        widget=forms.TextInput(attrs={"placeholder": "every tenant"}),
    )

    field_order = ["pattern", "tenant", "purge_after_days", "redact_after_days",
                   "keep_events_days"]

    def __init__(self, data=None, **kwargs):
        super().__init__(data, prefix="new", **kwargs)

    def policy_values(self) -> dict:
        return {"pattern": self.cleaned_data["pattern"],
                "tenant": self.cleaned_data.get("tenant") or "", **super().policy_values()}


class StatePolicyDaysForm(forms.Form):
    """The days of one execution-state policy (its kind and tenant are its own)."""

    purge_after_days = _days("Purge after (days)", required=True)

    @classmethod
    def for_policy(cls, policy: StateRetentionPolicy, data=None) -> StatePolicyDaysForm:
        return cls(data, prefix=f"state-{policy.pk}",
                   initial={"purge_after_days": policy.purge_after_days})

    def policy_values(self) -> dict:
        return {"purge_after_days": self.cleaned_data["purge_after_days"]}


class NewStatePolicyForm(StatePolicyDaysForm):
    """A tenant's policy for one kind of execution state; an existing (kind, tenant) is
    updated, as `retention_state.set_state_policy` does."""

    kind = forms.ChoiceField(label="Kind", choices=StateKind.choices)
    tenant = forms.CharField(
        label="Tenant", required=False, max_length=1000,
        widget=forms.TextInput(attrs={"placeholder": "every tenant"}),
    )

    field_order = ["kind", "tenant", "purge_after_days"]

    def __init__(self, data=None, **kwargs):
        super().__init__(data, prefix="new-state", **kwargs)

    def policy_values(self) -> dict:
        return {"kind": self.cleaned_data["kind"],
                "tenant": self.cleaned_data.get("tenant") or "", **super().policy_values()}
