"""The audit trail's hash chains: each chain's head, the anchors a purge leaves where the
chain resumes, and the record of each verification (`ledger.chain`)."""

import pgtrigger
from django.db import models

from ledger.models.retention import PurgeRun
from ledger.models.triggers import Protect


class ChainHead(models.Model):
    """The latest link of one hash chain (`chain`, per tenant): its sequence and hash.

    Written only by the upsert of `ledger.chain.link` (and its CTE in the statements of
    `ledger.transitions`), which locks this row so concurrent writers of one tenant take
    turns and never fork the chain.
    """

    chain = models.CharField(max_length=40)
    tenant = models.CharField(max_length=100)
    seq = models.BigIntegerField()
    hash = models.CharField(max_length=64)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["chain", "tenant"], name="chain_head_unique"),
        ]
        ordering = ["chain", "tenant"]

    def __str__(self):
        return f"{self.chain}/{self.tenant} at {self.seq}: {self.hash[:12]}"


class ChainAnchor(models.Model):
    """The seq and hash of a purged link whose successor remains: the chain resumes here.

    Written by the purge in the batch that deleted the link. Append-only.
    """

    chain = models.CharField(max_length=40)
    tenant = models.CharField(max_length=100)
    seq = models.BigIntegerField()
    hash = models.CharField(max_length=64)
    purge_run = models.ForeignKey(PurgeRun, on_delete=models.PROTECT, related_name="anchors")
    created_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["chain", "tenant", "seq"], name="chain_anchor_unique"),
        ]
        ordering = ["chain", "tenant", "seq"]
        triggers = [
            Protect(
                name="chain_anchor_append_only", operation=pgtrigger.Update | pgtrigger.Delete
            ),
        ]

    def __str__(self):
        return f"anchor {self.chain}/{self.tenant} at {self.seq}"


class AuditVerification(models.Model):
    """One run of `manage.py verify_audit`: what it checked and the first broken link."""

    actor = models.CharField(max_length=200)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    links_checked = models.PositiveBigIntegerField()
    is_intact = models.BooleanField()
    first_break = models.JSONField(null=True, blank=True)
    # Per chain and tenant: seq, hash, links_checked, is_intact, and for operation events
    # the operations and evidence rows checked against them (ledger.chain.verify).
    heads = models.JSONField(default=list)

    class Meta:
        ordering = ["-finished_at", "-id"]

    def __str__(self):
        verdict = "intact" if self.is_intact else "BROKEN"
        return f"verified {self.finished_at:%Y-%m-%d %H:%M}: {verdict}"


class AuditCheckpoint(models.Model):
    """A chain head signed with the ledger's audit key (Ed25519, `LEDGER_AUDIT_SIGNING_KEY`):
    `manage.py audit_export` signs each tenant's head and keeps the signature here, and
    every later export and verification holds the chain to it (ledger.audit_bundle). The
    database's owner may delete a row, but cannot sign another: a chain re-linked or cut
    back behind a checkpoint that remains is a break. Append-only."""

    chain = models.CharField(max_length=40)
    tenant = models.CharField(max_length=100)
    seq = models.BigIntegerField()
    hash = models.CharField(max_length=64)
    signed_at = models.DateTimeField()
    # The first 16 hex digits of the sha256 of the raw public key that verifies it.
    key_id = models.CharField(max_length=16)
    signature = models.CharField(max_length=128)  # hex of the 64-byte Ed25519 signature

    class Meta:
        ordering = ["chain", "tenant", "seq", "id"]
        triggers = [
            Protect(name="audit_checkpoint_append_only",
                    operation=pgtrigger.Update | pgtrigger.Delete),
        ]

    def __str__(self):
        return f"checkpoint {self.chain}/{self.tenant} at {self.seq} ({self.signed_at:%Y-%m-%d})"
