"""What an unproven outcome of a kind of operation may become, set by admins on the desk.

A row names operations of a tenant by a glob over the name (`payments.*`) and says whether
a proven absence may become safe_to_retry without a person, how many failed or blind
readings lead to manual_review and how long NotYet may last. The reconciler reads the
matching row as it stores a verdict (`ledger.reconcile.unknown_outcome_policy`); with none,
LEDGER_UNKNOWN_OUTCOME_POLICIES, then the reconciler's own numbers. Rows change only through
`ledger.outcome_policies.set_policy`, which writes the append-only change with its reason;
both tables are under the records chain (a rewrite is reported by verify_audit).
"""

from datetime import timedelta

from django.conf import settings
from django.db import models

from ledger.models.changes import ChangeRecord
from ledger.models.operations import AppendOnly


class UnknownOutcomePolicy(models.Model):
    """The unknown-outcome policy of `tenant`'s operations whose name matches `pattern`.

    `automatic_retry`: whether a proven absence may become safe_to_retry without a person
    (False: manual_review, say for payments); `attempts`: failed or blind readings before
    manual_review (null: the reconciler's `max_failures`); `not_yet_window`: how long NotYet may
    last from `unknown_since` (null: the reconciler's `grace_period`).
    """

    pattern = models.CharField(max_length=200)
    tenant = models.CharField(max_length=100, default="default")
    automatic_retry = models.BooleanField(default=True)
    attempts = models.PositiveSmallIntegerField(null=True, blank=True)
    not_yet_window = models.DurationField(null=True, blank=True)
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "pattern"],
                                    name="unknown_outcome_policy_unique"),
            models.CheckConstraint(
                condition=models.Q(attempts__isnull=True) | models.Q(attempts__gte=1),
                name="unknown_outcome_policy_attempts_positive"),
            models.CheckConstraint(
                condition=(models.Q(not_yet_window__isnull=True)
                           | models.Q(not_yet_window__gt=models.Value(
                               timedelta(0),
                               output_field=models.DurationField()))),
                name="unknown_outcome_policy_window_positive"),
        ]
        ordering = ["tenant", "pattern"]
        verbose_name_plural = "unknown-outcome policies"

    def __str__(self):
        return f"{self.pattern} ({self.tenant})"

    def as_audit_dict(self) -> dict:
        return {
            "pattern": self.pattern, "tenant": self.tenant,
            "automatic_retry": self.automatic_retry, "attempts": self.attempts,
            "window_seconds": (None if self.not_yet_window is None
                               else int(self.not_yet_window.total_seconds())),
        }


class UnknownOutcomePolicyChange(ChangeRecord):
    """Who set an unknown-outcome policy, why, what it was before and after. Append-only."""

    tenant = models.CharField(max_length=100)
    pattern = models.CharField(max_length=200)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField()
    reason = models.TextField()
    changed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )

    class Meta:
        ordering = ["-changed_at", "-id"]
        triggers = [AppendOnly(name="unknown_outcome_policy_change_append_only")]

    def __str__(self):
        return f"{self.pattern} ({self.tenant}) by {self.changed_by_name}"
