"""Reconcilers made of an upstream's read tool, for `manage.py reconcile`.

Importing this module registers, for every gateway configuration in the setting
LEDGER_GATEWAY_CONFIGS (environment: a comma-separated list of paths), one reconciler per
consequential tool that has a `[tools.X.reconcile]` table. config/settings.py adds this
module to LEDGER_RECONCILER_MODULES when that setting is not empty, so the reconcile
process loads it like any reconciler module. `register(config)` does the same for one
configuration (tests, a host project's own module).

A look-up calls the read tool once, over a connection of its own to the upstream (the
reconcile process is not the gateway): the arguments come from the receipt's stored
arguments through the configured templates, and the configured rules read the result:
found -> Found with the external id; absent -> ProvenAbsent; not_yet -> NotYet; none of
them -> Ambiguous (a person decides), the result kept as evidence.
"""

from __future__ import annotations

import re
from typing import Any

import anyio
import mcp_types as types
from django.conf import settings

from api.gateway import config as cfg
from api.gateway.upstream import open_client
from ledger import reconcile
from ledger.canonical import canonical_json

# Evidence keeps at most this much of a read's result.
MAX_OBSERVED = 16 * 1024


def register(config: cfg.Config) -> list[str]:
    """Register the reconcilers of `config`; the operation names registered."""
    names = []
    for tool in config.tools.values():
        if tool.is_consequential and tool.reconcile is not None:
            reconcile.register(tool.operation)(reconciler_class(config, tool))
            names.append(tool.operation)
    return names


def reconciler_class(config: cfg.Config, tool: cfg.Tool) -> type[reconcile.Reconciler]:
    read = tool.reconcile
    return type(
        f"Gateway_{config.name}_{tool.name}", (ReadToolReconciler,),
        {"config": config, "tool": tool, "read": read,
         "name": f"mcp-gateway:{config.name}/{read.tool}",
         "__module__": __name__},
    )


class ReadToolReconciler(reconcile.Reconciler):
    # An MCP tool's result carries no idempotency key: what is found is matched on the
    # stored arguments.
    service_has_keys = False
    config: cfg.Config
    tool: cfg.Tool
    read: cfg.Reconcile

    def lookup(self, op):
        stored = (op.intent or {}).get("arguments") or {}
        try:
            arguments = {name: cfg.render(value, stored)
                         for name, value in self.read.arguments.items()}
        except KeyError as exc:
            return reconcile.Ambiguous(
                reason=f"expected argument {exc} in the receipt's stored arguments for "
                f"{self.read.tool}, found none (is it kept?)")
        query = {"tool": self.read.tool, "arguments": arguments}
        result = anyio.run(self._call, arguments)
        document = _document(result)
        observed = _observed(document)
        for verdict, rule in (("found", self.read.found), ("absent", self.read.absent),
                              ("not_yet", self.read.not_yet)):
            if rule is None or not _holds(rule, document, stored):
                continue
            if verdict == "absent":
                return reconcile.ProvenAbsent(observed, query=query)
            if verdict == "not_yet":
                return reconcile.NotYet(observed, query=query)
            external_id = self._external_id(document, stored)
            if not external_id:
                return reconcile.Ambiguous(
                    observed, reason=f"the read shows the effect, but expected its id at "
                    f"{self.read.external_id or self.read.external_id_template!r}, found "
                    "none", query=query)
            return reconcile.Found(external_id, observed, query=query)
        return reconcile.Ambiguous(
            observed, reason=f"no rule of [tools.{self.tool.name}.reconcile] matched the "
            f"result of {self.read.tool}", query=query)

    def reread(self, op):
        """After a retry succeeded: the same read. A read tool shows whether the effect is
        there, not how many copies of it exist, so Found counts as the one recorded."""
        return self.lookup(op)

    async def _call(self, arguments: dict[str, Any]) -> types.CallToolResult:
        # One scope around the whole connection, so the client's own task groups nest in it.
        with anyio.fail_after(self.config.upstream.connect_timeout + self.read.timeout):
            async with open_client(self.config.upstream) as client:
                return await client.call_tool(self.read.tool, arguments,
                                              read_timeout_seconds=self.read.timeout)

    def _external_id(self, document: dict[str, Any], stored: dict[str, Any]) -> str:
        if self.read.external_id_template:
            try:
                return str(cfg.render(self.read.external_id_template, stored)).strip()
            except KeyError:
                return ""
        value = cfg.lookup(document["structured"], self.read.external_id)
        if value is cfg.MISSING or isinstance(value, bool | dict | list) or value is None:
            return ""
        return str(value).strip()[:500]


def _document(result: types.CallToolResult) -> dict[str, Any]:
    text = " ".join(c.text for c in result.content if isinstance(c, types.TextContent))
    structured = result.structured_content
    return {"structured": structured if isinstance(structured, dict) else {},
            "text": text, "is_error": bool(result.is_error)}


def _observed(document: dict[str, Any]) -> dict[str, Any]:
    if len(canonical_json(document).encode("utf-8")) <= MAX_OBSERVED:
        return document
    return {"is_error": document["is_error"], "text": document["text"][:2000],
            "cut": f"the result was larger than {MAX_OBSERVED:,} bytes"}


def _holds(rule: cfg.Rule, document: dict[str, Any], stored: dict[str, Any]) -> bool:
    if rule.is_error is not None and rule.is_error != document["is_error"]:
        return False
    if rule.text_matches and not re.search(rule.text_matches, document["text"]):
        return False
    if rule.path:
        value = cfg.lookup(document["structured"], rule.path)
        if rule.exists is not None and rule.exists != (value is not cfg.MISSING):
            return False
        if rule.equals is not None:
            try:
                expected = cfg.render(rule.equals, stored)
            except KeyError:
                return False
            if value is cfg.MISSING or value != expected:
                return False
        if rule.one_of and (value is cfg.MISSING or value not in rule.one_of):
            return False
        if rule.matches and (value is cfg.MISSING or not re.search(rule.matches, str(value))):
            return False
    return True


def register_from_settings() -> list[str]:
    names = []
    for path in getattr(settings, "LEDGER_GATEWAY_CONFIGS", ()) or ():
        names += register(cfg.load(path))
    return names


register_from_settings()
