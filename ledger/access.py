"""Which tenants a user may see. Superusers see every tenant; a user with no grant, none."""

from __future__ import annotations

from ledger.errors import PermissionDenied
from ledger.inputs import check_text
from ledger.models import TenantAccess


def grant(user, tenant: str) -> TenantAccess:
    """Let `user` see `tenant` (idempotent)."""
    check_text(tenant, "tenant", 100)
    access, _ = TenantAccess.objects.get_or_create(user=user, tenant=tenant)
    user._ledger_tenants = None
    return access


def revoke(user, tenant: str) -> bool:
    """Stop `user` seeing `tenant`; returns whether a grant was removed."""
    deleted, _ = TenantAccess.objects.filter(user=user, tenant=tenant).delete()
    user._ledger_tenants = None
    return bool(deleted)


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
