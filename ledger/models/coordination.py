"""Runs, steps, leases and tenant grants: what coordinates agents and people."""

from django.conf import settings
from django.db import models


class Run(models.Model):
    """One task an agent works on; operations, steps and facts hang off it."""

    run_id = models.CharField(max_length=100, unique=True)
    tenant = models.CharField(max_length=100, default="default", db_index=True)
    objective = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return self.run_id

    @property
    def lease_resource(self) -> str:
        return f"run:{self.run_id}"


class Step(models.Model):
    """A step of a run; an operation may name the step it belongs to."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="steps")
    step_id = models.CharField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "step_id"], name="step_unique_per_run")
        ]
        ordering = ["run", "id"]

    def __str__(self):
        return f"{self.run.run_id}/{self.step_id}"


class Lease(models.Model):
    """A time-limited claim on a resource. `token` only ever grows (fencing)."""

    resource = models.CharField(max_length=200, unique=True)
    owner = models.CharField(max_length=200)
    token = models.BigIntegerField()
    acquired_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        ordering = ["resource"]

    def __str__(self):
        return f"{self.resource} held by {self.owner} (token {self.token})"


class TenantAccess(models.Model):
    """A user may see the operations of `tenant`. Superusers see every tenant."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tenant_grants"
    )
    tenant = models.CharField(max_length=100)
    granted_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant"], name="tenant_access_unique")
        ]
        verbose_name = "tenant access"
        verbose_name_plural = "tenant access"

    def __str__(self):
        return f"{self.user} may see {self.tenant}"
