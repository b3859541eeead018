"""Notifications: where to tell people that items wait for them, and what was told.

A channel (webhook or e-mail) of one tenant names operations by a glob (`payments.*`) and the
reasons it is told about: an item entered the review queue, an item awaits approval, an item
has waited longer than `stuck_after`. `ledger.notifications` writes every row; a channel's
changes are audited (`NotificationChannelChange`, append-only).

A webhook's HMAC secret never reaches the database: `secret_name` names a key of the setting
`LEDGER_WEBHOOK_SECRETS` (filled from environment variables `LEDGER_WEBHOOK_SECRET_<NAME>`).

Once per item, reason and channel: `NotificationSent` has one row per (channel, reason, item),
unique in PostgreSQL, inserted with ON CONFLICT DO NOTHING, so two notify workers and a
restart never tell twice. Each pass groups what it inserted into one `NotificationBatch` per
channel (one message, however many items); every delivery attempt is a `DeliveryAttempt`
(append-only).
"""

from django.conf import settings
from django.db import models

from ledger.models.changes import ChangeRecord
from ledger.models.operations import AppendOnly


class NotificationChannel(models.Model):
    """One place to tell: a webhook URL or e-mail recipients, for one tenant and one
    operation-name glob. Never deleted (its deliveries refer to it): disabled instead.
    Change rows only through `ledger.notifications`, which audits the change."""

    class Kind(models.TextChoices):
        WEBHOOK = "webhook", "Webhook"
        EMAIL = "email", "E-mail"

    tenant = models.CharField(max_length=100, default="default")
    name = models.CharField(max_length=100)
    kind = models.CharField(max_length=10, choices=Kind.choices)
    pattern = models.CharField(max_length=200, default="*",
                               help_text="Glob over the operation name: * any run, ? one.")
    url = models.CharField(max_length=2000, blank=True,
                           help_text="Webhook: where the JSON is POSTed (no credentials in it).")
    secret_name = models.CharField(
        max_length=100, blank=True,
        help_text="Webhook: the key of LEDGER_WEBHOOK_SECRETS holding the HMAC secret "
                  "(environment LEDGER_WEBHOOK_SECRET_<NAME>); the secret is never stored.")
    recipients = models.JSONField(default=list, blank=True,
                                  help_text="E-mail: the addresses to send to.")
    on_queue = models.BooleanField(default=True, help_text="An item entered the review queue.")
    on_approval = models.BooleanField(default=True, help_text="An item awaits approval.")
    stuck_after = models.DurationField(
        null=True, blank=True, help_text="An item waited longer than this (empty: never).")
    is_active = models.BooleanField(default=True)
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="notification_channel_unique"),
            models.CheckConstraint(condition=models.Q(kind__in=["webhook", "email"]),
                                   name="notification_channel_kind_known"),
            models.CheckConstraint(
                condition=models.Q(kind="email") | (~models.Q(url="") & ~models.Q(secret_name="")),
                name="notification_webhook_has_url_and_secret_name",
            ),
            # A credential in the URL would be stored: PostgreSQL refuses userinfo too.
            models.CheckConstraint(condition=~models.Q(url__regex=r"^[^/?#]*//[^/?#]*@"),
                                   name="notification_url_without_userinfo"),
        ]
        ordering = ["tenant", "name"]

    def __str__(self):
        return f"{self.name} ({self.kind}, {self.tenant})"

    def as_audit_dict(self) -> dict:
        return {
            "tenant": self.tenant, "name": self.name, "kind": self.kind,
            "pattern": self.pattern, "url": self.url, "secret_name": self.secret_name,
            "recipients": list(self.recipients), "on_queue": self.on_queue,
            "on_approval": self.on_approval,
            "stuck_after_seconds": (None if self.stuck_after is None
                                    else int(self.stuck_after.total_seconds())),
            "is_active": self.is_active,
        }

    @property
    def destination(self) -> str:
        return self.url if self.kind == self.Kind.WEBHOOK else ", ".join(self.recipients)


