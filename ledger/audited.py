"""The one write of a policy row kept with its audit: approval policies
(`ledger.approvals.set_policy`) and unknown-outcome policies
(`ledger.outcome_policies.set_policy`) are rows named by (tenant, pattern), each change
written with an append-only record of before, after and who, in one transaction."""

from __future__ import annotations

from typing import Any

from django.db import models, transaction
from django.utils import timezone


def set_policy_row(model: type[models.Model], change_model: type[models.Model], *,
                   tenant: str, pattern: str, values: dict[str, Any], user,
                   **change: Any) -> models.Model:
    """Create or change the `model` row of (`tenant`, `pattern`) to `values` and record the
    change as a `change_model` row (before, after, who, when, and `change`'s fields, say
    its reason), locked and written in one transaction. The same values again write
    nothing. An existing row is updated in its `values` columns and who and when alone
    (what the desk's role may update: ledger.db_roles)."""
    now = timezone.now()
    with transaction.atomic(durable=True):
        policy = (model.objects.select_for_update()
                  .filter(tenant=tenant, pattern=pattern).first())
        before = None if policy is None else policy.as_audit_dict()
        if policy is None:
            policy = model(pattern=pattern, tenant=tenant, created_at=now)
        for name, value in values.items():
            setattr(policy, name, value)
        if before == policy.as_audit_dict():
            return policy
        policy.updated_by = user
        policy.updated_at = now
        if before is None:
            policy.save()
        else:
            policy.save(update_fields=[*values, "updated_by", "updated_at"])
        change_model.objects.create(
            tenant=tenant, pattern=pattern, before=before, after=policy.as_audit_dict(),
            changed_by=user, changed_by_name=user.get_username(), changed_at=now, **change,
        )
    return policy
