"""manage.py mcp_gateway --config gateway.toml [--http HOST:PORT]: the MCP gateway."""

import os

import anyio
from django.core.management.base import BaseCommand, CommandError

from api.gateway import ConfigError, Gateway, Principal, UpstreamUnreachable, load_config
from api.gateway import config as cfg
from ledger.errors import LedgerError

ENV_KEY = "LEDGER_AGENT_KEY"


class Command(BaseCommand):
    help = ("Serve an upstream MCP server's tools through the ledger: every consequential "
            "tool call gets a receipt (docs/agents/gateway.md). Over stdio the agent key "
            f"comes from ${ENV_KEY}; over --http each client sends its own as a bearer token.")

    def add_arguments(self, parser):
        parser.add_argument("--config", required=True, help="the gateway's TOML file")
        parser.add_argument("--http", default="", metavar="HOST:PORT",
                            help="serve Streamable HTTP at http://HOST:PORT/mcp instead of "
                                 "stdio")
        parser.add_argument("--check", action="store_true",
                            help="connect to the upstream, check the configuration, print "
                                 "what each upstream tool becomes (receipted or "
                                 "pass-through, and why), exit")

    def handle(self, *args, config, http, check, **options):
        try:
            gateway_config = load_config(config)
        except ConfigError as exc:
            raise CommandError(str(exc)) from None
        keep_connection()
        principal = Principal(os.environ.get(ENV_KEY, ""))
        gateway = Gateway(gateway_config, principal=principal)
        if not http:
            if not principal.secret:
                raise CommandError(f"expected an agent key in ${ENV_KEY}, found none")
            key = principal.current()
            if key is None:
                raise CommandError(f"expected a live agent key in ${ENV_KEY}, found one that "
                                   "is malformed, unknown or revoked")
            try:  # the gateway's tenant, which every request checks again
                gateway.tenant_of(key)
            except LedgerError as exc:
                raise CommandError(f"{config}: {exc}") from None
        try:
            if check:
                anyio.run(self._check, gateway)
                self.stdout.write(cfg.table(gateway.config, gateway.annotations))
                self.stderr.write(f"mcp_gateway: {config} is usable with upstream "
                                  f"{gateway_config.upstream.describe()}")
            elif http:
                self._serve_http(gateway, http)
            else:
                # stdout is the protocol's channel from here on: nothing else may write to it.
                anyio.run(self._serve_stdio, gateway)
        except BaseException as exc:
            found = _leaves(exc)
            if found and all(isinstance(e, (ConfigError, UpstreamUnreachable)) for e in found):
                raise CommandError("; ".join(str(e) for e in found)) from None
            raise

    async def _check(self, gateway):
        async with gateway.connected():
            self._warn(gateway)

    async def _serve_stdio(self, gateway):
        async with gateway.connected():
            self._warn(gateway)
            await gateway.serve_stdio()

    def _warn(self, gateway):
        """Said at start, on stderr (stdout may be the protocol's channel)."""
        for line in gateway.warnings:
            self.stderr.write(f"mcp_gateway: {line}")

    def _serve_http(self, gateway, address):
        import uvicorn

        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise CommandError(f"expected --http HOST:PORT, found {address!r}")
        app = gateway.streamable_http_app(allowed_hosts=(host, "127.0.0.1", "localhost"))
        uvicorn.run(app, host=host, port=int(port), log_level="warning", lifespan="on")


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, or `exc` itself."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def keep_connection() -> None:
    """One long-lived agent process: without a pool, keep its database connection (and the
    statements prepared on it) from call to call instead of reconnecting at each of the
    three writes of every call; a connection found broken is replaced (health checks)."""
    from django.db import connections

    database = connections.settings["default"]
    if "pool" not in database.get("OPTIONS", {}):
        database["CONN_MAX_AGE"] = None
        database["CONN_HEALTH_CHECKS"] = True
