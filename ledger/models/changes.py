"""What every audit trail of changes made by people shares (agent keys, retention policies,
approval policies, notification channels): who changed it, by name (kept when the user
is deleted), and when. Each trail adds what changed and its own `changed_by` key, whose
deletion rule differs from trail to trail."""

from django.db import models


class ChangeRecord(models.Model):
    changed_by_name = models.CharField(max_length=150)
    changed_at = models.DateTimeField()

    class Meta:
        abstract = True
