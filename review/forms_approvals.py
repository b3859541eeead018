"""Forms of the approval desk: they parse and validate; the rules live in `ledger.approvals`."""

from __future__ import annotations

from datetime import timedelta

from django import forms

from ledger import conf
from ledger.errors import InvalidInput
from ledger.inputs import parse_json_object

APPROVE, DENY, EDIT = "approve", "deny", "edit"
DECISION_LABELS = {APPROVE: "Approve", DENY: "Deny", EDIT: "Approve edited intent"}


class ApprovalDecisionForm(forms.Form):
    """Approve, deny (a reason is required) or approve an edited intent (JSON object).
    `version` is the version the page showed: if the operation moved on, nothing is
    written."""

    action = forms.ChoiceField(choices=list(DECISION_LABELS.items()))
    reason = forms.CharField(required=False, max_length=2000, strip=True)
    intent = forms.CharField(required=False, widget=forms.Textarea)
    version = forms.IntegerField(min_value=1, widget=forms.HiddenInput)

    def clean(self):
        data = super().clean()
        action = data.get("action")
        if action == DENY and not data.get("reason"):
            self.add_error("reason", "A reason is required to deny.")
        if action == EDIT:
            try:
                data["intent"] = parse_json_object(data.get("intent") or "", "the edited intent",
                                                   conf.MAX_INTENT_BYTES)
            except InvalidInput as exc:
                self.add_error("intent", str(exc))
        else:
            data["intent"] = None
        return data


class ApprovalPolicyForm(forms.Form):
    pattern = forms.CharField(max_length=200, strip=True)
    tenant = forms.CharField(max_length=100, strip=True, initial="default")
    approvals_needed = forms.TypedChoiceField(choices=[(1, "1"), (2, "2")], coerce=int,
                                              initial=1)
    ttl_hours = forms.IntegerField(min_value=1, max_value=720, initial=24,
                                   label="Approval valid for (hours)")
    consequential = forms.BooleanField(required=False,
                                       help_text="Two different people: proposer and approver.")
    requires_approval = forms.BooleanField(required=False, initial=True)

    def policy_values(self) -> dict:
        data = self.cleaned_data
        return {"pattern": data["pattern"], "tenant": data["tenant"],
                "approvals_needed": data["approvals_needed"],
                "ttl": timedelta(hours=data["ttl_hours"]),
                "consequential": data["consequential"],
                "requires_approval": data["requires_approval"]}
