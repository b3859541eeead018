"""Endpoints for operators' machines, not people: `/healthz` and `/metrics`.

Neither needs a login (a load balancer and Prometheus have no session). `/healthz` says
only whether each check passed; `/metrics` needs `Authorization: Bearer
<LEDGER_METRICS_TOKEN>` and is switched off (404) while no token is configured, because
its labels name tenants. The reads live in `ledger.health` and `ledger.metrics`.
"""

from __future__ import annotations

import hmac
import json

from django.contrib.auth.decorators import login_not_required
from django.http import HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client.exposition import choose_encoder

from ledger import conf, health, metrics


def _problem(status: int, title: str, detail: str, **headers: str) -> HttpResponse:
    response = HttpResponse(json.dumps({"type": "about:blank", "title": title,
                                        "status": status, "detail": detail}),
                            status=status, content_type="application/problem+json")
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


@login_not_required
@never_cache
@require_GET
def healthz(request):
    """200 when every critical check passes (warnings included in the body), else 503."""
    report = health.run()
    return JsonResponse(report.as_dict(), status=200 if report.is_healthy else 503)


@login_not_required
@never_cache
@require_GET
def metrics_view(request):
    token = conf.METRICS_TOKEN
    if not token:
        return _problem(404, "Metrics are disabled",
                        "expected LEDGER_METRICS_TOKEN to be configured on the server, "
                        "found it unset: /metrics is off")
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                              token.encode()):
        return _problem(401, "Unauthorized",
                        "expected `Authorization: Bearer <LEDGER_METRICS_TOKEN>`, "
                        f"found {'a different token' if given else 'no bearer token'}",
                        WWW_Authenticate='Bearer realm="metrics"')
    # The exposition format the scraper asks for (Prometheus 2 and 3, OpenMetrics).
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(metrics.render(encoder=encoder), content_type=content_type)
