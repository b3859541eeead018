"""The MCP server (official `mcp` SDK): the ledger as explicit tools in an agent's trace.

Two transports, one set of tools: stdio (`manage.py mcp`, the key given once at start) and
Streamable HTTP at /mcp (`config.asgi`; every request carries `Authorization: Bearer`,
checked by `BearerKeyASGI`). Each tool calls the same `api.service` function as the HTTP
API, as the key the shared `api.agent.Principal` gives, on the ORM's thread
(`api.agent.on_db_thread`): the event loop never blocks on the database. A ledger refusal
comes back as a tool error (`isError`) whose text is the ledger's message, so the model can
read what was expected and what it found.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any

from django.conf import settings
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings
from pydantic import Field

from api import problems, service
from api.agent import SCOPE_KEY, BearerKeyASGI, Principal, on_db_thread
from ledger.errors import LedgerError

# The stdio session's key (`manage.py mcp`): the shared principal, under its former name.
StdioKey = Principal

__all__ = ["SCOPE_KEY", "BearerKeyASGI", "Principal", "StdioKey", "build_server",
           "streamable_http_app", "tool_error_text"]

INSTRUCTIONS = """\
Agent Ledger is the system of record for what you do to the outside world. Before any call
with an external effect (an email, a payment, an API write), call ledger_record_intent. If
the operation it returns is not `planned`, the effect was already attempted under that
idempotency key: do NOT send again. Otherwise call ledger_mark_submitted, send, then record
how it ended: ledger_mark_succeeded, ledger_mark_rejected (the service refused and did
nothing) or ledger_mark_outcome_unknown (a timeout or dropped connection: never guess
"failed"). Facts (state_*) are versioned beliefs: pass expected_version to supersede.
A tool error quotes the ledger: read "expected ..., found ..." and act on it."""

Text = Annotated[str, Field(min_length=1)]
OperationId = Annotated[str, Field(description="The operation_id ledger_record_intent returned.")]
ExpectedVersion = Annotated[
    int | None,
    Field(default=None, ge=1, le=2**31 - 1, strict=True,
          description="The operation version you last saw; refused if it moved on since."),
]
FencingToken = Annotated[
    int | None,
    Field(default=None, ge=0, le=2**63 - 1, strict=True,
          description="The token run_resume gave you, when you work on a leased run. A "
          "refusal (stale fencing token) means another worker took the run over: stop."),
]
Tenant = Annotated[str | None, Field(default=None,
                                     description="Default: your key's only tenant.")]


def _call(ctx: Context, fn: Callable[..., Any], *args, **kwargs) -> Any:
    """Run `fn(key, ...)` on the thread Django's ORM uses, the connection handed back after
    it as at a request's end; ledger refusals -> tool errors."""
    request = ctx.request_context.request
    principal: Principal = getattr(ctx.mcp_server, "ledger_principal", None) or Principal()

    def run():
        try:
            key = principal.current(request)
            if key is None:
                raise ToolError(
                    "Unauthenticated: expected a live agent key, found it revoked or unknown"
                )
            return fn(key, *args, **kwargs)
        except LedgerError as exc:
            raise ToolError(tool_error_text(problems.from_ledger_error(exc))) from None

    return on_db_thread(run, release=True)()


def tool_error_text(problem: dict[str, Any]) -> str:
    """"<title> (<error>): <the ledger's message>", then what the caller needs to go on."""
    extra = {k: v for k, v in problem.items()
             if k not in ("type", "title", "status", "detail", "error")}
    text = f"{problem['title']} ({problem.get('error', '')}): {problem['detail']}"
    return text + (f"\n{json.dumps(extra, default=str)}" if extra else "")


