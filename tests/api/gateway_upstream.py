"""An upstream MCP server for the gateway's tests and benchmark, on the official SDK's
low-level `Server` over stdio (full control of what it declares and what it returns).

Tools:
- create_invoice(customer, amount, reference): the consequential one. Each call that
  succeeds appends one invoice to the state file (UPSTREAM_STATE, a JSON file locked with
  flock, shared with every other process of this server): its own count of effects. An
  amount <= 0 is refused (isError) and changes nothing.
- find_invoice(reference): the read tool: {"status": "found", "invoice": {...}} or
  {"status": "absent", "invoice": null}.
- noop(n): does nothing (the benchmark); reports progress n times when the caller asked
  for progress.
A resource (invoices://count), a prompt (summary) and completions show non-tool requests
passing through.
`--http PORT` serves it over Streamable HTTP instead of stdio.

Each invoice created appends the protocol version its call came in to the state file's
"protocols": which era the gateway spoke to this server. UPSTREAM_PROTOCOL=legacy makes it
a server of before 2026-07-28: it refuses `server/discover` (method not found), so a client
falls back to the initialize handshake. A create_invoice for the customer "ask" asks for
input (a 2026-07-28 `input_required` result) instead of acting.

UPSTREAM_BEHAVIOUR changes what create_invoice answers, after the effect is committed:
"lie" (a structured result that breaks the output schema it declares), "no_id" (a result
without the `id` the gateway is configured to read), "huge" (a result of 2 MB).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import anyio
import mcp_types as types
from mcp.server.lowlevel.server import Server
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage
from mcp_types.jsonrpc import ErrorData, JSONRPCError, JSONRPCRequest

STATE = Path(os.environ.get("UPSTREAM_STATE", "upstream-state.json"))
BEHAVIOUR = os.environ.get("UPSTREAM_BEHAVIOUR", "normal")
PROTOCOL = os.environ.get("UPSTREAM_PROTOCOL", "any")

INVOICE = {"type": "object", "properties": {
    "id": {"type": "string"}, "customer": {"type": "string"}, "amount": {"type": "integer"},
    "reference": {"type": "string"}}, "required": ["id", "customer", "amount", "reference"]}

TOOLS = [
    types.Tool(
        name="create_invoice", description="Create an invoice (one per call).",
        input_schema={"type": "object", "properties": {
            "customer": {"type": "string"}, "amount": {"type": "integer"},
            "reference": {"type": "string"}}, "required": ["customer", "amount", "reference"]},
        output_schema=INVOICE if BEHAVIOUR != "no_id" else {"type": "object"},
    ),
    types.Tool(
        name="find_invoice", description="Find the invoice of a reference.",
        input_schema={"type": "object", "properties": {"reference": {"type": "string"}},
                      "required": ["reference"]},
        output_schema={"type": "object", "properties": {
            "status": {"type": "string", "enum": ["found", "absent"]},
            "invoice": {"anyOf": [INVOICE, {"type": "null"}]}}, "required": ["status"]},
    ),
    types.Tool(name="noop", description="Does nothing.",
               input_schema={"type": "object", "properties": {"n": {"type": "integer"}}}),
]


@contextmanager
def locked_state():
    STATE.touch(exist_ok=True)
    with STATE.open("r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        text = handle.read()
        state = json.loads(text) if text.strip() else {"invoices": []}
        state.setdefault("invoices", [])
        yield state
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(state))
        handle.flush()
        os.fsync(handle.fileno())


def result(structured: dict) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text",
                                                           text=json.dumps(structured))],
                                structured_content=structured)


async def list_tools(ctx, params) -> types.ListToolsResult:
    return types.ListToolsResult(tools=TOOLS)


async def call_tool(ctx, params: types.CallToolRequestParams
                    ) -> types.CallToolResult | types.InputRequiredResult:
    args = params.arguments or {}
    if params.name == "noop":
        for step in range(int(args.get("n") or 0)):
            await ctx.session.report_progress(step + 1, args["n"], f"step {step + 1}")
        return types.CallToolResult(content=[types.TextContent(type="text", text="ok")])
    if params.name == "find_invoice":
        with locked_state() as state:
            found = [i for i in state["invoices"] if i["reference"] == args.get("reference")]
        return result({"status": "found", "invoice": found[0]} if found
                      else {"status": "absent", "invoice": None})
    if params.name == "create_invoice":
        if args.get("customer") == "busy":  # a transient refusal, for on_error patterns
            return types.CallToolResult(content=[types.TextContent(
                type="text", text="503 Service Unavailable: try again later")], is_error=True)
        if BEHAVIOUR == "slow":  # the reply comes after the call was settled
            await anyio.sleep(5)
        if args.get("customer") == "ask":  # a tool that asks for input before it acts
            return types.InputRequiredResult(input_requests={"confirm": types.ElicitRequest(
                params=types.ElicitRequestFormParams(
                    message="Really create it?", requested_schema={
                        "type": "object", "properties": {"yes": {"type": "boolean"}}}))})
        if not isinstance(args.get("amount"), int) or args["amount"] <= 0:
            refusal = f"amount must be a positive integer, got {args.get('amount')!r}"
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=refusal)], is_error=True)
        with locked_state() as state:
            invoice = {"id": f"inv-{len(state['invoices']) + 1}",
                       "customer": str(args.get("customer")), "amount": args["amount"],
                       "reference": str(args.get("reference"))}
            state["invoices"].append(invoice)
            state.setdefault("protocols", []).append(ctx.protocol_version)
        if BEHAVIOUR == "lie":
            return result({"number": 7})
        if BEHAVIOUR == "no_id":
            return result({"invoice_number": invoice["id"]})
        if BEHAVIOUR == "huge":
            return result({**invoice, "pdf": "x" * 2_000_000})
        return result(invoice)
    raise ValueError(f"unknown tool {params.name}")


async def list_resources(ctx, params) -> types.ListResourcesResult:
    return types.ListResourcesResult(resources=[types.Resource(
        uri="invoices://count", name="count", mime_type="text/plain")])


async def read_resource(ctx, params) -> types.ReadResourceResult:
    with locked_state() as state:
        count = len(state["invoices"])
    return types.ReadResourceResult(contents=[types.TextResourceContents(
        uri=str(params.uri), mime_type="text/plain", text=str(count))])


async def list_prompts(ctx, params) -> types.ListPromptsResult:
    return types.ListPromptsResult(prompts=[types.Prompt(name="summary",
                                                         description="Summarize invoices.")])


async def get_prompt(ctx, params) -> types.GetPromptResult:
    return types.GetPromptResult(messages=[types.PromptMessage(
        role="user", content=types.TextContent(type="text", text="Summarize the invoices."))])


async def complete(ctx, params) -> types.CompleteResult:
    return types.CompleteResult(completion=types.Completion(values=["acme", "ada"]))


server = Server("invoices-upstream", version="1", on_list_tools=list_tools,
                on_call_tool=call_tool, on_list_resources=list_resources,
                on_read_resource=read_resource, on_list_prompts=list_prompts,
                on_get_prompt=get_prompt, on_completion=complete)


async def main() -> None:
    async with stdio_server() as (read, write):
        if PROTOCOL != "legacy":
            await server.run(read, write, server.create_initialization_options())
            return
        send, receive = anyio.create_memory_object_stream(16)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(before_2026, read, write, send)
            await server.run(receive, write, server.create_initialization_options())
            tasks.cancel_scope.cancel()


async def before_2026(read, write, send) -> None:
    """Passes `read` on to `send` as a server of before 2026-07-28 sees it: `server/discover`
    is a method it does not know, answered "method not found" here."""
    async with send:
        async for message in read:
            root = getattr(message, "message", None)
            if isinstance(root, JSONRPCRequest) and root.method == "server/discover":
                await write.send(SessionMessage(JSONRPCError(
                    jsonrpc="2.0", id=root.id, error=ErrorData(
                        code=types.METHOD_NOT_FOUND, message="Method not found"))))
                continue
            await send.send(message)


def main_http(port: int) -> None:
    """The same server over Streamable HTTP at http://127.0.0.1:PORT/mcp."""
    import uvicorn

    uvicorn.run(server.streamable_http_app(), host="127.0.0.1", port=port,
                log_level="warning")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        main_http(int(sys.argv[2]))
    else:
        sys.exit(anyio.run(main))
