"""Retention policies, their audit trail, purge runs and redactions (the chains they keep
intact: `ledger.models.chain`); and the policies of execution state (superseded facts,
episodes, settled obligations), audited and purged the same way."""

import pgtrigger
from django.conf import settings
from django.db import models

from ledger.models.changes import ChangeRecord
from ledger.models.triggers import Protect

# The one policy that always exists: it governs every operation no other policy matches.
DEFAULT_PATTERN = "*"


class RetentionPolicy(models.Model):
    """How long the ledger keeps the history of terminal operations whose name matches.

    `pattern` is a glob over the operation name (`*` any run of characters, `?` one
    character); `tenant` empty means every tenant. Of the policies that match an operation,
    the most specific governs it (see `ledger.retention.specificity`). Change rows only
    through `ledger.retention.set_policy` / `delete_policy`, which audit every change.
    """

    pattern = models.CharField(max_length=200)
    tenant = models.CharField(max_length=100, blank=True, help_text="Empty: every tenant.")
    purge_after_days = models.PositiveIntegerField(
        help_text="Delete terminal operations (with their events and evidence) this many days "
        "after completion."
    )
    redact_after_days = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Replace the intent and evidence payloads this many days after completion; "
        "empty: never.",
    )
    keep_events_days = models.PositiveIntegerField(
        help_text="Keep an operation's audit events at least this many days after completion; "
        "an operation is purged only once both this and purge_after_days have passed."
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+",
    )
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["pattern", "tenant"], name="retention_policy_unique"),
        ]
        ordering = ["pattern", "tenant"]
        verbose_name_plural = "retention policies"

    def __str__(self):
        return f"{self.pattern} ({self.tenant or 'every tenant'})"

    @property
    def is_default(self) -> bool:
        return self.pattern == DEFAULT_PATTERN and not self.tenant

    @property
    def purge_horizon_days(self) -> int:
        """Days after completion before an operation may be purged (events go with it)."""
        return max(self.purge_after_days, self.keep_events_days)

    def as_audit_dict(self) -> dict:
        return {
            "pattern": self.pattern,
            "tenant": self.tenant,
            "purge_after_days": self.purge_after_days,
            "redact_after_days": self.redact_after_days,
            "keep_events_days": self.keep_events_days,
        }


class StateKind(models.TextChoices):
    """What a `StateRetentionPolicy` governs, and when a row of it may go."""

    FACTS = "facts", "Superseded fact versions"
    EPISODES = "episodes", "Episodes"
    OBLIGATIONS = "obligations", "Settled obligations"
    COVERAGE = "coverage", "Coverage readings"


class StateRetentionPolicy(models.Model):
    """How long the ledger keeps one kind of execution state of a tenant (or every tenant).

    Superseded fact versions go `purge_after_days` after they were superseded, episodes that
    long after they were recorded, committed or cancelled obligations that long after they
    were settled, coverage readings that long after they were taken; never a current fact, a
    candidate, an open obligation, anything of an unfinished run, or the latest coverage
    reading of a target (PostgreSQL refuses those deletes whoever asks: `ledger.retention`).
    One policy naming the tenant beats the one for every tenant. Change rows only through
    `ledger.retention.set_state_policy` / `delete_state_policy`, which audit every change.
    """

    kind = models.CharField(max_length=20, choices=StateKind.choices)
    tenant = models.CharField(max_length=100, blank=True, help_text="Empty: every tenant.")
    purge_after_days = models.PositiveIntegerField(
        help_text="Delete rows of this kind this many days after they were superseded "
        "(facts), recorded (episodes), settled (obligations) or taken (coverage readings)."
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+",
    )
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["kind", "tenant"],
                                    name="state_retention_policy_unique"),
            models.CheckConstraint(condition=models.Q(kind__in=StateKind.values),
                                   name="state_retention_kind_known"),
        ]
        ordering = ["kind", "tenant"]
        verbose_name_plural = "state retention policies"

    def __str__(self):
        return f"{self.kind} ({self.tenant or 'every tenant'})"

    @property
    def is_default(self) -> bool:
        return not self.tenant

    def as_audit_dict(self) -> dict:
        return {"kind": self.kind, "tenant": self.tenant,
                "purge_after_days": self.purge_after_days}


