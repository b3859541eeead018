"""Agent keys: the credentials of agents that reach the ledger over the network."""

from __future__ import annotations

import pgtrigger
from django.conf import settings
from django.db import models

from ledger.models.changes import ChangeRecord
from ledger.models.triggers import Protect


class AgentKey(models.Model):
    """One agent's bearer key. Only a SHA-256 of the secret is stored; the secret itself is
    shown once, by `agent_keys.create`.

    A key acts as a principal wherever the ledger asks who is acting (`ledger.access`): it
    is authenticated while not revoked, sees exactly its `tenants`, holds no permission,
    and its `name` is the actor recorded on every event it causes.
    """

    name = models.CharField(max_length=100, unique=True)
    # The secret's first characters ("alk_3f9a"), so a person can tell keys apart in logs
    # and on admin pages without the secret.
    prefix = models.CharField(max_length=16)
    secret_hash = models.CharField(max_length=64, unique=True)
    tenants = models.JSONField()  # a non-empty list of tenant names
    created_by_name = models.CharField(max_length=150)
    created_at = models.DateTimeField()
    revoked_by_name = models.CharField(max_length=150, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    # A key is never a superuser; the ledger's tenant checks read `_ledger_tenants`.
    is_authenticated = True
    is_anonymous = False
    is_superuser = False

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return f"{self.name} ({self.prefix}…)"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None

    @property
    def _ledger_tenants(self) -> frozenset[str]:
        # What `ledger.access.tenants_for` caches for a user, here straight from the row.
        return frozenset(self.tenants)

    def get_username(self) -> str:
        return self.name

    def has_perm(self, perm: str, obj=None) -> bool:
        """Keys act as agents: no desk or admin permission, ever."""
        return False


class AgentKeyChange(ChangeRecord):
    """Who created or revoked an agent key, and when. Append-only."""

    class Action(models.TextChoices):
        CREATED = "created", "Created"
        REVOKED = "revoked", "Revoked"

    # DO_NOTHING without a constraint, like RetentionChange: the audit row outlives the user.
    key = models.ForeignKey(
        AgentKey, on_delete=models.DO_NOTHING, related_name="changes", db_constraint=False
    )
    key_name = models.CharField(max_length=100)
    action = models.CharField(max_length=20, choices=Action.choices)
    tenants = models.JSONField()
    changed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.DO_NOTHING, related_name="+",
        db_constraint=False,
    )

    class Meta:
        ordering = ["-changed_at", "-id"]
        triggers = [
            Protect(
                name="agent_key_change_append_only",
                operation=pgtrigger.Update | pgtrigger.Delete,
            ),
        ]

    def __str__(self):
        return f"{self.changed_by_name} {self.action} {self.key_name}"
