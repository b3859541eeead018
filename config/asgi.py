"""The ASGI entry point, `config.asgi:application`: the MCP server's Streamable HTTP
transport at /mcp, Django (the desk, the admin, /api/v1/) everywhere else.

Lifespan events go to the MCP app, whose session manager must run while the server
serves; Django has no lifespan of its own. Serve it with an ASGI server, e.g.
`uvicorn config.asgi:application` or gunicorn's uvicorn worker.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_application = get_asgi_application()

from api.mcp import streamable_http_app  # noqa: E402 (needs the apps loaded above)

mcp_application = streamable_http_app()


async def application(scope, receive, send):
    if scope["type"] == "lifespan":
        return await mcp_application(scope, receive, send)
    path = scope.get("path", "")
    if scope["type"] == "http" and (path == "/mcp" or path.startswith("/mcp/")):
        return await mcp_application(scope, receive, send)
    return await django_application(scope, receive, send)
