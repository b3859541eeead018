"""Approval before a consequential call: policies, requests, and the decisions on them.

A policy names operations (a glob over the name, per tenant) that must not be submitted
before enough people approved the exact intent: an approval records the fingerprint and
the version it saw, and counts only for that fingerprint until it expires. PostgreSQL
checks it again on every planned -> submitted (`gate_sql`, used by the trigger on
`ledger_operation` and by `ledger.approvals.check_can_submit` alike).
"""

from django.conf import settings
from django.db import models

from ledger.models.approval_gate import APPROVAL_REQUEST_TRIGGER
from ledger.models.changes import ChangeRecord
from ledger.models.operations import AppendOnly


class ApprovalPolicy(models.Model):
    """Operations of `tenant` whose name matches `pattern` wait for approval before they are
    sent. Change rows only through `ledger.approvals.set_policy`, which audits the change.

    `pattern` is a glob over the operation name (`*` any run of characters, `?` one).
    Consequential patterns take two different people, whatever `approvals_needed` says.
    """

    pattern = models.CharField(max_length=200)
    tenant = models.CharField(max_length=100, default="default")
    requires_approval = models.BooleanField(default=True)
    approvals_needed = models.PositiveSmallIntegerField(default=1)
    approval_ttl = models.DurationField(
        help_text="How long an approval stays valid; an expired one no longer counts."
    )
    consequential = models.BooleanField(
        default=False, help_text="Two different people: a proposer and an approver."
    )
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "pattern"], name="approval_policy_unique"),
            models.CheckConstraint(condition=models.Q(approvals_needed__in=[1, 2]),
                                   name="approval_policy_needs_one_or_two"),
        ]
        ordering = ["tenant", "pattern"]
        verbose_name_plural = "approval policies"

    def __str__(self):
        return f"{self.pattern} ({self.tenant})"

    @property
    def people_needed(self) -> int:
        return max(self.approvals_needed, 2) if self.consequential else self.approvals_needed

    def as_audit_dict(self) -> dict:
        return {
            "pattern": self.pattern, "tenant": self.tenant,
            "requires_approval": self.requires_approval,
            "approvals_needed": self.approvals_needed,
            "approval_ttl_seconds": int(self.approval_ttl.total_seconds()),
            "consequential": self.consequential,
        }


class ApprovalPolicyChange(ChangeRecord):
    """Who set an approval policy, what it was before and after. Append-only."""

    tenant = models.CharField(max_length=100)
    pattern = models.CharField(max_length=200)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField()
    changed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )

    class Meta:
        ordering = ["-changed_at", "-id"]
        triggers = [AppendOnly(name="approval_policy_change_append_only")]

    def __str__(self):
        return f"{self.pattern} ({self.tenant}) by {self.changed_by_name}"


class ApprovalRequest(models.Model):
    """An agent's request that a person look at a planned operation before it is sent.

    One per operation; `status` follows the decisions (the decisions themselves are the
    append-only Approval rows). `approvals_needed` is what the policies asked when it was
    requested, at least 1: an operation whose agent asked stays gated even if no policy
    matches (PostgreSQL reads it too).

    PostgreSQL holds the rules of who writes what (`APPROVAL_REQUEST_TRIGGER`): an agent
    creates a pending request, for the operation's own tenant, asking at least what the
    policies ask; only the desk marks it approved (enough live approvals) or denied.
    """

    class Status(models.TextChoices):
        PENDING = "pending", "Awaiting approval"
        APPROVED = "approved", "Approved"
        DENIED = "denied", "Denied"

    operation = models.OneToOneField(
        "ledger.Operation", on_delete=models.CASCADE, related_name="approval_request"
    )
    tenant = models.CharField(max_length=100)
    note = models.TextField(blank=True)
    requested_by = models.CharField(max_length=200, blank=True)
    approvals_needed = models.PositiveSmallIntegerField(default=1)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    requested_at = models.DateTimeField()
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["requested_at", "id"], name="approval_request_pending_idx",
                         condition=models.Q(status="pending")),
        ]
        triggers = [APPROVAL_REQUEST_TRIGGER]

    def __str__(self):
        return f"approval of {self.operation_id}: {self.status}"


class Approval(models.Model):
    """One person's decision on one planned operation, bound to the intent they saw.

    Append-only. An approval counts for `intent_fingerprint` only, until `expires_at`; an
    edited approval (`edited_from` set) changed the operation's intent to this one.
    """

    class Decision(models.TextChoices):
        APPROVE = "approve", "Approved"
        DENY = "deny", "Denied"

    operation = models.ForeignKey(
        "ledger.Operation", on_delete=models.CASCADE, related_name="approvals"
    )
    tenant = models.CharField(max_length=100)
    decision = models.CharField(max_length=10, choices=Decision.choices)
    intent_fingerprint = models.CharField(max_length=80)
    version = models.PositiveIntegerField(help_text="The operation's version the person saw.")
    edited_from = models.CharField(max_length=80, blank=True,
                                   help_text="The fingerprint this approval replaced.")
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT,
                                   related_name="+")
    decided_by_name = models.CharField(max_length=150)
    reason = models.TextField(blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.CheckConstraint(condition=models.Q(decision__in=["approve", "deny"]),
                                   name="approval_decision_known"),
            models.CheckConstraint(
                condition=models.Q(decision="deny") | models.Q(expires_at__isnull=False),
                name="approval_approve_expires",
            ),
        ]
        indexes = [
            models.Index(fields=["operation", "intent_fingerprint", "expires_at"],
                         name="approval_live_idx"),
        ]
        ordering = ["operation", "created_at", "id"]
        triggers = [AppendOnly(name="approval_append_only")]

    def __str__(self):
        return f"{self.decision} {self.operation_id} by {self.decided_by_name}"


class ResolutionProposal(models.Model):
    """The first of two people's `receipts.resolve` on an operation that takes two: a
    consequential policy matches it, or it is safe_to_retry on a `never` operation.

    Append-only. The latest proposal at the operation's current version is the pending one;
    a different person's resolve with the same decision at that version completes it (its
    event names both), and PostgreSQL refuses such a decision without one
    (`ledger.models.approval_gate.TWO_PERSON_TRIGGER`). A proposal of an older version is
    stale: the operation changed after the proposer looked.
    """

    operation = models.ForeignKey(
        "ledger.Operation", on_delete=models.CASCADE, related_name="proposals"
    )
    tenant = models.CharField(max_length=100)
    to_state = models.CharField(max_length=20)
    version = models.PositiveIntegerField(help_text="The operation's version the person saw.")
    external_id = models.CharField(max_length=500, blank=True)
    proposed_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT,
                                    related_name="+")
    proposed_by_name = models.CharField(max_length=150)
    reason = models.TextField()
    created_at = models.DateTimeField()

    class Meta:
        indexes = [
            models.Index(fields=["operation", "version", "created_at"],
                         name="resolution_proposal_op_idx"),
        ]
        ordering = ["operation", "created_at", "id"]
        triggers = [AppendOnly(name="resolution_proposal_append_only")]

    def __str__(self):
        return f"proposed: {self.to_state} by {self.proposed_by_name}, needs a second person"
