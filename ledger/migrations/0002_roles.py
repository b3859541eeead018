"""Groups viewer, reviewer and admin with the ledger's permissions."""

from django.db import migrations

VIEW = [
    "view_operation", "view_operationevent", "view_evidence", "view_run", "view_step",
    "view_lease",
]
ROLES = {
    "viewer": VIEW,
    "reviewer": VIEW + ["resolve_operation"],
    "admin": VIEW + [
        "resolve_operation", "override_retry_policy",
        "view_tenantaccess", "add_tenantaccess", "change_tenantaccess", "delete_tenantaccess",
        "change_run",
    ],
}


def create_roles(apps, schema_editor):
    from django.contrib.auth.management import create_permissions

    # Permissions normally appear after migrate; this migration needs them now.
    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None

    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for name, codenames in ROLES.items():
        group, _ = Group.objects.get_or_create(name=name)
        perms = Permission.objects.filter(content_type__app_label="ledger", codename__in=codenames)
        missing = set(codenames) - set(perms.values_list("codename", flat=True))
        if missing:
            raise RuntimeError(f"expected permissions {sorted(missing)} to exist, found none")
        group.permissions.add(*perms)


def remove_roles(apps, schema_editor):
    apps.get_model("auth", "Group").objects.filter(name__in=ROLES).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("ledger", "0001_initial"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [migrations.RunPython(create_roles, remove_roles)]
