"""The ASGI entry point, `config.asgi:application`: the MCP server's Streamable HTTP
transport at /mcp, the agent API at /api/, Django (the desk, the admin) everywhere else.

Lifespan events go to the MCP app, whose session manager must run while the server
serves; Django has no lifespan of its own. Serve it with an ASGI server, e.g.
`uvicorn config.asgi:application` or gunicorn's uvicorn worker.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_application = get_asgi_application()

from django.conf import settings  # noqa: E402 (after django.setup())
from django.core.handlers.asgi import ASGIHandler  # noqa: E402

from api.mcp import streamable_http_app  # noqa: E402

# What the agent API needs of the desk's middleware: security headers and redirects, and
# the CSP and frame headers of its docs page. Keys, not sessions, authenticate it, so the
# session, CSRF, login, messages and htmx middleware have nothing to do there, and under
# ASGI every synchronous middleware hook is a hop to the worker thread and back.
API_MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]


class APIHandler(ASGIHandler):
    """Django's ASGI handler with API_MIDDLEWARE instead of settings.MIDDLEWARE."""

    def load_middleware(self, is_async=False):
        desk = settings.MIDDLEWARE
        settings.MIDDLEWARE = API_MIDDLEWARE  # once, at start-up, before any request
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = desk


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
