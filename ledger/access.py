"""Which tenants a user may see. Superusers see every tenant; a user with no grant, none."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from ledger.errors import PermissionDenied
from ledger.inputs import check_identifier
from ledger.models import TenantAccess, TenantAccessChange


def grant(user, tenant: str, *, by=None) -> TenantAccess:
    """Let `user` see `tenant` (idempotent); a new grant is audited in TenantAccessChange.

    `by` is the person granting it: they need `ledger.add_tenantaccess` and the tenant
    themselves (PermissionDenied otherwise), so nobody hands out a tenant they cannot see.
    Without `by` (code: management commands, the demo seed) the grant is audited with no
    acting user.
    """
    check_identifier(tenant, "tenant", 100)
    if by is not None:
        require_perm(by, "ledger.add_tenantaccess", doing="grant tenant access")
        require_tenant(by, tenant)
    with transaction.atomic():
        access, created = TenantAccess.objects.get_or_create(user=user, tenant=tenant)
        if created:
            _audit(user, tenant, TenantAccessChange.Action.GRANTED, by)
    user._ledger_tenants = None
    return access


def revoke(user, tenant: str, *, by=None) -> bool:
    """Stop `user` seeing `tenant`; returns whether a grant was removed (and audited).

    `by`, the person revoking it, needs `ledger.delete_tenantaccess` and the tenant.
    """
    check_identifier(tenant, "tenant", 100)
    if by is not None:
        require_perm(by, "ledger.delete_tenantaccess", doing="revoke tenant access")
        require_tenant(by, tenant)
    with transaction.atomic():
        deleted, _ = TenantAccess.objects.filter(user=user, tenant=tenant).delete()
        if deleted:
            _audit(user, tenant, TenantAccessChange.Action.REVOKED, by)
    user._ledger_tenants = None
    return bool(deleted)


def _audit(user, tenant: str, action: str, by) -> TenantAccessChange:
    return TenantAccessChange.objects.create(
        user=user, username=user.get_username(), tenant=tenant, action=action, changed_by=by,
        changed_by_name=by.get_username() if by is not None else "", changed_at=timezone.now(),
    )


def tenants_for(user) -> frozenset[str] | None:
    """The tenants `user` may see, or None for every tenant (superusers)."""
    if not user.is_authenticated or not user.is_active:
        return frozenset()
    if user.is_superuser:
        return None
    cached = getattr(user, "_ledger_tenants", None)
    if cached is None:
        cached = frozenset(
            TenantAccess.objects.filter(user=user).values_list("tenant", flat=True)
        )
        user._ledger_tenants = cached
    return cached


def can_see(user, tenant: str) -> bool:
    tenants = tenants_for(user)
    return tenants is None or tenant in tenants


def require_tenant(user, tenant: str) -> None:
    if not can_see(user, tenant):
        raise PermissionDenied(
            f"expected {user.get_username() or 'the user'} to be granted tenant {tenant!r}, "
            "found no such grant"
        )


def require_perm(user, perm: str, *, doing: str) -> None:
    if not user.has_perm(perm):
        raise PermissionDenied(
            f"expected permission {perm} to {doing}, found {user.get_username() or 'the user'} "
            "without it"
        )
