"""The MCP gateway: an MCP server in front of one upstream MCP server, writing a receipt for
every consequential tool call.

Everything but `tools/call` of a consequential tool is forwarded as it is: tool lists
(names, descriptions, schemas), resources, prompts, completions, and calls of pass-through
tools. A consequential call goes through the ledger's agent door (`api.service`, as HTTP
and /mcp do: the agent key the principal, its name the actor on every event):

    record the intent (redacted, or only `keep`) under the call's idempotency key
    state planned / safe_to_retry -> mark submitted (an approval policy may hold it here)
        -> forward -> isError result: rejected (or outcome_unknown, as the tool's
           on_error / rejected_when / unknown_when classify it); a JSON-RPC refusal that
           says the tool did not run: rejected; a timeout, a closed connection, a
           result that breaks the tool's own output schema, a cancellation:
           outcome_unknown; a result: succeeded
           with the result stored (unless the configured external id is missing: then
           outcome_unknown, for the reconciler to read)
    succeeded -> the stored result, marked as a replay, not forwarded
    submitted -> "in flight": another call of the same key is being sent now; call again
        shortly (`_meta` agent-ledger/in-flight); never a second forward
    outcome_unknown / reconciling / manual_review -> a tool error telling the model the
        outcome is not known yet and not to retry; never a second forward
    rejected / abandoned -> a tool error saying so; not forwarded
    Every answer from a stored receipt is marked a replay: `_meta` agent-ledger/replayed,
    the operation id and when it was sent, and a first sentence "Not sent again: ...".
    A reply that comes after the call was settled answers from the settled record.
    Every request (lists, reads, prompts, completions, any tool call) first checks that
    the key is live and holds the gateway's tenant.

The ledger's writes run on Django's thread-sensitive worker thread (`api.agent.on_db_thread`),
one whole write per hop, so no transaction spans an await and the event loop never waits on
PostgreSQL. The key comes from `api.agent.Principal`, as for /mcp.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import mcp_types as types
from django.utils import timezone
from django.utils.crypto import salted_hmac
from mcp import InputRequiredRoundsExceededError
from mcp.server.lowlevel.server import Server
from mcp.shared.exceptions import MCPError

from api import service
from api.agent import BearerKeyASGI, Principal, on_db_thread
from api.gateway import config as cfg
from api.gateway.upstream import UpstreamLink, UpstreamUnreachable
from ledger.canonical import canonical_json
from ledger.errors import (
    ApprovalDenied,
    ApprovalRequired,
    IllegalTransition,
    InvalidInput,
    LedgerError,
    PermissionDenied,
    StaleVersion,
)
from ledger.inputs import check_identifier, check_json, storable
from ledger.states import State

if TYPE_CHECKING:
    from ledger.models import AgentKey, Operation

logger = logging.getLogger("api.gateway")

# JSON-RPC errors that say the request was refused before the tool ran: rejected.
NOT_EXECUTED = {types.PARSE_ERROR, types.INVALID_REQUEST, types.METHOD_NOT_FOUND,
                types.INVALID_PARAMS}
UNKNOWN_STATES = {State.SUBMITTED, State.OUTCOME_UNKNOWN, State.RECONCILING,
                  State.MANUAL_REVIEW}

# The `_meta` of an answer from a stored receipt (a replay) or of a call in flight.
META_REPLAYED = "agent-ledger/replayed"
META_IN_FLIGHT = "agent-ledger/in-flight"
META_OPERATION = "agent-ledger/operation-id"
META_SENT_AT = "agent-ledger/sent-at"
META_RETRY_AFTER = "agent-ledger/retry-after"
META_LATE = "agent-ledger/late-reply"
META_STATE = "agent-ledger/state"
META_NEEDS_KEY = "agent-ledger/needs-key"
META_TOO_LARGE = "agent-ledger/result-too-large"
META_OUTCOME = "agent-ledger/outcome"
META_POLICY = "agent-ledger/error-policy"
IN_FLIGHT_RETRY_AFTER = 1  # seconds

# What `_begin` hands back: send it now, answer from its record, wait for an approval, or
# answer with the tool error it made.
_SEND, _SETTLED, _APPROVAL, _ANSWER = "send", "settled", "approval", "answer"


@dataclass
class _Call:
    """A consequential call in progress: the agent key it is made as (every write of it goes
    through `api.service` as this key) and its operation as the last write left it."""

    key: AgentKey
    op: Operation


def tool_error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                is_error=True)


class Gateway:
    """One configuration, one upstream, one MCP server (`self.server`, the SDK's low-level
    `Server`) serving any number of clients over stdio or Streamable HTTP.

    Programmatic use::

        gateway = Gateway(cfg.load("gateway.toml"), principal=Principal(secret))
        async with gateway.connected():          # opens the upstream, checks the config
            await gateway.serve_stdio()          # or: gateway.streamable_http_app()
    """

    def __init__(self, config: cfg.Config, *, principal: Principal):
        self.config = config
        self.principal = principal
        self.link = UpstreamLink(config.upstream)
        self.stdio_session = ""
        self.warnings: list[str] = []
        self.annotations: dict[str, dict[str, Any]] = {}
        self.server = self._build_server()

    # --- life cycle --------------------------------------------------------------------

    @asynccontextmanager
    async def connected(self):
        """Open the upstream and check the configuration against its tool list; raises
        UpstreamUnreachable or cfg.ConfigError (nothing is served then)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.link.run)
            try:
                await self.link.started()
                self._mirror_capabilities()
                tools = await self.link.list_all_tools(self.config.upstream.connect_timeout)
                cfg.check_against_tools(self.config,
                                        {t.name: t.input_schema for t in tools})
                self.annotations = {t.name: _hints(t) for t in tools}
                self.config = cfg.resolve(self.config, self.annotations)
                cfg.check_against_tools(self.config,
                                        {t.name: t.input_schema for t in tools})
                cfg.check_key_rules(self.config)
                self.warnings = cfg.warnings(self.config)  # said at start by who serves
                yield self
            finally:
                tg.cancel_scope.cancel()

    def _mirror_capabilities(self) -> None:
        """Serve only what the upstream serves: the capabilities the gateway announces are
        derived from its handlers, so those the upstream lacks are dropped (a client then
        sees no resources, prompts or completions, as it would talking to the upstream)."""
        client = self.link.current
        capabilities = client.server_capabilities if client is not None else None
        if capabilities is None:
            return
        lacking = {
            "resources": ("resources/list", "resources/templates/list", "resources/read"),
            "prompts": ("prompts/list", "prompts/get"),
            "completions": ("completion/complete",),
        }
        for capability, methods in lacking.items():
            if getattr(capabilities, capability, None) is None:
                for method in methods:
                    self.server._request_handlers.pop(method, None)

    async def serve_stdio(self) -> None:
        """Serve one client over this process's stdin/stdout (its session: this process)."""
        from mcp.server.stdio import stdio_server

        self.stdio_session = f"stdio-{uuid.uuid4().hex[:16]}"
        async with stdio_server() as (read, write):
            await self.server.run(read, write, self.server.create_initialization_options())

    def streamable_http_app(self, *, path: str = "/mcp", allowed_hosts=("127.0.0.1",
                                                                          "localhost")):
        """An ASGI app serving the gateway at `path` over Streamable HTTP, behind the same
        bearer agent keys as the ledger's own /mcp: a handshake-era client gets an
        Mcp-Session-Id (shown on the desk, not part of any key), a 2026-07-28 client sends
        each request on its own, with no session. Its lifespan opens the upstream."""
        from mcp.server.transport_security import TransportSecuritySettings

        hosts = list(allowed_hosts)
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection="*" not in hosts,
            allowed_hosts=[h for host in hosts for h in (host, f"{host}:*")],
            allowed_origins=[f"{scheme}://{host}{port}" for host in hosts
                             for scheme in ("http", "https") for port in ("", ":*")],
        )
        app = self.server.streamable_http_app(streamable_http_path=path, json_response=True,
                                              transport_security=security)
        manager = self.server.session_manager

        @asynccontextmanager
        async def lifespan(_app):
            async with self.connected(), manager.run():
                for line in self.warnings:
                    logger.warning("gateway: %s", line)
                yield

        app.router.lifespan_context = lifespan
        return BearerKeyASGI(app)

    # --- the MCP server ----------------------------------------------------------------

    def _build_server(self) -> Server:
        server = Server(
            f"agent-ledger-gateway-{self.config.name}", version="1",
            on_list_tools=self._list_tools, on_call_tool=self._call_tool,
            on_list_resources=self._forward("list_resources"),
            on_list_resource_templates=self._forward("list_resource_templates"),
            on_read_resource=self._read_resource,
            on_list_prompts=self._forward("list_prompts"),
            on_get_prompt=self._get_prompt,
            on_completion=self._complete,
        )
        return server

    async def _upstream(self):
        return await self.link.client(self.config.upstream.connect_timeout)

    async def _authorized(self, ctx) -> tuple[AgentKey, str]:
        """(the request's live key, the gateway's tenant), checked before any request
        reaches the upstream: every list, read, prompt, completion and tool call, whether
        its tool is consequential or not. A key that is revoked, or not granted the
        gateway's tenant, is refused with a JSON-RPC error saying so."""
        try:
            return await on_db_thread(self._key_and_tenant)(ctx)
        except LedgerError as exc:
            raise MCPError(types.INVALID_REQUEST,
                           f"Refused by the ledger ({type(exc).__name__}): {exc}") from None

    def _key_and_tenant(self, ctx) -> tuple[AgentKey, str]:
        key = self.principal.current(getattr(ctx, "request", None))
        if key is None:
            raise PermissionDenied("expected a live agent key, found it revoked or unknown")
        return key, self.tenant_of(key)

    def tenant_of(self, key: AgentKey) -> str:
        """The gateway's tenant (`[gateway] tenant`, else the key's one tenant), which `key`
        must hold: `service.tenant_for`, InvalidInput or PermissionDenied."""
        return service.tenant_for(key, self.config.tenant, named_by="[gateway] tenant")

    async def _list_tools(self, ctx, params):
        await self._authorized(ctx)
        client = await self._upstream()
        return await self._guard(client, client.session.list_tools(params=_page(params)))

    def _forward(self, method: str):
        async def handler(ctx, params):
            await self._authorized(ctx)
            client = await self._upstream()
            return await self._guard(client, getattr(client.session, method)(
                params=_page(params)))
        return handler

    async def _read_resource(self, ctx, params):
        await self._authorized(ctx)
        client = await self._upstream()
        return await self._guard(client, client.session.read_resource(params.uri))

    async def _get_prompt(self, ctx, params):
        await self._authorized(ctx)
        client = await self._upstream()
        return await self._guard(client, client.session.get_prompt(params.name,
                                                                   params.arguments))

    async def _complete(self, ctx, params):
        await self._authorized(ctx)
        client = await self._upstream()
        return await self._guard(client, client.session.complete(
            params.ref, params.argument.model_dump(), context_arguments=(
                params.context.arguments if params.context else None)))

    async def _guard(self, client, awaitable):
        """Await a forwarded request; a closed connection reopens the upstream."""
        try:
            return _relayed(await awaitable)
        except MCPError as exc:
            if exc.error.code == types.CONNECTION_CLOSED:
                self.link.broken(client)
            raise

    def _session_of(self, ctx) -> str | None:
        """The client's MCP session: this process on stdio; the Mcp-Session-Id over
        Streamable HTTP; None for a request that belongs to no session."""
        if getattr(ctx, "request", None) is None:
            return self.stdio_session or "in-process"
        connection = getattr(ctx.session, "_connection", None)
        return getattr(connection, "session_id", None)

    async def _call_tool(self, ctx, params: types.CallToolRequestParams):
        tool = self.config.tool(params.name)
        arguments = dict(params.arguments or {})
        if not tool.is_consequential:
            await self._authorized(ctx)
            client = await self._upstream()
            try:
                result = await self._guard(client, client.call_tool(
                    params.name, arguments, progress_callback=_progress_relay(ctx, params)))
            except InputRequiredRoundsExceededError:
                return tool_error(input_not_relayed(params.name))
            except RuntimeError as exc:  # the SDK's check of the tool's output schema
                return tool_error(f"The upstream's result of {params.name} broke the output "
                                  f"schema it declares: {exc}")
            return self._within_limit(params.name, result)
        return await self._consequential(ctx, tool, arguments, params)

    def _within_limit(self, name: str, result: types.CallToolResult, op: Operation | None = None
                      ) -> types.CallToolResult:
        """`result`, or a tool error when it is larger than `[gateway] max_forward_bytes`:
        a result that size is refused, not forwarded whole."""
        size = _size(result)
        limit = self.config.max_forward_bytes
        if size <= limit:
            return result
        done = (f" The call itself was recorded: operation {op.operation} "
                f"({op.operation_id}) {op.state}"
                f"{f', external id {op.external_id}' if op.external_id else ''}; it is not "
                "sent again." if op is not None else "")
        answer = tool_error(
            f"Result too large: the upstream's result of {name} is {size:,} bytes of JSON, "
            f"above the {limit:,} bytes this gateway forwards ([gateway] max_forward_bytes); "
            f"it is not forwarded.{done} Ask for less (a range, a page, a summary).")
        answer.meta = {META_TOO_LARGE: size}
        if op is not None:
            answer.meta[META_OPERATION] = op.operation_id
        return answer

    # --- a consequential call ------------------------------------------------------------

    async def _consequential(self, ctx, tool: cfg.Tool, arguments: dict[str, Any],
                             params: types.CallToolRequestParams) -> types.CallToolResult:
        meta = params.meta if params.meta is not None else {}
        if not isinstance(meta, dict):
            meta = meta.model_dump(by_alias=True)
        session = self._session_of(ctx)
        # One hop to the database thread: the key's check, the idempotency key, the intent
        # and (when it is to be sent) its submission.
        try:
            step, call = await on_db_thread(self._begin)(ctx, tool, arguments, session, meta)
        except _Unauthorized as refused:
            raise MCPError(types.INVALID_REQUEST, refused.message) from None
        while True:
            if step == _ANSWER:
                return call
            if step == _SEND:
                return await self._send(tool, call, arguments,
                                        _progress_relay(ctx, params))
            if step == _SETTLED:
                return await self._settled(tool, call.op)
            # _APPROVAL: a person must approve before it is sent.
            waited = await self._await_approval(tool, call)
            if isinstance(waited, types.CallToolResult):
                return waited
            step, call = await on_db_thread(self._try_submit)(tool, waited)

    def _begin(self, ctx, tool: cfg.Tool, arguments: dict[str, Any], session: str | None,
               meta: dict[str, Any]):
        """(what to do next, the call or the answer). Runs on the database thread."""
        try:
            key, tenant = self._key_and_tenant(ctx)
        except LedgerError as exc:
            raise _Unauthorized(f"Refused by the ledger ({type(exc).__name__}): {exc}"
                                ) from None
        try:
            check_json(arguments, what="arguments")
            explicit = self._explicit_key(tool, arguments, meta)
            protocol = str(getattr(ctx, "protocol_version", "") or "")[:20]
            if explicit is not None:
                op = self._record(key, tenant, tool, arguments, session, explicit,
                                  protocol=protocol)
            else:
                found = self._default_key(key, tenant, tool, arguments)
                if isinstance(found, types.CallToolResult):
                    return _ANSWER, found
                op = self._record(key, tenant, tool, arguments, session, found[0],
                                  default=found[1], protocol=protocol)
        except ApprovalRequired as exc:
            return _APPROVAL, _Call(key, exc.recorded_operation)
        except ApprovalDenied as exc:
            return _ANSWER, _denied(exc.recorded_operation, exc)
        except LedgerError as exc:
            return _ANSWER, tool_error(f"Refused by the ledger ({type(exc).__name__}): {exc}")
        call = _Call(key, op)
        if op.submitted_now:
            return _SEND, call
        return self._try_submit(tool, call)

    def _try_submit(self, tool: cfg.Tool, call: _Call):
        if call.op.state not in (State.PLANNED, State.SAFE_TO_RETRY):
            return _SETTLED, call
        try:
            call.op = service.mark_operation(call.key, call.op, "submitted",
                                             in_flight_seconds=tool.in_flight or None)
            return _SEND, call
        except ApprovalRequired:
            return _APPROVAL, call
        except ApprovalDenied as exc:
            return _ANSWER, _denied(call.op, exc)
        except StaleVersion:
            # Another call of the same key moved it first: answer from its state.
            call.op = service.access_operation(call.key, call.op.operation_id)
            return _SETTLED, call
        except LedgerError as exc:
            return _ANSWER, tool_error(f"Refused by the ledger ({type(exc).__name__}): {exc}")

    def _record(self, key: AgentKey, tenant: str, tool: cfg.Tool, arguments,
                session: str | None, idempotency_key: str,
                default: dict[str, Any] | None = None, protocol: str = "") -> Operation:
        """The receipt of the call, recorded and, when new (or planned, or safe to retry),
        marked submitted in the same commit (`service.record(submit=True)`): `submitted_now`
        says this call is to send it."""
        return service.record(
            key, operation=tool.operation, target=tool.target,
            intent=self._intent(key, tool, arguments, session, default, protocol),
            tenant=tenant, idempotency_key=idempotency_key,
            fingerprint_fields=_fields(default), redact=_redact_paths(tool),
            retry_policy=tool.retry_policy, submit=True,
            in_flight_seconds=tool.in_flight or None, account=self.config.account_of(tool),
        )

    def _intent(self, key: AgentKey, tool: cfg.Tool, arguments, session: str | None,
                default: dict[str, Any] | None, protocol: str = "") -> dict[str, Any]:
        """What is recorded: the tool, its arguments (or only `keep`), and where the call
        came from. The MCP session is named so the desk can show it: on stdio the gateway's
        own id of its one client; over HTTP a digest of the Mcp-Session-Id (the id itself
        lets its holder speak in that session, so it is not stored); "" for a 2026-07-28
        request, which belongs to no session. The protocol version the call came in. The
        caller (the agent key: what identifies a caller with or without a session), the
        digests of the resources the call changes and, under the default key, a keyed
        digest of the whole call: the default key's look-ups. Only the tool, its arguments
        and that digest are fingerprinted: the session and the protocol are not, so a
        retry after a reconnect, in either protocol era, is the same intent."""
        stored = arguments if tool.keep is None else _kept(arguments, tool.keep)
        mcp = {"gateway": self.config.name, "connection": _label(session),
               "caller": key.name}
        if protocol:
            mcp["protocol"] = protocol
        resources = self._resources(tool, arguments)
        if resources:
            mcp["resources"] = resources
        if default is not None:
            mcp["call"] = default["call"]
        return {"tool": tool.name, "arguments": stored, "mcp": mcp}

    def _resources(self, tool: cfg.Tool, arguments) -> list[str]:
        """A keyed digest per resource the call names (`resource` arguments): calls of any
        tool of this gateway on the same path share one."""
        out = []
        for name in tool.resource:
            value = cfg.lookup(arguments, name)
            if value is not cfg.MISSING:
                out.append(_keyed({"gateway": self.config.name, "resource": value}))
        return out

    def _explicit_key(self, tool: cfg.Tool, arguments, meta) -> str | None:
        """The call's key when the client sends one or the tool names its arguments; None
        for the default key."""
        sent = meta.get(cfg.META_KEY)
        if sent is not None or tool.key_from == cfg.KEY_FROM_META:
            if not isinstance(sent, str) or not sent.strip() or len(sent) > 200:
                raise InvalidInput(
                    f"expected _meta[{cfg.META_KEY!r}] of tool {tool.name} to be a non-empty "
                    f"string of at most 200 characters, found {sent!r}")
            return sent
        if tool.key_from == cfg.KEY_FROM_ARGUMENTS:
            named = {}
            for name in tool.key_names:
                value = cfg.lookup(arguments, name)
                if value is cfg.MISSING:
                    raise InvalidInput(f"expected argument {name!r} of tool {tool.name} (its "
                                       f"idempotency key is made of {list(tool.key_names)}), "
                                       "found none")
                named[name] = value
            return "mcp-args:" + _digest({"tool": tool.name, "arguments": named})
        return None

    def _default_key(self, key: AgentKey, tenant: str, tool: cfg.Tool, arguments):
        """(the idempotency key, what the intent records for it) or the answer to send
        back (repeat = "ask").

        The default key is a guess, kept in the ledger (so it survives a restart of the
        gateway or of the client): a call with the same arguments as this caller's earlier
        call of the tool is that call's retry (the same key) while the earlier one is not
        settled, or within `retry_window` seconds after it settled, and only if no other
        call of the tool by this caller, nor any call on the same resource, came between.
        Any other call is a new intent (a new key), so write A, write B, write A sends
        three times; with repeat = "ask" a same-arguments call that is not a retry is
        refused until the client sends a key of its own.

        A new key is derived from the call and the last earlier one (none: 0), not drawn
        at random: two identical calls that find the ledger in the same state (at once, in
        two gateway processes) make the same key, and the ledger records one intent."""
        call = _keyed({"gateway": self.config.name, "caller": key.name, "tool": tool.name,
                       "arguments": arguments})
        default = {"call": call}
        intent = self._intent(key, tool, arguments, None, default)
        earlier = service.earlier_call(key, tenant, tool.operation, intent,
                                       redact=_redact_paths(tool),
                                       fingerprint_fields=_fields(default))
        if earlier is None:
            return _new_key(call, 0), default
        settled = earlier.state in (State.SUCCEEDED, State.REJECTED, State.ABANDONED)
        age = (timezone.now() - earlier.state_changed_at).total_seconds()
        recent = not settled or age <= tool.retry_window
        between = None
        if recent:
            between = service.call_between(key, tenant, earlier, gateway=self.config.name,
                                           resources=intent["mcp"].get("resources"))
            if between is None:
                return earlier.idempotency_key, default
        if tool.repeat == cfg.REPEAT_ASK:
            why = (f"call {between.operation} ({between.operation_id}) came between"
                   if between is not None else
                   f"it settled {age:.0f} s ago, past the retry window of "
                   f"{tool.retry_window:g} s")
            answer = tool_error(
                f"Needs a key: this call has the same arguments as call {earlier.operation} "
                f"({earlier.operation_id}, {earlier.state}), but {why}, so it cannot be told "
                f"apart from a retry. Nothing was sent. To make it again on purpose, send "
                f"_meta[{cfg.META_KEY!r}] with a key of your own (the tool {tool.name} is "
                "configured repeat = \"ask\").")
            answer.meta = {META_NEEDS_KEY: True, META_OPERATION: earlier.operation_id}
            return answer
        return _new_key(call, earlier.id), default

    async def _await_approval(self, tool: cfg.Tool, call: _Call):
        """Ask a person (once) and wait up to `approval_wait`; the approved call, or the
        tool error the model reads."""
        op = call.op
        await on_db_thread(self._request_approval)(tool, call)
        awaiting = tool_error(
            f"Awaiting approval: operation {op.operation} ({op.operation_id}) needs a "
            "person's approval before it is sent. Call again with the same arguments after "
            "approval; it is sent once, then.")
        if tool.approval_wait <= 0:
            return awaiting
        try:
            approved = await service.await_approval(call.key, op, timeout=tool.approval_wait)
        except ApprovalRequired:
            return awaiting
        except ApprovalDenied as exc:
            return tool_error(f"Denied: a reviewer denied operation {op.operation} "
                              f"({op.operation_id}): {exc.reason}. It is not sent; do not "
                              "retry.")
        if approved.intent_fingerprint != op.intent_fingerprint:
            return tool_error(
                f"Approved with changes: a reviewer edited the arguments of operation "
                f"{op.operation} ({op.operation_id}); the gateway sends only what the model "
                f"asked. Read the approved arguments on the review desk; not sent.")
        return _Call(call.key, approved)

    def _request_approval(self, tool: cfg.Tool, call: _Call) -> None:
        session = (call.op.intent.get("mcp") or {}).get("connection", "")
        service.ask_approval(call.key, call.op, note=f"MCP tool {tool.name} through gateway "
                                                     f"{self.config.name}, session {session}",
                             unless_pending=True)

    async def _send(self, tool: cfg.Tool, call: _Call, arguments, progress=None
                    ) -> types.CallToolResult:
        """Forward the submitted call and record how it ended; never retries. A reply that
        arrives after the call was settled (the sweep and a reconciler, or a person, moved
        it first) answers from the settled record, never with a protocol error."""
        try:
            answer = await self._forward_call(tool, call, arguments, progress)
        except _MovedOn as moved:
            call.op = moved.current
            answer = _late(moved.current, moved.reply)
        if answer.is_error or _size(answer) <= self.config.max_forward_bytes:
            return answer
        return self._within_limit(tool.name, answer, call.op)  # as its outcome left it

    async def _forward_call(self, tool: cfg.Tool, call: _Call, arguments, progress=None
                            ) -> types.CallToolResult:
        client = None
        try:
            client = await self.link.client(tool.timeout)
            result = await client.call_tool(tool.name, arguments,
                                            read_timeout_seconds=tool.timeout,
                                            progress_callback=progress)
        except MCPError as exc:
            code = exc.error.code
            if code == types.CONNECTION_CLOSED and client is not None:
                self.link.broken(client)
            if code in NOT_EXECUTED:
                await self._finish(call, State.REJECTED, error_code=f"mcp_error_{code}",
                                   detail=exc.error.message)
                raise
            return await self._unknown(tool, call, f"mcp_error_{code}", exc.error.message)
        except UpstreamUnreachable as exc:
            return await self._unknown(tool, call, "upstream_unreachable", str(exc))
        except InputRequiredRoundsExceededError:
            # A 2026-07-28 tool that asks for input has not completed: the call is made
            # again whole with the answers, so this one did nothing.
            text = input_not_relayed(tool.name)
            await self._finish(call, State.REJECTED, error_code="input_required", detail=text)
            return tool_error(text)
        except Exception as exc:  # a result the SDK refused, a transport failure...
            return await self._unknown(tool, call, type(exc).__name__, str(exc))
        except BaseException:
            # Cancelled (the client gave up, the gateway is stopping): the request may
            # have reached the upstream.
            with anyio.CancelScope(shield=True):
                try:
                    await self._finish(call, State.OUTCOME_UNKNOWN, error_code="cancelled",
                                       detail="the call was cancelled after it was forwarded")
                except _MovedOn:
                    pass  # settled meanwhile: nothing to record, the cancellation goes on
            raise
        if not isinstance(result, types.CallToolResult):
            return await self._unknown(tool, call, "unexpected_result",
                                       f"a {type(result).__name__} instead of a tool result")
        result = _relayed(result)
        if result.is_error:
            text = _text(result)
            if cfg.classify_error(tool, text, result.structured_content) == cfg.ON_ERROR_UNKNOWN:
                # Configured as "may have happened": the reconciler proves it either way.
                return await self._unknown(tool, call, "tool_error", text)
            await self._finish(call, State.REJECTED, error_code="tool_error", detail=text)
            return result
        external_id, missing = self._external_id(tool, result, arguments)
        if missing:
            return await self._unknown(tool, call, "external_id_missing", missing)
        await self._finish(call, State.SUCCEEDED, result=result, external_id=external_id)
        return result

    def _external_id(self, tool: cfg.Tool, result: types.CallToolResult, arguments
                     ) -> tuple[str | None, str]:
        """(the effect's id or None, "" or why the configured id is missing). An id the
        ledger would refuse as one (a control character, surrounding whitespace) is
        missing too: the reconciler reads what the effect's id is."""
        found, missing = self._configured_id(tool, result, arguments)
        if found is None or missing:
            return found, missing
        try:
            return check_identifier(found, "the external id", 500), ""
        except InvalidInput as exc:
            return None, str(exc)

    def _configured_id(self, tool: cfg.Tool, result: types.CallToolResult, arguments
                       ) -> tuple[str | None, str]:
        if tool.external_id_template:
            try:
                value = cfg.render(tool.external_id_template, arguments)
            except KeyError as exc:
                return None, f"expected argument {exc} for external_id_template, found none"
            return storable(str(value), 500) or None, ""
        if not tool.external_id:
            return None, ""
        structured = result.structured_content
        value = (cfg.lookup(structured, tool.external_id) if isinstance(structured, dict)
                 else cfg.MISSING)
        if value is cfg.MISSING or isinstance(value, bool) or not isinstance(value, str | int) \
                or str(value).strip() == "":
            found = ("no structured result" if structured is None else
                     f"keys {sorted(structured)[:20]}" if isinstance(structured, dict) else
                     type(structured).__name__)
            if value is not cfg.MISSING:
                found = f"{value!r}"[:200]
            return None, (f"expected the external id at {tool.external_id!r} of the "
                          f"structured result, found {found}")
        return storable(str(value), 500), ""

    async def _unknown(self, tool: cfg.Tool, call: _Call, code: str, detail: str
                       ) -> types.CallToolResult:
        await self._finish(call, State.OUTCOME_UNKNOWN, error_code=code, detail=detail)
        return _unknown_answer(call.op, f"{code}: {detail}")

    async def _finish(self, call: _Call, state: str, *, error_code: str = "",
                      detail: str = "", result: types.CallToolResult | None = None,
                      external_id: str | None = None) -> None:
        """Record the outcome through `api.service` as the call's key (`call.op` then is the
        operation as it left it); _MovedOn (with the operation as it stands, read once) when
        it was settled before this reply came (StaleVersion, IllegalTransition)."""
        try:
            call.op = await on_db_thread(self._write_outcome, fresh=False)(
                call, state, error_code, detail, result, external_id)
        except (StaleVersion, IllegalTransition):
            current = await on_db_thread(service.access_operation)(call.key,
                                                                   call.op.operation_id)
            raise _MovedOn(current, result if state == State.SUCCEEDED else None,
                           ) from None

    def _write_outcome(self, call: _Call, state, error_code, detail, result, external_id
                       ) -> Operation:
        if state != State.SUCCEEDED:
            return service.mark_operation(call.key, call.op, state, error_code=error_code,
                                          detail=detail)
        return service.mark_operation(call.key, call.op, state, external_id=external_id,
                                      **self._result_to_store(result))

    def _result_to_store(self, result: types.CallToolResult) -> dict[str, Any]:
        """What the receipt keeps of `result`: the result itself, which the ledger stores
        as it stores any (`receipts.storable_result`: JSON, redacted, within
        LEDGER_MAX_INTENT_BYTES, or why not), unless its JSON is larger than `[gateway]
        max_result_bytes`: then why it is not stored, and the ledger is spared redacting
        what it would not keep."""
        value = result.model_dump(by_alias=True, mode="json", exclude_none=True)
        size = len(canonical_json(value).encode("utf-8"))
        limit = self.config.max_result_bytes
        if size > limit:
            return {"result_unstorable": f"a result of {size:,} bytes, above the {limit:,} "
                                         "bytes the gateway stores ([gateway] max_result_bytes)"}
        return {"result": value}

    async def _settled(self, tool: cfg.Tool, op: Operation) -> types.CallToolResult:
        """What a call of a key that is not to be sent gets. An ended call's answer is a
        replay, marked as one (`_meta` and a first sentence), never a fresh result."""
        if op.state == State.SUCCEEDED:
            if op.result is None:
                why = (f"its result was not stored: {op.result_unstorable}"
                       if op.result_unstorable else "it was confirmed by reading the "
                       "upstream (or by a person), so the original result is not on record")
                return _replayed(op, tool_error(
                    f"Already done: operation {op.operation} ({op.operation_id}) succeeded"
                    f" (external id {op.external_id or 'none'}); {why}. It is not sent "
                    "again; do not retry."))
            result = types.CallToolResult.model_validate(op.result)
            result.content = [types.TextContent(type="text", text=replay_sentence(op)),
                              *result.content]
            return _replayed(op, result)
        if op.state == State.REJECTED:
            return _replayed(op, tool_error(
                f"Rejected earlier: the upstream refused operation {op.operation} "
                f"({op.operation_id}) with {op.error_code}: {op.error_detail}. The same call "
                "is not sent again; change the arguments to make a different call."))
        if op.state == State.ABANDONED:
            return _replayed(op, tool_error(
                f"Abandoned: a person decided operation {op.operation} ({op.operation_id}) "
                "must not happen. It is not sent; do not retry."))
        if op.state == State.SUBMITTED:
            answer = tool_error(
                f"In flight: operation {op.operation} ({op.operation_id}) is being sent right "
                "now by another call with the same key; this call sent nothing. Call again "
                f"in {IN_FLIGHT_RETRY_AFTER} s with the same arguments to get its outcome.")
            answer.meta = {META_IN_FLIGHT: True, META_OPERATION: op.operation_id,
                           META_RETRY_AFTER: IN_FLIGHT_RETRY_AFTER}
            return answer
        return _unknown_answer(op, op.error_code or op.state)