class RetentionChange(ChangeRecord):
    """Who changed a retention policy, what it was before and after. Append-only."""

    class Action(models.TextChoices):
        CREATED = "created", "Created"
        UPDATED = "updated", "Updated"
        DELETED = "deleted", "Deleted"

    # DO_NOTHING without a constraint: the row is append-only, so it keeps the id of a
    # deleted policy (and of a deleted user) rather than being updated to NULL.
    policy = models.ForeignKey(
        RetentionPolicy, null=True, blank=True, on_delete=models.DO_NOTHING,
        related_name="changes", db_constraint=False,
    )
    # The execution-state policy changed, when it is one of those (`policy` is then empty).
    state_policy = models.ForeignKey(
        StateRetentionPolicy, null=True, blank=True, on_delete=models.DO_NOTHING,
        related_name="changes", db_constraint=False,
    )
    action = models.CharField(max_length=20, choices=Action.choices)
    changed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.DO_NOTHING, related_name="+",
        db_constraint=False,
    )
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-changed_at", "-id"]
        triggers = [
            Protect(
                name="retention_change_append_only",
                operation=pgtrigger.Update | pgtrigger.Delete,
            ),
        ]

    def __str__(self):
        return f"{self.changed_by_name} {self.action} {self.before or self.after}"


class PurgeRun(models.Model):
    """One pass of `manage.py purge` over one policy: what it removed and redacted.

    A pass over an execution-state policy has `state_policy` (and no `policy`) and counts
    the rows of its kind in `rows_purged`.

    Counts are updated in the same transaction as each batch, so an interrupted run still
    says exactly what it did; `finished_at` stays empty when it was interrupted.
    """

    policy = models.ForeignKey(
        RetentionPolicy, null=True, blank=True, on_delete=models.SET_NULL, related_name="runs"
    )
    state_policy = models.ForeignKey(
        StateRetentionPolicy, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="runs",
    )
    policy_snapshot = models.JSONField()
    dry_run = models.BooleanField(default=False)
    actor = models.CharField(max_length=200)
    batch_size = models.PositiveIntegerField()
    operations_purged = models.PositiveIntegerField(default=0)
    events_purged = models.PositiveIntegerField(default=0)
    evidence_purged = models.PositiveIntegerField(default=0)
    operations_redacted = models.PositiveIntegerField(default=0)
    evidence_redacted = models.PositiveIntegerField(default=0)
    # Facts, episodes or obligations removed by a pass over a state policy.
    rows_purged = models.PositiveIntegerField(default=0, db_default=0)
    first_operation_id = models.CharField(max_length=40, blank=True)
    last_operation_id = models.CharField(max_length=40, blank=True)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at", "-id"]

    def __str__(self):
        kind = "dry run" if self.dry_run else "purge"
        pattern = self.policy_snapshot.get("pattern") or self.policy_snapshot.get("kind")
        return f"{kind} of {pattern} at {self.started_at:%Y-%m-%d %H:%M}"


class Redaction(models.Model):
    """The record that retention replaced an operation's payloads. Append-only.

    Keeps the operation's public id as text so the record outlives a later purge.
    """

    operation_ref = models.CharField(max_length=40, db_index=True)
    tenant = models.CharField(max_length=100)
    intent_fingerprint = models.CharField(max_length=80)
    evidence_rows = models.PositiveIntegerField()
    purge_run = models.ForeignKey(PurgeRun, on_delete=models.PROTECT, related_name="redactions")
    redacted_at = models.DateTimeField()

    class Meta:
        ordering = ["-redacted_at", "-id"]
        triggers = [
            Protect(
                name="redaction_append_only", operation=pgtrigger.Update | pgtrigger.Delete
            ),
        ]

    def __str__(self):
        return f"{self.operation_ref} redacted at {self.redacted_at:%Y-%m-%d %H:%M}"
