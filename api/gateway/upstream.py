"""The gateway's MCP client side: one session to the upstream server, kept open by an owner
task and reopened after it broke (the upstream process died, its HTTP endpoint went away).

The SDK's client opens task groups of its own, so it is entered and left in one task: the
owner task here. Request handlers only borrow the open session (`client()`); a handler that
finds the connection closed calls `broken()` and the owner opens a new one.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any

import anyio
import mcp_types as types
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from api.gateway.config import Upstream

logger = logging.getLogger("api.gateway")


class UpstreamUnreachable(RuntimeError):
    """The upstream MCP server did not answer: what was tried, what happened."""


def make_client(spec: Upstream) -> tuple[Client, Any]:
    """(an un-entered SDK client for the upstream, its httpx client or None). No response
    cache: every list and read reaches the upstream, as a pass-through must. The protocol
    is negotiated as `[upstream] protocol` says (by default as the SDK does: 2026-07-28
    when the upstream answers server/discover, else the initialize handshake)."""
    # No sampling or elicitation callback: the gateway does not advertise them (it cannot
    # put an upstream's question to the model in the middle of a receipted call), so a
    # conforming upstream does not ask; one that asks anyway is refused by the SDK.
    # For the same reason, a 2026-07-28 tool's request for input (`input_required`) ends
    # the call at once (InputRequiredRoundsExceededError), answered by the gateway.
    options: dict[str, Any] = {"cache": None, "mode": spec.protocol,
                               "input_required_max_rounds": 0}
    if spec.command:
        params = StdioServerParameters(command=spec.command[0], args=list(spec.command[1:]),
                                       env=dict(spec.env) or None, cwd=spec.cwd)
        return Client(params, **options), None
    http = create_mcp_http_client(headers=dict(spec.headers) or None)
    return Client(streamable_http_client(spec.url, http_client=http), **options), http


@asynccontextmanager
async def open_client(spec: Upstream):
    """One connection, entered and left in the caller's task (the reconciler's reads)."""
    client, http = make_client(spec)
    try:
        await client.__aenter__()
    except Exception as exc:
        if http is not None:
            await http.aclose()
        raise UpstreamUnreachable(_unreachable(spec, exc)) from exc
    try:
        yield client
    finally:
        await client.__aexit__(None, None, None)
        if http is not None:
            await http.aclose()


def _unreachable(spec: Upstream, exc: BaseException) -> str:
    what = ("no answer within "
            f"{spec.connect_timeout:g} s" if isinstance(exc, TimeoutError) else _describe(exc))
    return (f"expected the upstream MCP server ({'url' if spec.url else 'command'} "
            f"{spec.describe()!r}) to answer the MCP handshake, found {what}")


def _describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:500]


class UpstreamLink:
    """The gateway's one upstream session, owned by `run` (start it in a task group)."""

    def __init__(self, spec: Upstream):
        self.spec = spec
        self._client: Client | None = None
        self._ready = anyio.Event()
        self._broken = anyio.Event()
        self._failure: BaseException | None = None
        self._stopped = False

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Connect, serve until broken, reconnect; the first failure to connect ends it
        (`started()` raises it). No timeout or shield scope wraps the client: its own task
        groups must nest in this task's scopes. `started()` bounds the first wait."""
        first = True
        while True:
            client, http = make_client(self.spec)
            connected = False
            try:
                async with client:
                    connected = True
                    self._client = client
                    self._ready.set()
                    if first:
                        task_status.started()
                        first = False
                    await self._broken.wait()
            except Exception as exc:
                if not connected and first:
                    self._failure = UpstreamUnreachable(_unreachable(self.spec, exc))
                    self._ready.set()
                    return
                logger.warning("gateway: the upstream session ended: %s", _describe(exc))
                await anyio.sleep(1.0)
            finally:
                self._client = None
                if self._failure is None:
                    self._ready = anyio.Event()
                self._broken = anyio.Event()
                if http is not None:
                    with anyio.CancelScope(shield=True):
                        await http.aclose()

    async def started(self) -> None:
        """Wait for the first connection (up to `connect_timeout`); UpstreamUnreachable
        if it failed or did not come."""
        with anyio.move_on_after(self.spec.connect_timeout):
            await self._ready.wait()
        if not self._ready.is_set():
            raise UpstreamUnreachable(_unreachable(self.spec, TimeoutError()))
        if self._failure is not None:
            raise self._failure

    @property
    def current(self) -> Client | None:
        """The open session, or None while there is none."""
        return self._client

    async def client(self, timeout: float) -> Client:
        """The open session, waiting up to `timeout` seconds for a reconnection."""
        with anyio.move_on_after(timeout):
            await self._ready.wait()
        if self._client is None:
            raise UpstreamUnreachable(
                f"expected a connection to the upstream MCP server "
                f"{self.spec.describe()!r}, found none (it is being reopened)")
        return self._client

    def broken(self, client: Client) -> None:
        """The session `client` failed with a closed connection: open a new one."""
        if client is self._client:
            self._client = None
            self._broken.set()

    async def list_all_tools(self, timeout: float) -> list[types.Tool]:
        client = await self.client(timeout)
        tools: list[types.Tool] = []
        cursor = None
        for _ in range(100):
            with anyio.fail_after(timeout):
                page = await client.session.list_tools(
                    params=types.PaginatedRequestParams(cursor=cursor) if cursor else None)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        return tools
