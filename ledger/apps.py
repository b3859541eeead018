from django.apps import AppConfig


class LedgerConfig(AppConfig):
    name = "ledger"
    verbose_name = "Agent Ledger"
    default_auto_field = "django.db.models.BigAutoField"
