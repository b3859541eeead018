"""Coverage readings: the effects a target's listing showed that no receipt explains."""

from django.db import models

from ledger.models.operations import AppendOnly


class CoverageReading(models.Model):
    """One reading of a target's effects in a time range (`ledger.coverage.read`), with
    those no receipt explains. Append-only: a reading is what was seen, when.

    Nothing here is an operation: an unexplained effect was made around the ledger (by hand,
    by another tool, by a bug), and the ledger records that it saw it, never a receipt
    for it.
    """

    tenant = models.CharField(max_length=100, default="default")
    operation = models.CharField(max_length=200)
    target = models.CharField(max_length=2000)
    account = models.CharField(max_length=200, blank=True, default="")
    since = models.DateTimeField()
    until = models.DateTimeField()
    reconciler = models.CharField(max_length=200)
    # What was asked (the request, the bound) and how much it listed.
    query = models.JSONField(default=dict)
    listed = models.PositiveIntegerField(default=0)
    # False when the listing hit its bound: more effects may exist than it showed.
    complete = models.BooleanField(default=True)
    explained = models.PositiveIntegerField(default=0)
    # [{"external_id", "idempotency_key", "at", "item"}] of the effects no receipt explains.
    unexplained = models.JSONField(default=list)
    unexplained_count = models.PositiveIntegerField(default=0)
    # An error instead of a listing ("" when it listed).
    error = models.TextField(blank=True, default="")
    read_by = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["created_at", "id"], name="coverage_created_idx")]
        triggers = [AppendOnly(name="coverage_reading_append_only")]

    def __str__(self):
        return (f"{self.operation} on {self.target}: {self.unexplained_count} unexplained "
                f"at {self.created_at:%Y-%m-%d %H:%M}")
