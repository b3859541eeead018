"""Coverage readings: the effects a target's listing showed that no receipt explains."""

import pgtrigger
from django.db import models
from django.db.models.functions import MD5

from ledger.models.triggers import SANCTIONED, Protect

# A later reading of the same tenant, operation name, target and account than `{x}` (the
# order `/metrics` takes the latest by): a reading without one is its key's latest. Over
# `coverage_latest_idx` (the target hashed, as the index has it).
LATER_READING = (
    "EXISTS (SELECT 1 FROM ledger_coveragereading n WHERE n.tenant = {x}.tenant "
    "AND n.operation = {x}.operation AND md5(n.target) = md5({x}.target) "
    "AND n.target = {x}.target AND n.account = {x}.account "
    "AND (n.created_at, n.id) > ({x}.created_at, {x}.id))"
)

# A reading is append-only: only the retention purge deletes one, and never the latest of
# its key (what `/metrics` reports), whatever its age.
_READING_APPEND_ONLY = f"""
    IF TG_OP = 'DELETE' AND {SANCTIONED} AND {LATER_READING.format(x="OLD")} THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
        MESSAGE = format('coverage reading %s (%s on %s): expected readings never to change '
                         'and only the retention purge to delete one, never the latest of its '
                         'target, operation and account, found %s of %s', OLD.id,
                         OLD.operation, OLD.target, TG_OP,
                         CASE WHEN {LATER_READING.format(x="OLD")} THEN 'an older reading'
                              ELSE 'the latest reading' END);
"""


class RetainedReading(Protect):
    """The readings' Protect: refuses every UPDATE, and every DELETE but the retention
    purge's of a reading that is not its key's latest (`_READING_APPEND_ONLY`)."""

    def get_func(self, model):
        return _READING_APPEND_ONLY


class CoverageReading(models.Model):
    """One reading of a target's effects in a time range (`ledger.coverage.read`), with
    those no receipt explains. Append-only: a reading is what was seen, when.

    Retention (`ledger.retention_state`, kind `coverage`) deletes a reading its policy's
    days after it was taken (`created_at`), never the latest of its tenant, operation,
    target and account, whatever its age: PostgreSQL refuses that DELETE, whoever asks.

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
        indexes = [
            models.Index(fields=["created_at", "id"], name="coverage_created_idx"),
            # Whether a later reading of the same key exists (`LATER_READING`: the purge
            # keeps the latest). The target is hashed: a 2,000-character target could
            # exceed a btree entry.
            models.Index("tenant", "operation", MD5("target"), "account", "created_at", "id",
                         name="coverage_latest_idx"),
        ]
        triggers = [
            RetainedReading(name="coverage_reading_append_only",
                            operation=pgtrigger.Update | pgtrigger.Delete),
        ]

    def __str__(self):
        return (f"{self.operation} on {self.target}: {self.unexplained_count} unexplained "
                f"at {self.created_at:%Y-%m-%d %H:%M}")
