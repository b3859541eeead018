"""gunicorn's uvicorn worker, recycled (max_requests) or stopped without dropping a request.

uvicorn's own shutdown closes every idle keep-alive connection at once. A client that has
just sent its next request on one of them finds the connection closed under it: on the
agent's side a call that was never made fails like one whose outcome is unknown (the
outside attack run saw 5 of 4,796 requests fail this way, each when a worker reached
max_requests). Here a worker that stops:

1. stops accepting (its listening sockets close; the other workers keep accepting on the
   socket they share with it);
2. lets every request in flight finish, each answered with `Connection: close`;
3. leaves idle keep-alive connections open: a request that arrives on one is answered,
   with `Connection: close`, and one that stays idle is closed by the ordinary keep-alive
   timeout (gunicorn's `keepalive`), as it would have been anyway;
4. exits when no connection is left, or after gunicorn's `graceful_timeout`.

Use it as gunicorn's worker_class `config.workers.GracefulUvicornWorker`
(config/gunicorn.conf.py does).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from gunicorn.arbiter import Arbiter
from uvicorn.server import Server
from uvicorn_worker import UvicornWorker

logger = logging.getLogger("uvicorn.error")


class DrainingServer(Server):
    draining = False

    async def shutdown(self, sockets=None) -> None:
        logger.info("Draining: no new connections; finishing requests in flight")
        self.draining = True
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            cycle = getattr(connection, "cycle", None)
            if cycle is not None and not cycle.response_complete:
                cycle.keep_alive = False  # answered with Connection: close, then closed
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                while self.server_state.connections or self.server_state.tasks:
                    await asyncio.sleep(0.05)
        except TimeoutError:
            logger.error("Draining took longer than %ss: closing %s connection(s)",
                         self.config.timeout_graceful_shutdown,
                         len(self.server_state.connections))
            for connection in list(self.server_state.connections):
                connection.shutdown()
            for task in self.server_state.tasks:
                task.cancel(msg="graceful shutdown timed out")
        for server in self.servers:
            await server.wait_closed()
        if not self.force_exit:
            await self.lifespan.shutdown()


def close_when_draining(app, server: DrainingServer):
    """`app`, whose every HTTP answer says `Connection: close` once `server` drains: a
    client never sends another request on a connection that is about to close."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_closing(message):
            if message["type"] == "http.response.start" and server.draining:
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        return await app(scope, receive, send_closing)

    return wrapped


def request_threads(database: dict | None = None) -> int | None:
    """How many threads a worker runs the agent API's requests on (config.asgi's
    APIHandler, the event loop's default executor): LEDGER_WEB_THREADS, else one fewer than
    the worker's database pool holds, since the desk's requests and the MCP tools' calls run
    on one thread of their own beside them (asgiref's thread-sensitive thread). Then every
    thread that runs a request finds a connection free, instead of waiting for one (up to
    LEDGER_DB_POOL_TIMEOUT, then 503). None without a pool: asyncio's default.
    `database`: settings.DATABASES["default"] unless given.
    """
    if os.environ.get("LEDGER_WEB_THREADS"):
        return max(1, int(os.environ["LEDGER_WEB_THREADS"]))
    if database is None:
        from django.conf import settings

        database = settings.DATABASES["default"]
    pool = (database.get("OPTIONS") or {}).get("pool")
    if not isinstance(pool, dict) or "max_size" not in pool:
        return None
    return max(1, int(pool["max_size"]) - 1)


class GracefulUvicornWorker(UvicornWorker):
    # uvloop's event loop and httptools' HTTP parser (both in C) instead of asyncio's own
    # loop and h11, the pure-Python parser: a fifth less of the server's CPU per API request
    # (docs/performance.md, P8cpu). Named, not "auto", so a missing one fails at start.
    CONFIG_KWARGS = {**UvicornWorker.CONFIG_KWARGS, "loop": "uvloop", "http": "httptools"}

    async def _serve(self) -> None:
        self.config.timeout_graceful_shutdown = self.cfg.graceful_timeout
        threads = request_threads()
        if threads is not None:
            asyncio.get_running_loop().set_default_executor(
                ThreadPoolExecutor(threads, thread_name_prefix="request"))
        server = DrainingServer(config=self.config)
        self.config.app = close_when_draining(self.wsgi, server)
        self._install_sigquit_handler()
        await server.serve(sockets=self.sockets)
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
