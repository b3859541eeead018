"""The agent's door on the MCP surfaces, shared by the ledger's own MCP server (`api.mcp`)
and the MCP gateway (`api.gateway`): who is calling, and where the call's ledger work runs.

- `Principal`: a request's agent key. Over Streamable HTTP, the bearer key
  `BearerKeyASGI` checked and put in the ASGI scope (under `SCOPE_KEY`); over stdio, the
  one secret the process was started with, checked again on every call, so revoking the
  key stops the session at its next call.
- `on_db_thread`: a function of the ledger's, run on the thread Django's ORM uses
  (thread-sensitive `sync_to_async`), so the event loop never waits on PostgreSQL.
- `BearerKeyASGI`: the check of the bearer key (and of the body's size) in front of an MCP
  app served over HTTP: anything without a live key gets a 401 before the SDK sees it.

What the key may then do is `api.service`'s, as for the HTTP API.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from django.db import close_old_connections, connection

from api import gate, problems, service
from ledger import conf as ledger_conf

if TYPE_CHECKING:
    from ledger.models import AgentKey

# Where `BearerKeyASGI` leaves the request's live key in the ASGI scope.
SCOPE_KEY = "ledger.agent_key"


class Principal:
    """Where a call's agent key comes from: one secret for the whole process (stdio), or
    each request's own bearer key (Streamable HTTP)."""

    def __init__(self, secret: str | None = None):
        self.secret = secret

    def current(self, request=None) -> AgentKey | None:
        """The live key of this call: the key `BearerKeyASGI` put in the scope of `request`
        (the HTTP request the call came in, None on stdio), else the stdio secret's key,
        checked now (a revoked key is None at its next call). Runs on the database
        thread."""
        if request is not None:
            return request.scope.get(SCOPE_KEY)
        return service.authenticate(self.secret) if self.secret else None


def on_db_thread(fn: Callable[..., Any], *, fresh: bool = True, release: bool = False):
    """`fn`, to be awaited on Django's thread-sensitive thread (the one its ORM uses).

    `fresh` (the first hop of a call): a connection found stale or broken is replaced
    first (a health check). Not fresh: a hop that follows the call's first within its
    timeout skips that round trip. After an error the connection is checked again, and
    `release` (a hop that ends a request, as Django's request_finished does) hands it
    back anyway: to the pool, or closed past CONN_MAX_AGE."""

    def run(*args, **kwargs):
        if fresh:
            close_old_connections()
        try:
            return fn(*args, **kwargs)
        finally:
            if release or connection.errors_occurred:
                close_old_connections()

    return sync_to_async(run, thread_sensitive=True)


# --- Streamable HTTP ---------------------------------------------------------------------


class BearerKeyASGI:
    """Lets through only requests with a live agent key (put in the scope for the tools,
    under SCOPE_KEY); anything else gets a 401 problem+json, before the MCP SDK sees it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        scheme, _, secret = header.partition(" ")
        key = None
        if scheme.lower() == "bearer" and secret:
            key = await on_db_thread(service.authenticate, release=True)(secret.strip())
        if key is None:
            return await _send_problem(send, problems.problem(
                401, "unauthenticated", "Unauthenticated",
                "expected an Authorization: Bearer header with a live agent key, found "
                + ("none" if not header else "a key that is malformed, unknown or revoked"),
            ), (b"www-authenticate", b'Bearer realm="agent-ledger"'))
        # The body, at most LEDGER_MAX_REQUEST_BYTES (api.gate), read before the SDK sees it.
        limit = ledger_conf.MAX_REQUEST_BYTES
        declared = gate.declared_length(dict(scope.get("headers") or ()).get(b"content-length"))
        if declared is not None and declared > limit:
            return await _send_problem(send, gate.too_large(declared), (b"connection", b"close"))
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > limit:
                return await _send_problem(send, gate.too_large(None),
                                           (b"connection", b"close"))
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app({**scope, SCOPE_KEY: key}, replay, send)


async def _send_problem(send, problem: dict[str, Any], *headers: tuple[bytes, bytes]) -> None:
    body = json.dumps(problem).encode()
    await send({"type": "http.response.start", "status": problem["status"], "headers": [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode()), *headers,
    ]})
    await send({"type": "http.response.body", "body": body})
