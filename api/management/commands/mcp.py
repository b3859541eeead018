"""manage.py mcp [--key SECRET]: the MCP server over stdio, acting as one agent key."""

import os

import anyio
from django.core.management.base import BaseCommand, CommandError

from api.agent import Principal
from api.mcp import build_server

ENV_KEY = "LEDGER_AGENT_KEY"


class Command(BaseCommand):
    help = ("Serve the ledger's MCP tools over stdio (for an MCP client that starts this "
            f"command). The agent key comes from --key or, kept out of `ps`, from ${ENV_KEY}.")

    def add_arguments(self, parser):
        parser.add_argument("--key", default="",
                            help=f"the agent key's secret (default: ${ENV_KEY})")

    def handle(self, *args, key, **options):
        secret = key or os.environ.get(ENV_KEY, "")
        if not secret:
            raise CommandError(f"expected an agent key in --key or ${ENV_KEY}, found neither")
        principal = Principal(secret)
        if principal.current() is None:
            raise CommandError("expected a live agent key, found one that is malformed, "
                               "unknown or revoked")
        # stdout is the protocol's channel from here on: nothing else may write to it.
        anyio.run(build_server(principal).run_stdio_async)