class _MovedOn(Exception):
    """The operation moved on before the gateway recorded its call's outcome."""

    def __init__(self, current: Operation, reply: types.CallToolResult | None):
        super().__init__(current.state)
        self.current = current
        self.reply = reply


def _late(op: Operation, reply: types.CallToolResult | None) -> types.CallToolResult:
    """The answer to a call whose reply came after its operation was settled: the
    upstream's own reply when the record agrees it succeeded; else a tool error naming the
    operation and where it stands."""
    meta = {META_LATE: True, META_OPERATION: op.operation_id, META_STATE: op.state}
    if op.state == State.SUCCEEDED and reply is not None:
        reply.meta = {**(reply.meta or {}), **meta}
        return reply
    if op.state == State.SUCCEEDED:
        text = (f"Late reply: operation {op.operation} ({op.operation_id}) was already "
                f"settled as succeeded (external id {op.external_id or 'none'}) when the "
                "upstream's reply arrived. It is done; do not retry.")
    elif op.state in (State.REJECTED, State.ABANDONED, State.SAFE_TO_RETRY):
        text = (f"Late reply: operation {op.operation} ({op.operation_id}) was already "
                f"settled as {op.state} when the upstream's reply arrived; the ledger's "
                "record stands and a person should look at it on the review desk. Do not "
                "retry.")
    else:
        text = (f"Late reply: operation {op.operation} ({op.operation_id}) moved on to "
                f"{op.state} before the upstream's reply arrived. "
                + _unknown_text(op, op.error_code or op.state))
    answer = tool_error(text)
    answer.meta = meta
    return answer


