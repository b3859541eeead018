from django.apps import AppConfig


class LedgerConfig(AppConfig):
    name = "ledger"
    verbose_name = "Agent Ledger"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from django.core import checks
        from django.db.backends.signals import connection_created
        from django.db.models.signals import post_migrate

        from ledger import conf, notifications  # noqa: F401 (registers its metrics)
        from ledger.roles import restore_after_flush

        checks.register(conf.check_settings)
        from ledger import validation

        checks.register(validation.check_rule_setting)
        from ledger import db_roles

        checks.register(db_roles.check_login, deploy=True)
        # PostgreSQL's refusals on role grounds are ledger PermissionDenied (403), never 500
        connection_created.connect(db_roles.install, dispatch_uid="ledger.db_roles.install")

        # Bootstrap data only (groups, the default policy), as Django does for permissions.
        post_migrate.connect(restore_after_flush, sender=self,
                             dispatch_uid="ledger.roles.restore_after_flush")
