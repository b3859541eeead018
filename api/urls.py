"""URLs of the agent API. Mounted at /api/v1/ by config.urls.

Every view here is public to the desk's LoginRequiredMiddleware (an agent has no session;
the API authenticates keys itself), and every error it answers is problem+json, including
those Django or ninja produce without our handlers (an unknown path, a wrong method).
"""

from functools import wraps

from django.contrib.auth.decorators import login_not_required
from django.urls import URLPattern, re_path
from django.views.decorators.csrf import csrf_exempt

from api import problems
from api.http import PROBLEM, api, problem_response

_TITLES = {400: "Bad request", 404: "Not found", 405: "Method not allowed",
           413: "Payload too large"}


def _problems_only(view):
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        response = view(request, *args, **kwargs)
        if response.status_code >= 400 and response.get("Content-Type") != PROBLEM:
            status = response.status_code
            allowed = response.get("Allow")
            detail = (f"expected one of the methods {allowed} at {request.path}, found "
                      f"{request.method}" if status == 405 else
                      f"expected a request this API answers, found {request.method} "
                      f"{request.path}")
            replaced = problem_response(problems.problem(
                status, "http-error", _TITLES.get(status, "Error"), detail))
            if allowed:
                replaced["Allow"] = allowed
            return replaced
        return response

    return login_not_required(wrapped)


@_problems_only
@csrf_exempt  # no session is ever used here: a POST to a wrong path is a 404, not a 403
def unknown_route(request, rest=""):
    return problem_response(problems.problem(
        404, "not-found", "Not found", f"expected an API route, found none at {request.path}"))


patterns, app_name, namespace = api.urls
for pattern in patterns:
    if isinstance(pattern, URLPattern):
        pattern.callback = _problems_only(pattern.callback)

urlpatterns = [*patterns, re_path(r"^(?P<rest>.*)$", unknown_route)]