class NotificationChannelChange(ChangeRecord):
    """Who changed a notification channel, what it was before and after. Append-only."""

    channel = models.ForeignKey(NotificationChannel, on_delete=models.PROTECT,
                                related_name="changes")
    tenant = models.CharField(max_length=100)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField()
    changed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )

    class Meta:
        ordering = ["-changed_at", "-id"]
        triggers = [AppendOnly(name="notification_channel_change_append_only")]

    def __str__(self):
        return f"{self.channel_id} changed by {self.changed_by_name}"


class NotificationBatch(models.Model):
    """One message to one channel: the items one pass found, with counts per reason.

    `payload` is what is sent on every attempt (the same body, so a receiver may de-duplicate
    on the delivery id). `pending` until delivered, retried with backoff (`next_attempt_at`),
    `failed` after the last allowed attempt.
    """

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        DELIVERED = "delivered", "Delivered"
        FAILED = "failed", "Failed"

    channel = models.ForeignKey(NotificationChannel, on_delete=models.PROTECT,
                                related_name="batches")
    tenant = models.CharField(max_length=100)
    item_count = models.PositiveIntegerField(default=0)
    counts = models.JSONField(default=dict)
    payload = models.JSONField(default=dict)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField()
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(status__in=["pending", "delivered", "failed"]),
                name="notification_batch_status_known"),
        ]
        indexes = [
            models.Index(fields=["next_attempt_at", "id"], name="notification_batch_due_idx",
                         condition=models.Q(status="pending")),
        ]
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "notification batches"

    def __str__(self):
        return f"batch {self.pk} to {self.channel_id}: {self.item_count} item(s), {self.status}"


class NotificationSent(models.Model):
    """That `item_key` was told to `channel` for `reason` (in `batch`): at most one row per
    (channel, reason, item), so an item is never told twice for the same reason."""

    class Reason(models.TextChoices):
        QUEUE = "queue", "Entered the review queue"
        APPROVAL = "approval", "Awaits approval"
        STUCK = "stuck", "Waiting longer than the threshold"

    channel = models.ForeignKey(NotificationChannel, on_delete=models.PROTECT,
                                related_name="+")
    batch = models.ForeignKey(NotificationBatch, on_delete=models.PROTECT, related_name="items")
    reason = models.CharField(max_length=10, choices=Reason.choices)
    # An operation's operation_id, or "conflict:<id>" for a fact conflict.
    item_key = models.CharField(max_length=60)
    operation = models.ForeignKey("ledger.Operation", null=True, blank=True,
                                  on_delete=models.CASCADE, related_name="+")
    waiting_since = models.DateTimeField()
    created_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["channel", "reason", "item_key"],
                                    name="notification_sent_once"),
        ]
        indexes = [models.Index(fields=["operation"], name="notification_sent_op_idx")]

    def __str__(self):
        return f"{self.item_key} told to {self.channel_id} ({self.reason})"


class DeliveryAttempt(models.Model):
    """One try to deliver a batch: what came back and how long it took. Append-only."""

    batch = models.ForeignKey(NotificationBatch, on_delete=models.PROTECT,
                              related_name="deliveries")
    channel = models.ForeignKey(NotificationChannel, on_delete=models.PROTECT,
                                related_name="+")
    tenant = models.CharField(max_length=100)
    attempt = models.PositiveIntegerField()
    is_ok = models.BooleanField()
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    duration_ms = models.PositiveIntegerField()
    worker = models.CharField(max_length=200, blank=True)
    started_at = models.DateTimeField()

    class Meta:
        indexes = [
            models.Index(fields=["started_at", "id"], name="delivery_attempt_time_idx"),
            models.Index(fields=["id"], name="delivery_attempt_failed_idx",
                         condition=models.Q(is_ok=False)),
        ]
        ordering = ["-started_at", "-id"]
        triggers = [AppendOnly(name="delivery_attempt_append_only")]

    def __str__(self):
        outcome = "ok" if self.is_ok else "failed"
        return f"attempt {self.attempt} of batch {self.batch_id}: {outcome}"
