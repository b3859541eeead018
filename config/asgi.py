"""The ASGI entry point, `config.asgi:application`: the MCP server's Streamable HTTP
transport at /mcp, the agent API at /api/, Django (the desk, the admin) everywhere else.

Lifespan events go to the MCP app, whose session manager must run while the server
serves; Django has no lifespan of its own. Serve it with an ASGI server, e.g.
`uvicorn config.asgi:application` or gunicorn's uvicorn worker.
"""

import asyncio
import contextvars
import logging
import os
import tempfile

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_application = get_asgi_application()

from asgiref.sync import sync_to_async  # noqa: E402
from django.conf import settings  # noqa: E402 (after django.setup())
from django.core import signals  # noqa: E402
from django.core.exceptions import RequestAborted  # noqa: E402
from django.core.handlers.asgi import ASGIHandler, get_script_prefix  # noqa: E402
from django.db import close_old_connections  # noqa: E402
from django.urls import set_script_prefix  # noqa: E402

from api import gate, problems  # noqa: E402
from api.http import problem_response  # noqa: E402
from api.mcp import streamable_http_app  # noqa: E402
from ledger import conf as ledger_conf  # noqa: E402

logger = logging.getLogger("ledger.api")

# What the agent API needs of the desk's middleware: security headers and redirects, and
# the CSP and frame headers of its docs page. Keys, not sessions, authenticate it, so the
# session, CSRF, login, messages and htmx middleware have nothing to do there. The request
# id (config/logs.py) as on the desk: in the log lines and the X-Request-ID header.
API_MIDDLEWARE = [
    "config.logs.RequestIdMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]


class APIHandler(ASGIHandler):
    """Django's ASGI handler for the agent API, with API_MIDDLEWARE instead of
    settings.MIDDLEWARE, running each request's synchronous work in one call to a thread.

    The API's views are synchronous (the ledger writes in transactions). Django's own ASGI
    handler starts a thread per request and crosses to it and back about eight times (the
    request signals, every synchronous middleware hook, the view, the response's close),
    which cost more than the ledger's work (bench/ P8). Here the body is read on the event
    loop as Django reads it; then request_started, the request, the middleware chain and
    the view, the response's content, its close and request_finished all run in one
    call on one of the loop's executor threads (`run_in_executor` with a copy of the
    request's context, as `sync_to_async(thread_sensitive=False)` would run it, without
    asgiref's bookkeeping for calls back into the loop, which nothing here makes), in
    Django's order; the bytes are sent back on the loop. Everything Django does with
    database connections therefore happens on the thread that used them, as under WSGI:
    close_old_connections at the start and the end of the request (CONN_MAX_AGE 0: back to
    the pool). No request's code spans two calls, so the
    call need not be thread-sensitive, and requests run side by side on the loop's
    executor threads instead of queueing for one.

    The thread never calls back into the loop (no `async_to_sync`). An earlier version
    wrapped Django's WSGI handler in asgiref's WsgiToAsgi, which sends the response from
    the thread through `async_to_sync`: that marks the send's context with a
    CurrentThreadExecutor, and after a request body over uvicorn's 64 KiB high-water mark
    uvicorn resumed reading the socket from inside that send, so the connection's next
    request inherited the finished executor ("CurrentThreadExecutor already quit or is
    broken").

    A response that streams a synchronous iterator is read to its end on the thread, as
    Django's handler also reads it whole (`sync_to_async(list)`). One that streams an
    asynchronous iterator (the API has none) is sent from the loop and closed afterwards
    on an executor thread, its request's thread having closed its database connections
    first. Whatever fails outside the view's own handlers is answered as problem+json.
    """

    def __init__(self):
        super(ASGIHandler, self).__init__()  # BaseHandler: no async middleware chain
        desk = settings.MIDDLEWARE
        settings.MIDDLEWARE = API_MIDDLEWARE  # once, at start-up, before any request
        try:
            self.load_middleware(is_async=False)
        finally:
            settings.MIDDLEWARE = desk

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            raise ValueError(f"expected an HTTP connection, found {scope['type']}")
        try:
            body_file = await self.read_limited_body(scope, receive)
        except RequestAborted:
            return
        except BodyTooLarge as exc:
            response = problem_response(gate.too_large(exc.found))
            response["Connection"] = "close"  # the rest of the body is never read
            await self.send_headers(response, send)
            await send({"type": "http.response.body", "body": response.content})
            return
        try:
            response, content = await asyncio.get_running_loop().run_in_executor(
                None, contextvars.copy_context().run, self.serve, scope, body_file)
        except Exception:  # the handler itself failed: still an answer the API promises
            logger.exception("unexpected error serving %s", scope.get("path", ""))
            response = _internal_error()
            content = response.content
        await self.send_headers(response, send)
        if content is not None:
            for chunk, last in self.chunk_bytes(content):
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            return
        try:  # an asynchronous stream, sent as Django sends it, then closed
            async for part in aiter(response):
                for chunk, _ in self.chunk_bytes(part):
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
            await send({"type": "http.response.body"})
        finally:
            await sync_to_async(response.close, thread_sensitive=False)()

    async def read_limited_body(self, scope, receive):
        """The body, as Django's `read_body` reads it, but refused (BodyTooLarge) as soon as
        its declared or received length passes LEDGER_MAX_REQUEST_BYTES: an oversized body
        is never written to memory or disk whole."""
        limit = ledger_conf.MAX_REQUEST_BYTES
        headers = dict(scope.get("headers") or ())
        declared = gate.declared_length(headers.get(b"content-length"))
        if declared is not None and declared > limit:
            raise BodyTooLarge(declared)
        body_file = tempfile.SpooledTemporaryFile(  # noqa: SIM115 (the caller closes it)
            max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b")
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                body_file.close()
                raise RequestAborted()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                body_file.close()
                raise BodyTooLarge(None)
            body_file.write(chunk)
            if not message.get("more_body", False):
                break
        body_file.seek(0)
        return body_file

    def serve(self, scope, body_file):
        """One request from request_started to request_finished, on the calling thread.

        Returns (response, content): content is the body's bytes, or None for a response
        that streams an asynchronous iterator, which the caller sends and then closes.
        """
        with body_file:
            response = content = None
            try:
                set_script_prefix(get_script_prefix(scope))
                signals.request_started.send(sender=self.__class__, scope=scope)
                request, response = self.create_request(scope, body_file)
                response = (self.get_response(request) if request is not None
                            else _problem_for(response))
                if response.streaming and response.is_async:
                    close_old_connections()  # what request_finished does for this thread
                    return response, None
                content = (b"".join(response.streaming_content) if response.streaming
                           else response.content)
            except Exception:
                logger.exception("unexpected error serving %s", scope.get("path", ""))
            if response is None:
                signals.request_finished.send(sender=self.__class__)
            else:
                response.close()  # its closers, then request_finished
        if content is None:
            response = _internal_error()
            content = response.content
        return response, content

    async def send_headers(self, response, send):
        headers = []
        for header, value in response.items():
            headers.append((header.encode("ascii") if isinstance(header, str) else header,
                            value.encode("latin1") if isinstance(value, str) else value))
        for cookie in response.cookies.values():
            headers.append((b"Set-Cookie", cookie.OutputString().encode("ascii")))
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": headers})


class BodyTooLarge(Exception):
    def __init__(self, found: int | None):
        super().__init__(found)
        self.found = found


def _problem_for(response):
    """Django's plain-text refusals of a request it cannot build, as problem+json."""
    status = response.status_code
    title = "Payload too large" if status == 413 else "Bad request"
    return problem_response(problems.problem(
        status, "http-error", title,
        "expected a request Django can read, found " + (
            "a body over DATA_UPLOAD_MAX_MEMORY_SIZE" if status == 413 else
            "a path or headers that do not decode")))


def _internal_error():
    return problem_response(problems.problem(
        500, "internal-error", "Internal error",
        "expected to answer the request, found an internal error; it has been logged"))


def _pool_connections() -> None:
    """Served over ASGI, database connections come from a psycopg pool.

    Django closes its connection at the end of every request (CONN_MAX_AGE 0, which async
    code needs: a request is not tied to a thread); without a pool every request would open
    a new PostgreSQL connection and prepare the ledger's statements again. Set before the
    first connection is made; DJANGO_DB_POOL_MAX_SIZE=0 turns it off.
    """
    size = int(os.environ.get("DJANGO_DB_POOL_MAX_SIZE", "8"))
    if size > 0:
        options = settings.DATABASES["default"].setdefault("OPTIONS", {})
        options.setdefault("pool", {"min_size": 1, "max_size": size, "timeout": 10})


_pool_connections()
api_application = APIHandler()
mcp_application = streamable_http_app()


async def application(scope, receive, send):
    if scope["type"] == "lifespan":
        return await mcp_application(scope, receive, send)
    path = scope.get("path", "")
    if scope["type"] == "http":
        if path == "/mcp" or path.startswith("/mcp/"):
            return await mcp_application(scope, receive, send)
        if path.startswith("/api/"):
            return await api_application(scope, receive, send)
    return await django_application(scope, receive, send)
