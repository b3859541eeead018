"""The roles (groups viewer, reviewer, admin) and the data every ledger database starts with.

The migrations create them (each migration keeps the frozen list it added). A flush (the
end of every transactional test, `manage.py flush`) empties those tables and is followed by
`post_migrate`, so `ledger.apps` restores them here: the groups with their permissions and
the default retention policies. Only ever adds what is missing; never removes a grant an
admin made.
"""

from __future__ import annotations

_VIEW = [
    "view_operation", "view_operationevent", "view_evidence", "view_run", "view_step",
    "view_lease", "view_fact", "view_factconflict", "view_factdecision", "view_obligation",
    "view_episode", "view_chainhead", "view_auditverification",
    "view_approval", "view_approvalrequest", "view_resolutionproposal",
]
_REVIEW = ["resolve_operation", "resolve_factconflict"]
_ADMIN = [
    "override_retry_policy",
    "view_tenantaccess", "add_tenantaccess", "change_tenantaccess", "delete_tenantaccess",
    "view_tenantaccesschange",
    "change_run",
    "view_retentionpolicy", "add_retentionpolicy", "change_retentionpolicy",
    "delete_retentionpolicy", "view_retentionchange", "view_purgerun", "view_redaction",
    "view_chainanchor",
    "view_agentkey", "add_agentkey", "change_agentkey", "view_agentkeychange",
    "view_approvalpolicy", "add_approvalpolicy", "change_approvalpolicy",
    "view_approvalpolicychange",
    "view_unknownoutcomepolicy", "add_unknownoutcomepolicy", "change_unknownoutcomepolicy",
    "view_unknownoutcomepolicychange",
    "view_notificationchannel", "add_notificationchannel", "change_notificationchannel",
    "view_notificationchannelchange", "view_notificationbatch", "view_deliveryattempt",
    "view_notificationsent",
]

# The current permissions of each role: the union of what the migrations granted.
ROLE_PERMISSIONS: dict[str, list[str]] = {
    "viewer": _VIEW,
    "reviewer": _VIEW + _REVIEW,
    "admin": _VIEW + _REVIEW + _ADMIN,
}


def ensure_roles() -> None:
    """Create missing groups and add their missing ledger permissions (idempotent)."""
    from django.contrib.auth.models import Group, Permission

    wanted = {code for codes in ROLE_PERMISSIONS.values() for code in codes}
    perms = {
        p.codename: p
        for p in Permission.objects.filter(content_type__app_label="ledger",
                                           codename__in=wanted)
    }
    missing = wanted - perms.keys()
    if missing:
        raise RuntimeError(f"expected ledger permissions {sorted(missing)} to exist, found none")
    for name, codenames in ROLE_PERMISSIONS.items():
        group, _ = Group.objects.get_or_create(name=name)
        group.permissions.add(*(perms[code] for code in codenames))


DEFAULT_POLICY = {"pattern": "*", "tenant": "", "purge_after_days": 365,
                  "redact_after_days": 90, "keep_events_days": 365}


def ensure_default_policy() -> None:
    """The catch-all retention policy, if a flush removed it (audited like any other)."""
    from django.utils import timezone

    from ledger.models import RetentionChange, RetentionPolicy

    now = timezone.now()
    policy, created = RetentionPolicy.objects.get_or_create(
        pattern="*", tenant="", defaults={**DEFAULT_POLICY, "created_at": now, "updated_at": now}
    )
    if created:
        RetentionChange.objects.create(
            policy_id=policy.pk, action="created", changed_by_name="ledger bootstrap",
            before=None, after=DEFAULT_POLICY, changed_at=now,
        )


# The execution state's policies for every tenant (migrations 0038 and 0058 keep their own
# copies).
DEFAULT_STATE_POLICIES = {"facts": 365, "episodes": 90, "obligations": 365, "coverage": 90}


def ensure_default_state_policies() -> None:
    """The execution state's policies for every tenant, if a flush removed them (audited)."""
    from django.utils import timezone

    from ledger.models import RetentionChange, StateRetentionPolicy

    now = timezone.now()
    for kind, days in DEFAULT_STATE_POLICIES.items():
        policy, created = StateRetentionPolicy.objects.get_or_create(
            kind=kind, tenant="", defaults={"purge_after_days": days, "created_at": now,
                                            "updated_at": now})
        if created:
            RetentionChange.objects.create(
                state_policy_id=policy.pk, action="created", changed_by_name="ledger bootstrap",
                before=None, after={"kind": kind, "tenant": "", "purge_after_days": days},
                changed_at=now)


def restore_after_flush(sender, **kwargs) -> None:
    """post_migrate receiver: the permissions exist by now (auth's receiver runs first)."""
    from django.db import connections

    if sender.name != "ledger":
        return
    tables = connections[kwargs.get("using", "default")].introspection.table_names()
    if "ledger_retentionpolicy" not in tables:  # migrated back below the ledger's schema
        return
    ensure_roles()
    ensure_default_policy()
    if "ledger_stateretentionpolicy" in tables:
        ensure_default_state_policies()