def input_not_relayed(name: str) -> str:
    return (f"Needs input: the upstream asked for input before {name} could complete "
            "(elicitation or sampling), and the gateway does not relay such questions to its "
            "client. Nothing was done. Call the tool with everything it needs in its "
            "arguments, or use this tool without the gateway.")


def replay_sentence(op: Operation) -> str:
    return (f"Not sent again: this repeats call {op.operation} ({op.operation_id}) sent at "
            f"{_iso(op.submitted_at)}; its recorded result follows.")


def _replayed(op: Operation, result: types.CallToolResult) -> types.CallToolResult:
    """`result`, marked as answered from operation `op`'s receipt."""
    result.meta = {**(result.meta or {}), META_REPLAYED: True,
                   META_OPERATION: op.operation_id, META_SENT_AT: _iso(op.submitted_at)}
    return result


def _iso(value) -> str | None:
    return value.isoformat() if value is not None else None


# The `_meta` keys the MCP specification reserves for the protocol itself (2026-07-28 stamps
# `io.modelcontextprotocol/serverInfo` on every result): the upstream's are not the
# gateway's, so they are not relayed to the gateway's client (which gets the gateway's own).
PROTOCOL_META = "io.modelcontextprotocol/"


def _relayed(result):
    """An upstream's result as the gateway relays (and stores) it: without the protocol's
    own `_meta` entries of the upstream's connection; the tool's own `_meta` is kept."""
    meta = getattr(result, "meta", None)
    if isinstance(meta, dict) and any(k.startswith(PROTOCOL_META) for k in meta):
        kept = {k: v for k, v in meta.items() if not k.startswith(PROTOCOL_META)}
        result.meta = kept or None
    return result


