"""The form of the Notifications page: it parses text; `ledger.notifications` decides what
is allowed (URL without credentials, a configured secret name, e-mail addresses) and says
so."""

from __future__ import annotations

from datetime import timedelta

from django import forms

from ledger.models import NotificationChannel


class ChannelForm(forms.Form):
    name = forms.CharField(max_length=100, strip=True,
                           widget=forms.TextInput(attrs={"placeholder": "payments-on-call"}))
    tenant = forms.CharField(max_length=100, strip=True, initial="default")
    kind = forms.ChoiceField(choices=NotificationChannel.Kind.choices)
    pattern = forms.CharField(max_length=200, strip=True, initial="*",
                              label="Operation pattern",
                              widget=forms.TextInput(attrs={"placeholder": "payments.*"}))
    url = forms.CharField(max_length=2000, required=False, strip=True, label="Webhook URL",
                          widget=forms.TextInput(attrs={"placeholder":
                                                        "https://hooks.example/ledger"}))
    secret_name = forms.CharField(
        max_length=100, required=False, strip=True, label="Secret name",
        help_text="Webhook: <NAME> of the environment variable LEDGER_WEBHOOK_SECRET_<NAME> "
                  "(the secret itself is never entered here).")
    recipients = forms.CharField(max_length=5000, required=False, label="E-mail recipients",
                                 widget=forms.TextInput(attrs={"placeholder":
                                                               "oncall@example.com, ..."}))
    on_queue = forms.BooleanField(required=False, initial=True,
                                  label="An item enters the review queue")
    on_approval = forms.BooleanField(required=False, initial=True,
                                     label="An item awaits approval")
    stuck_minutes = forms.IntegerField(
        required=False, min_value=1, max_value=60 * 24 * 30, label="Stuck after (minutes)",
        widget=forms.NumberInput(attrs={"placeholder": "never", "inputmode": "numeric"}),
        error_messages={"invalid": "Stuck after: expected a whole number of minutes."})

    def channel_values(self) -> dict:
        data = self.cleaned_data
        minutes = data.get("stuck_minutes")
        return {
            "name": data["name"], "tenant": data["tenant"], "kind": data["kind"],
            "pattern": data["pattern"], "url": data.get("url") or "",
            "secret_name": data.get("secret_name") or "",
            "recipients": [r.strip() for r in (data.get("recipients") or "").split(",")
                           if r.strip()],
            "on_queue": data["on_queue"], "on_approval": data["on_approval"],
            "stuck_after": timedelta(minutes=minutes) if minutes else None,
        }
