from django.apps import AppConfig


class ApiConfig(AppConfig):
    """The ledger over the network: the HTTP API (/api/v1/) and the MCP server (/mcp,
    `manage.py mcp`). Thin: every rule lives in `ledger`."""

    name = "api"
    verbose_name = "Agent API"