def _progress_relay(ctx, params):
    """The callback that relays an upstream's progress on a forwarded call to the gateway's
    own caller; None (the upstream is not asked for progress) when that caller asked for
    none (no `progressToken` in its request's `_meta`)."""
    meta = params.meta
    if meta is not None and not isinstance(meta, dict):
        meta = meta.model_dump(by_alias=True)
    if not meta or (meta.get("progressToken", meta.get("progress_token")) is None):
        return None
    report = getattr(getattr(ctx, "session", None), "report_progress", None)
    if report is None:
        return None

    async def relay(progress: float, total: float | None, message: str | None) -> None:
        await report(progress, total, message)

    return relay


def _page(params) -> types.PaginatedRequestParams | None:
    """The cursor of a client's list request, without its `_meta`: the upstream session
    stamps its own (the two connections may speak different protocol eras)."""
    cursor = getattr(params, "cursor", None)
    return types.PaginatedRequestParams(cursor=cursor) if cursor else None


def _unknown_answer(op: Operation, why: str) -> types.CallToolResult:
    """The tool error of an outcome not known yet: a sentence for the model and, in
    `_meta`, the policy a program reads (not safe to replay; settled by reconciliation of
    operation X, on the desk at URL)."""
    answer = tool_error(_unknown_text(op, why))
    answer.meta = {META_OUTCOME: "unknown", META_OPERATION: op.operation_id,
                   META_POLICY: unknown_policy(op)}
    return answer


