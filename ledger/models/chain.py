"""The audit trail's hash chains: each chain's head, the anchors a purge leaves where the
chain resumes, and the record of each verification (`ledger.chain`)."""

import pgtrigger
from django.db import models
from django.db.models.functions import Now

from ledger.chain_content import RECORD_LINK_INSERT_SQL, sealed_once_sql
from ledger.models.operations import AppendOnly
from ledger.models.retention import PurgeRun
from ledger.models.triggers import Protect, Trigger


class ChainHead(models.Model):
    """The latest link of one hash chain (`chain`, per tenant): its sequence and hash.

    Moved by the sealer's functions (`ledger_seal_events`, `ledger_seal_links`), which lock
    this row and check it is where the sealer linked from, so two sealers never fork a chain.
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


class RecordLink(models.Model):
    """One INSERT, UPDATE or DELETE of a row people rely on (an approval, a note, a grant,
    a fact, ...: `ledger.chain_content.RECORD_SOURCES`), as PostgreSQL saw it: written by
    the trigger `ledger_record_link` of that row's table (migration 0049) and by nothing
    else, with the row's content (per column, a digest) computed from the row itself; linked
    into its tenant's "records" chain by the sealer. Append-only."""

    tenant = models.CharField(max_length=100)
    source = models.CharField(max_length=40)
    row_id = models.BigIntegerField()
    action = models.CharField(max_length=10)  # insert, update, delete
    content = models.JSONField(null=True, blank=True)  # None for a delete
    # The row's content before an update or delete (None for an insert): it must be what the
    # link before it recorded, so a change made out of band is not absorbed by a later one.
    before = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    chain_seq = models.BigIntegerField(null=True, blank=True)
    chain_hash = models.CharField(max_length=64, null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "chain_seq"],
                                    name="record_link_chain_seq_unique"),
            models.CheckConstraint(condition=models.Q(action__in=["insert", "update", "delete"]),
                                   name="record_link_action_known"),
        ]
        indexes = [
            models.Index(fields=["source", "row_id", "id"], name="record_link_row_idx"),
            models.Index(fields=["tenant", "id"], name="record_link_unsealed_idx",
                         condition=models.Q(chain_seq__isnull=True)),
        ]
        ordering = ["id"]
        triggers = [
            AppendOnly(name="record_link_append_only", sealed=True),
            Trigger(name="record_link_sealed_once", operation=pgtrigger.Update,
                    when=pgtrigger.Before, func=sealed_once_sql("record link")),
            Trigger(name="record_link_written_by_postgres", operation=pgtrigger.Insert,
                    when=pgtrigger.Before, func=RECORD_LINK_INSERT_SQL),
        ]

    def __str__(self):
        return f"{self.action} {self.source} {self.row_id} ({self.tenant})"
