"""The desk's own records about an operation: who is looking at it, and people's notes."""

from django.conf import settings
from django.db import models

from ledger.models.operations import AppendOnly


class Claim(models.Model):
    """"Ada is looking at this": one reviewer's claim on one operation, until `expires_at`.

    One row per operation at most (a new claim replaces an expired one in place); a claim
    past `expires_at` is nobody's. Not an audit record: who decided is in the events.
    """

    operation = models.OneToOneField(
        "ledger.Operation", on_delete=models.CASCADE, related_name="claim"
    )
    tenant = models.CharField(max_length=100)
    claimed_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                                   related_name="+")
    claimed_by_name = models.CharField(max_length=150)
    claimed_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.CheckConstraint(condition=models.Q(expires_at__gt=models.F("claimed_at")),
                                   name="claim_expires_after_claimed"),
        ]

    def __str__(self):
        return f"{self.operation_id} claimed by {self.claimed_by_name} until {self.expires_at}"


class OperationNote(models.Model):
    """A person's note on an operation, shown in its timeline. Append-only: a note is
    corrected by another note, never edited."""

    operation = models.ForeignKey(
        "ledger.Operation", on_delete=models.CASCADE, related_name="notes"
    )
    tenant = models.CharField(max_length=100)
    author = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT,
                               related_name="+")
    author_name = models.CharField(max_length=150)
    text = models.TextField()
    created_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.CheckConstraint(condition=~models.Q(text=""), name="note_text_not_empty"),
        ]
        indexes = [models.Index(fields=["operation", "created_at"], name="note_operation_idx")]
        ordering = ["operation", "created_at", "id"]
        triggers = [AppendOnly(name="operation_note_append_only")]

    def __str__(self):
        return f"note on {self.operation_id} by {self.author_name}"


class SavedView(models.Model):
    """A named filter set of the review queue ("payments stuck > 1 h"), saved by one
    person and shared with everyone who may see its tenant. `filters` holds the queue's
    filter parameters (`ledger.saved_views.FILTER_NAMES`) as text, exactly as the queue's
    URL carries them. Saving the same name again in the same tenant replaces one's own."""

    tenant = models.CharField(max_length=100)
    name = models.CharField(max_length=100)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                              related_name="+")
    owner_name = models.CharField(max_length=150)
    filters = models.JSONField(default=dict)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "owner", "name"],
                                    name="saved_view_name_unique"),
            models.CheckConstraint(condition=~models.Q(name=""), name="saved_view_named"),
        ]
        indexes = [models.Index(fields=["tenant", "name"], name="saved_view_tenant_idx")]

    def __str__(self):
        return f"{self.name} ({self.tenant}, by {self.owner_name})"
