"""The demo's webhook catcher: receives the demo channel's deliveries (POST, checked like any
receiver should: the HMAC signature over timestamp and body, the timestamp's age) and lists
them (GET, for logged-in users)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.http import Http404, JsonResponse
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from demo import notifications as demo_notifications
from ledger import conf, notifications

MAX_BODY = 1024 * 1024


def _secret() -> str:
    secret = conf.WEBHOOK_SECRETS.get(settings.DEMO_WEBHOOK_SECRET_NAME)
    if not secret:  # outside the demo the catcher does not exist
        raise Http404("expected the demo webhook secret to be configured, found none")
    return secret


def _problem(status: int, detail: str) -> JsonResponse:
    return JsonResponse({"title": "Delivery refused", "status": status, "detail": detail},
                        status=status, content_type="application/problem+json")


@csrf_exempt  # a machine posts here, authenticated by the signature instead
@login_not_required
@require_http_methods(["GET", "POST"])
def webhook_catcher(request):
    secret = _secret()
    if request.method == "GET":
        if not request.user.is_authenticated:
            from django.contrib.auth.views import redirect_to_login

            return redirect_to_login(request.get_full_path())
        if not request.user.has_perm("ledger.view_notificationchannel"):
            # What arrived names operations of every tenant: the admins' page, like the
            # notification pages themselves. Said on the page (a 403, not an exception:
            # nothing for the server's log to print a traceback of).
            return render(request, "demo/webhook_catcher.html", {"admins_only": True},
                          status=403)
        return render(request, "demo/webhook_catcher.html",
                      {"deliveries": demo_notifications.received()})
    body = request.body[:MAX_BODY + 1]
    if len(body) > MAX_BODY:
        return _problem(413, f"expected at most {MAX_BODY} bytes, found more")
    timestamp = request.headers.get(notifications.TIMESTAMP_HEADER, "")
    signature = request.headers.get(notifications.SIGNATURE_HEADER, "")
    if not notifications.verify_signature(secret, timestamp=timestamp,
                                          signature_header=signature, body=body):
        return _problem(401, "expected a valid X-Ledger-Signature over X-Ledger-Timestamp and "
                             "the body, signed within 5 minutes, found none")
    try:
        payload = json.loads(body)
    except ValueError:
        return _problem(400, "expected a JSON body, found something else")
    demo_notifications.store({
        "received_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "delivery": request.headers.get(notifications.DELIVERY_HEADER, ""),
        "attempt": request.headers.get("X-Ledger-Attempt", ""),
        "signature_verified": True, "payload": payload,
    })
    return JsonResponse({"received": True})
