"""The project's error pages (config/urls.py: handler403, handler404, handler500).

None of them reads the database: under ASGI, Django renders an error page on another
thread than the request's (`response_for_exception` through `sync_to_async`), where the
desk's role switch (ledger.db_roles.RequestRoleMiddleware) does not apply, so a page that
read the session or the user there ran as ledger_agent and failed ("permission denied for
table django_session"), turning every unknown URL into a 500. The templates
(config/templates/error_base.html) are rendered without a request, so no context processor runs;
the page shows the request's id (config/logs.py), under which the log has the traceback.
Agents' paths (/api/, /mcp) get problem+json, as the API's own refusals.
"""

from __future__ import annotations

from django.http import HttpResponse
from django.template import loader

from ledger.db_roles import AGENT, kind_of_path


def _page(request, template: str, status: int) -> HttpResponse:
    content = loader.get_template(template).render(
        {"request_id": getattr(request, "request_id", "")})
    return HttpResponse(content, status=status)


def _for_agents(request) -> bool:
    return kind_of_path(request.path) == AGENT and not request.path.startswith("/static/")


def _problem(status: int, slug: str, title: str, detail: str) -> HttpResponse:
    from api import problems
    from api.http import problem_response

    return problem_response(problems.problem(status, slug, title, detail))


def forbidden(request, exception=None):
    if _for_agents(request):
        return _problem(403, "http-error", "Forbidden",
                        f"expected a request this key may make, found {request.path}")
    return _page(request, "403.html", 403)


def not_found(request, exception=None):
    if _for_agents(request):
        return _problem(404, "http-error", "Not found",
                        f"expected a request this API answers, found {request.method} "
                        f"{request.path}")
    return _page(request, "404.html", 404)


def server_error(request):
    if _for_agents(request):
        return _problem(500, "internal-error", "Internal error",
                        "expected to answer the request, found an internal error; it has "
                        f"been logged under request id {getattr(request, 'request_id', '-')}")
    return _page(request, "500.html", 500)
