"""Desk hardening that needs code: the client address the login lockout keys on, and the
CSRF failure page."""

from __future__ import annotations

from django.conf import settings
from django.shortcuts import render


def client_ip(request) -> str | None:
    """The address the login lockout counts failures against.

    REMOTE_ADDR, unless the desk sits behind `LEDGER_TRUSTED_PROXY_COUNT` reverse proxies
    that each append to X-Forwarded-For: then the address the outermost of them saw (the
    right-most entries were written by our proxies; anything left of them is the client's
    own claim and is never trusted).
    """
    proxies = settings.LEDGER_TRUSTED_PROXY_COUNT
    if proxies > 0:
        hops = [h.strip() for h in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")
                if h.strip()]
        if len(hops) >= proxies:
            return hops[-proxies]
    return request.META.get("REMOTE_ADDR")


def csrf_failure(request, reason: str = ""):
    """A styled 403 instead of Django's bare page: the form expired or cookies are blocked.
    The reason is for the log only (it names internal checks)."""
    return render(request, "403_csrf.html", status=403)


def locked_out(request, original_response=None, credentials=None):
    """What a locked-out login gets (django-axes' AXES_LOCKOUT_CALLABLE): 429 and a page
    saying why the right password does not work now and when it will."""
    from axes.helpers import get_client_username, get_cool_off, get_failure_limit

    cool_off = get_cool_off(request)
    context = {
        "username": get_client_username(request, credentials) or "",
        "failure_limit": get_failure_limit(request, credentials),
        "cooloff_minutes": round(cool_off.total_seconds() / 60) if cool_off else None,
    }
    return render(request, "registration/locked_out.html", context, status=429)