def build_server(principal: Principal | None = None) -> MCPServer:
    """The ledger's MCP tools, acting as `principal` (over stdio: `Principal(secret)`; over
    HTTP none: each request's bearer key)."""
    # The SDK configures the root logger (a console handler) when it has none; here the
    # project's LOGGING setting owns logging, so that is undone.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    server = MCPServer(
        name="agent-ledger", title="Agent Ledger", version="1", instructions=INSTRUCTIONS,
        log_level="WARNING",
    )
    root.handlers[:] = handlers
    root.setLevel(level)
    server.ledger_principal = principal

    @server.tool(
        name="ledger_record_intent",
        description="Call BEFORE any external call with an effect (send, pay, create, "
        "delete). Records the intent and returns {created, operation}. If operation.state is "
        "not 'planned', this idempotency key was used before: do NOT send again; report "
        "the operation instead. Reuse the same idempotency_key when you retry the same "
        "action. Error 'Idempotency key reused': that key names a different intent; use a "
        "new key only if this really is a different action.",
    )
    async def ledger_record_intent(
        ctx: Context,
        operation: Annotated[str, Field(description="What the call does, e.g. 'mail.send'.")],
        target: Annotated[str, Field(description="Where it goes, e.g. a URL.")],
        intent: Annotated[dict[str, Any], Field(description="The request you will send; "
                                                "secret-named keys are redacted.")],
        account: Annotated[str | None, Field(
            default=None, description="Which account at the provider the call acts as "
            "(e.g. a Stripe account id or a mailbox): a label, never a credential.")] = None,
        idempotency_key: Annotated[str | None, Field(
            default=None, description="Stable for this action; omit it with a run and step "
            "to get the key derived from them, or without a step to get a fresh one.")] = None,
        tenant: Tenant = None,
        run: Annotated[str | None, Field(default=None, description="A run_id.")] = None,
        step: Annotated[str | None, Field(default=None,
                                          description="A step_id of the run.")] = None,
        call: Annotated[str | None, Field(
            default=None, description="Tells apart several calls of one operation in one "
            "step (with run and step, without idempotency_key).")] = None,
        retry_policy: Annotated[str, Field(
            default="if_absent_proven", description="'never' if a retry must be decided "
            "by a person even when the effect is proven absent.")] = "if_absent_proven",
        keep: Annotated[list[str] | None, Field(
            default=None, description="Dotted paths, e.g. ['to', 'subject']: only these "
            "fields of the intent are stored and fingerprinted; the rest (bodies, personal "
            "data) never reach the ledger.")] = None,
        relies_on: Annotated[list[dict[str, Any]] | None, Field(
            default=None, description="The facts you planned this on, each {subject, "
            "predicate, version} as state_read_facts returned it: if one has been "
            "superseded, ledger_mark_submitted refuses (Stale fact); read the facts again "
            "and re-plan.")] = None,
    ) -> dict[str, Any]:
        data, created = await _call(
            ctx, service.record_intent, operation=operation, target=target, intent=intent,
            idempotency_key=idempotency_key, tenant=tenant, run=run, step=step, call=call,
            retry_policy=retry_policy, keep=keep, relies_on=relies_on, account=account,
        )
        return {"created": created, "operation": data}

    @server.tool(
        name="ledger_mark_submitted",
        description="Call right before you send the request recorded by "
        "ledger_record_intent (state planned, or safe_to_retry for a retry a person or "
        "the reconciler allowed). Error 'Illegal transition': the operation is not in a "
        "state you may send from; do not send.",
    )
    async def ledger_mark_submitted(
        ctx: Context,
        operation_id: OperationId,
        expected_version: ExpectedVersion = None,
        fencing_token: FencingToken = None,
        in_flight_seconds: Annotated[float | None, Field(
            default=None, gt=0, le=86400,
            description="How long the request may still land after a timeout.")] = None,
    ) -> dict[str, Any]:
        return await _call(ctx, service.mark, operation_id, "submitted",
                           expected_version=expected_version, fencing_token=fencing_token,
                           in_flight_seconds=in_flight_seconds)

    @server.tool(
        name="ledger_mark_succeeded",
        description="Call when the external system confirmed the submitted request; pass "
        "the id it gave (external_id). Error 'Stale version' or 'Illegal transition': "
        "someone else recorded an outcome first; read it with ledger_get_operation.",
    )
    async def ledger_mark_succeeded(
        ctx: Context,
        operation_id: OperationId,
        external_id: Annotated[str | None, Field(default=None)] = None,
        evidence: Annotated[Any, Field(default=None,
                                       description="What the response showed.")] = None,
        expected_version: ExpectedVersion = None,
        fencing_token: FencingToken = None,
    ) -> dict[str, Any]:
        return await _call(ctx, service.mark, operation_id, "succeeded",
                           external_id=external_id, evidence=evidence,
                           expected_version=expected_version, fencing_token=fencing_token)

    @server.tool(
        name="ledger_mark_rejected",
        description="Call when the external system REFUSED the request and did nothing "
        "(e.g. a 4xx validation error). Not for timeouts: use "
        "ledger_mark_outcome_unknown when you do not know whether it took effect.",
    )
    async def ledger_mark_rejected(
        ctx: Context,
        operation_id: OperationId,
        error_code: Annotated[str, Field(description="e.g. 'HTTP 422'.")],
        detail: str = "",
        expected_version: ExpectedVersion = None,
        fencing_token: FencingToken = None,
    ) -> dict[str, Any]:
        return await _call(ctx, service.mark, operation_id, "rejected", error_code=error_code,
                           detail=detail, expected_version=expected_version,
                           fencing_token=fencing_token)

    @server.tool(
        name="ledger_mark_outcome_unknown",
        description="Call when the request was sent but you cannot tell whether it took "
        "effect (timeout, dropped connection, 5xx after sending). Do NOT retry yourself: "
        "the ledger reconciles it by reading the external system, or a person decides.",
    )
    async def ledger_mark_outcome_unknown(
        ctx: Context,
        operation_id: OperationId,
        error_code: Annotated[str, Field(description="e.g. 'TimeoutError'.")],
        detail: str = "",
        expected_version: ExpectedVersion = None,
        fencing_token: FencingToken = None,
    ) -> dict[str, Any]:
        return await _call(ctx, service.mark, operation_id, "outcome_unknown",
                           error_code=error_code, detail=detail,
                           expected_version=expected_version, fencing_token=fencing_token)

    @server.tool(
        name="ledger_request_approval",
        description="Ask a person to approve a planned operation before you send it (an "
        "approval policy asks for it: ledger_mark_submitted's error 'Approval required', "
        "or you judge the call consequential). Returns the operation with approval.status; "
        "poll ledger_get_operation until it is 'approved' (then send the operation's "
        "intent, which a reviewer may have edited) or 'denied' (do NOT send; "
        "approval.denied_reason says why).",
    )
    async def ledger_request_approval(
        ctx: Context,
        operation_id: OperationId,
        note: Annotated[str, Field(default="", max_length=2000,
                                   description="What the reviewer should know.")] = "",
    ) -> dict[str, Any]:
        return await _call(ctx, service.request_approval, operation_id, note=note)

    @server.tool(
        name="ledger_get_operation",
        description="Read an operation's receipt with its events, evidence and approval "
        "status: its state, version, who changed it and why. Use it before acting again on "
        "an operation, and after a refusal. Error 'Not found': no such operation in your tenants.",
    )
    async def ledger_get_operation(ctx: Context, operation_id: OperationId) -> dict[str, Any]:
        return await _call(ctx, service.get_operation, operation_id)

    @server.tool(
        name="state_read_facts",
        description="Read what is currently believed about a subject: the current version "
        "of each predicate, with its source and version. Read before you assert, and pass "
        "that version as expected_version to change a value. A fact whose expiry has "
        "passed is left out (include_expired=true shows it, marked expired=true): read it "
        "again from its source and assert it anew.",
    )
    async def state_read_facts(
        ctx: Context, subject: Text, tenant: Tenant = None,
        include_expired: Annotated[bool, Field(
            default=False, description="Also expired facts, marked expired=true.")] = False,
    ) -> dict[str, Any]:
        return {"facts": await _call(ctx, service.read_facts, subject, tenant=tenant,
                                     include_expired=include_expired)}

    @server.tool(
        name="state_assert_fact",
        description="Record that subject's predicate is value. To change a value pass the "
        "current version as expected_version. A different value without the current "
        "version is NOT applied: it comes back with is_candidate=true and a conflict a "
        "person decides; keep working from the current value. The same value again "
        "records nothing new. expires_at or ttl_seconds: when the fact stops being current "
        "(an action relying on it is then refused as a stale fact).",
    )
    async def state_assert_fact(
        ctx: Context,
        subject: Text,
        predicate: Text,
        value: Any,
        source: Annotated[str | None, Field(
            default=None, description="Where you read it, e.g. 'crm'.")] = None,
        expected_version: ExpectedVersion = None,
        tenant: Tenant = None,
        run: Annotated[str | None, Field(default=None, description="A run_id.")] = None,
        fencing_token: FencingToken = None,
        expires_at: Annotated[datetime | None, Field(
            default=None, description="When the fact stops being current (ISO 8601 with a "
            "time zone); not with ttl_seconds.")] = None,
        ttl_seconds: Annotated[float | None, Field(
            default=None, gt=0, le=315360000,
            description="Seconds from now until the fact stops being current.")] = None,
    ) -> dict[str, Any]:
        return await _call(ctx, service.assert_fact, subject=subject, predicate=predicate,
                           value=value, source=source, expected_version=expected_version,
                           tenant=tenant, run=run, fencing_token=fencing_token,
                           expires_at=expires_at, ttl_seconds=ttl_seconds)

    @server.tool(
        name="state_open_obligation",
        description="Record a promise of a run to do something exactly once (e.g. 'refund "
        "order 42'), named by a key. Opening the same key again returns it as it is.",
    )
    async def state_open_obligation(
        ctx: Context,
        run: Annotated[str, Field(description="The run_id that owes it.")],
        kind: Text,
        key: Annotated[str, Field(description="A stable key for this obligation.")],
        fencing_token: FencingToken = None,
        tenant: Tenant = None,
    ) -> dict[str, Any]:
        return await _call(ctx, service.open_obligation, run=run, kind=kind,
                           obligation_key=key, fencing_token=fencing_token, tenant=tenant)

    @server.tool(
        name="state_commit",
        description="Commit an open obligation with its result, exactly once. Error "
        "'Already committed': it was done before (by you or another worker); the error "
        "carries the winner's result: use that result, do not do the work again.",
    )
    async def state_commit(
        ctx: Context,
        key: Annotated[str, Field(description="The obligation's key.")],
        result: Any = None,
        fencing_token: FencingToken = None,
        tenant: Tenant = None,
    ) -> dict[str, Any]:
        return await _call(ctx, service.commit_obligation, key, result=result,
                           fencing_token=fencing_token, tenant=tenant)

    @server.tool(
        name="run_start",
        description="Start a run (a task you may resume later); starting the same run_id "
        "again returns it.",
    )
    async def run_start(
        ctx: Context,
        objective: Text,
        run_id: Annotated[str | None, Field(default=None)] = None,
        tenant: Tenant = None,
    ) -> dict[str, Any]:
        return await _call(ctx, service.start_run, objective=objective, tenant=tenant,
                           run_id=run_id)

    @server.tool(
        name="run_add_step",
        description="Add a step to a run (adding it again returns it), depending on steps "
        "already added. Once the run is leased (run_resume), pass its fencing_token: a "
        "step added without it, or with an older one, is refused (stale fencing token).",
    )
    async def run_add_step(
        ctx: Context,
        run_id: Text,
        step_id: Text,
        depends_on: Annotated[list[str] | None, Field(
            default=None, description="The step_ids it depends on, added before it.")] = None,
        fencing_token: FencingToken = None,
        tenant: Tenant = None,
    ) -> dict[str, Any]:
        return await _call(ctx, service.add_step, run_id, step_id=step_id,
                           depends_on=depends_on or [], tenant=tenant,
                           fencing_token=fencing_token)

    @server.tool(
        name="run_resume",
        description="Take over a run (after a crash, or to continue it) and read where it "
        "stands from the record: steps, open operations, pending obligations, facts. "
        "Returns a fencing token: pass it on every write for this run. Error 'Lease held': "
        "another worker holds the run; wait until expires_at.",
    )
    async def run_resume(
        ctx: Context,
        run_id: Text,
        ttl_seconds: Annotated[float | None, Field(default=None, gt=0, le=86400)] = None,
        tenant: Tenant = None,
    ) -> dict[str, Any]:
        return await _call(ctx, service.resume, run_id, ttl_seconds=ttl_seconds,
                           tenant=tenant)

    return server


# --- Streamable HTTP ---------------------------------------------------------------------


def streamable_http_app():
    """The Starlette app serving POST /mcp (stateless, JSON responses: any worker of any
    process answers any request), behind the bearer-key check. Its lifespan runs the SDK's
    session manager, so the ASGI server must pass lifespan events to it (config.asgi)."""
    hosts = list(settings.ALLOWED_HOSTS)
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection="*" not in hosts,
        allowed_hosts=[h for host in hosts for h in (host, f"{host}:*")],
        allowed_origins=[f"{scheme}://{host}{port}" for host in hosts
                         for scheme in ("http", "https") for port in ("", ":*")],
    )
    app = build_server().streamable_http_app(
        streamable_http_path="/mcp", stateless_http=True, json_response=True,
        transport_security=security,
    )
    return BearerKeyASGI(app)
