from django.apps import AppConfig


class DemoConfig(AppConfig):
    """The project's demo: `manage.py demo_seed` and the simulated articles service."""

    name = "demo"
    verbose_name = "Agent Ledger demo"
