"""Desk hardening that needs code: what the login lockout counts (the username, and the
client address where it is trustworthy), and the CSRF failure page."""

from __future__ import annotations

from django.shortcuts import render

from ledger import conf


def client_address(request) -> tuple[str | None, bool]:
    """(the client's address, whether it can be trusted to be the client's own).

    REMOTE_ADDR, unless the desk sits behind `LEDGER_TRUSTED_PROXY_COUNT` reverse proxies
    that each append to X-Forwarded-For: then the address the outermost of them saw (the
    right-most entries were written by our proxies; anything left of them is the client's
    own claim and is never trusted). Behind proxies whose header is missing or too short,
    REMOTE_ADDR is a proxy's own address, shared by every client behind it: not trusted.
    """
    proxies = conf.TRUSTED_PROXY_COUNT
    if proxies > 0:
        hops = [h.strip() for h in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")
                if h.strip()]
        if len(hops) >= proxies:
            return hops[-proxies], True
        return request.META.get("REMOTE_ADDR"), False
    return request.META.get("REMOTE_ADDR"), True


def client_ip(request) -> str | None:
    """The address the login lockout records (django-axes' AXES_CLIENT_IP_CALLABLE)."""
    return client_address(request)[0]


def lockout_parameters(request, credentials=None) -> list[str]:
    """What the login lockout counts failures of (AXES_LOCKOUT_PARAMETERS): the username
    whatever the address, so that an attacker who changes address (or a header a front
    server believes) gains nothing; and the address across usernames where the address is
    trustworthy, so that one client cannot try every username. Counting a proxy's own
    address would lock out everyone behind it, so an untrustworthy one is left out."""
    meta = getattr(request, "META", None)
    if meta is not None and not client_address(request)[1]:
        return ["username"]
    return ["username", "ip_address"]


def csrf_failure(request, reason: str = ""):
    """A styled 403 instead of Django's bare page: the form expired or cookies are blocked.
    The reason is for the log only (it names internal checks)."""
    return render(request, "review/403_csrf.html", status=403)


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
