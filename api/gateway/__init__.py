"""The MCP gateway: receipts for every consequential tool call of any MCP server.

    from api.gateway import Gateway, Principal, load_config

    gateway = Gateway(load_config("gateway.toml"), principal=Principal(secret))
    async with gateway.connected():      # opens the upstream, checks the config against it
        await gateway.serve_stdio()      # or serve gateway.streamable_http_app() with uvicorn

`manage.py mcp_gateway --config gateway.toml` does the same from the command line
(docs/agents/gateway.md). `api.gateway.reconcilers` registers the configured read-tool
reconcilers for `manage.py reconcile` (setting LEDGER_GATEWAY_CONFIGS).
"""

from api.agent import Principal
from api.gateway.config import Config, ConfigError
from api.gateway.config import load as load_config
from api.gateway.server import Gateway
from api.gateway.upstream import UpstreamUnreachable

__all__ = ["Config", "ConfigError", "Gateway", "Principal", "UpstreamUnreachable",
           "load_config"]