def unknown_policy(op: Operation) -> dict[str, Any]:
    return {
        "retryable": False,             # calling again does not send it again
        "effect": "unsafe_to_replay",   # the effect may have happened: no blind resend
        "outcome": "unknown",
        "state": op.state,
        "settled_by": "reconciliation",
        "operation_id": op.operation_id,
        "operation": op.operation,
        "desk_url": service.desk_url(op),
        "retry": "call again later with the same arguments to get the settled result",
    }


def _unknown_text(op: Operation, why: str) -> str:
    return (f"The outcome is not known yet ({why}). Do not retry: operation {op.operation} "
            f"({op.operation_id}) is being reconciled by reading the upstream; call again "
            "later with the same arguments to get its result.")


def _text(result: types.CallToolResult) -> str:
    parts = [c.text for c in result.content if isinstance(c, types.TextContent)]
    return storable(" ".join(parts) or "the tool returned an error without text", 4000)


def _label(session: str | None) -> str:
    if not session:
        return ""
    if session.startswith(("stdio-", "in-process")):
        return session
    return "http-" + hashlib.sha256(session.encode()).hexdigest()[:16]


def _digest(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


def _keyed(value: Any) -> str:
    """A digest keyed with the server's SECRET_KEY: stable across restarts, and no one who
    reads the database can test a guess of the arguments (or the secret in them) against
    it."""
    return salted_hmac("agent-ledger.gateway", canonical_json(value),
                       algorithm="sha256").hexdigest()[:40]


def _new_key(call: str, after: int) -> str:
    """The default key of a new intent: the call's keyed digest and the id of the last
    earlier call it is not a retry of (0: none)."""
    return f"mcp-default:{_digest([call, after])[:40]}"


def _fields(default: dict[str, Any] | None) -> list[str]:
    """The intent's fingerprint: the tool and its stored arguments, and under the default
    key the keyed digest of the whole call (so arguments `keep` leaves out tell calls
    apart too)."""
    return ["tool", "arguments", "mcp.call"] if default is not None else ["tool", "arguments"]


def _redact_paths(tool: cfg.Tool) -> list[str]:
    return [f"arguments.{p}" for p in tool.redact]


def _size(result: types.CallToolResult) -> int:
    return len(result.model_dump_json(by_alias=True, exclude_none=True))


def _hints(tool: types.Tool) -> dict[str, Any]:
    """The annotations the upstream declares for `tool` (absent ones left out)."""
    if tool.annotations is None:
        return {}
    dumped = tool.annotations.model_dump(by_alias=True, exclude_none=True)
    return {k: v for k, v in dumped.items() if k in cfg.HINTS}


class _Unauthorized(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def _kept(arguments: dict[str, Any], keep: tuple[str, ...]) -> dict[str, Any]:
    """Only the dotted `keep` paths of `arguments`, nested as they were."""
    out: dict[str, Any] = {}
    for path in keep:
        value = cfg.lookup(arguments, path)
        if value is cfg.MISSING:
            continue
        parts = path.split(".")
        here = out
        for part in parts[:-1]:
            here = here.setdefault(part, {})
        here[parts[-1]] = value
    return out


def dumps(value: Any) -> str:
    return json.dumps(value, default=str)


def _denied(op: Operation, exc: ApprovalDenied) -> types.CallToolResult:
    return tool_error(
        f"Denied: a reviewer denied operation {op.operation} ({op.operation_id}): "
        f"{exc.reason}. It is not sent; do not retry.")
