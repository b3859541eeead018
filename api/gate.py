"""The agent API's request gate: what a request body must be before anything parses it.

Checked for every request with a body (POST, PUT, PATCH) that reached an endpoint taking
that method with a live key (`api.http.AgentKeyAuth`, before ninja parses the body: an
unknown path stays 404, a wrong method 405, no key 401), and on the MCP endpoint;
`config.asgi` also refuses an oversized body while reading it, before it is kept whole:

- at most `LEDGER_MAX_REQUEST_BYTES` bytes (declared or sent), else 413;
- `Content-Type: application/json` (any charset parameter aside), else 415;
- a JSON object (`{...}`), else 422: `false`, `[]` or an empty body is not a request.

Each refusal is the problem+json of `api.problems`, saying what was expected and found.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import RequestDataTooBig

from api import problems
from ledger import conf

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
JSON = "application/json"
_WHITESPACE = b" \t\r\n"


class Refused(Exception):
    """A request the gate refuses; `problem` is the answer."""

    def __init__(self, problem: dict[str, Any]):
        super().__init__(problem["detail"])
        self.problem = problem


def check(request) -> None:
    """Raise Refused unless `request`'s body may be parsed."""
    problem = refusal(request)
    if problem is not None:
        raise Refused(problem)


def too_large(found: int | None, *, limit: int | None = None) -> dict[str, Any]:
    """413: `found` bytes (None: more than the limit, not counted to the end)."""
    limit = conf.MAX_REQUEST_BYTES if limit is None else limit
    what = "more than that" if found is None else f"{found} bytes"
    return problems.problem(
        413, "payload-too-large", "Payload too large",
        f"expected a request body of at most {limit} bytes (LEDGER_MAX_REQUEST_BYTES), "
        f"found {what}", limit=limit)


def declared_length(value: str | bytes | None) -> int | None:
    """The Content-Length header as an int, or None when absent or not a number."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def refusal(request) -> dict[str, Any] | None:
    """The problem refusing `request`'s body, or None when it may be parsed."""
    if request.method not in BODY_METHODS:
        return None
    declared = declared_length(request.META.get("CONTENT_LENGTH"))
    if declared is not None and declared > conf.MAX_REQUEST_BYTES:
        return too_large(declared)
    found_type = media_type(request.META.get("CONTENT_TYPE"))
    if found_type != JSON:
        return problems.problem(
            415, "unsupported-media-type", "Unsupported media type",
            f"expected Content-Type: {JSON}, found "
            + (repr(request.META.get("CONTENT_TYPE")) if found_type else "none"))
    try:
        body = request.body
    except RequestDataTooBig:  # Django's own, lower limit (DATA_UPLOAD_MAX_MEMORY_SIZE)
        from django.conf import settings

        return too_large(None, limit=min(conf.MAX_REQUEST_BYTES,
                                         settings.DATA_UPLOAD_MAX_MEMORY_SIZE))
    if len(body) > conf.MAX_REQUEST_BYTES:
        return too_large(len(body))
    start = body.lstrip(_WHITESPACE)[:1]
    if start != b"{":
        # Any JSON value but an object starts otherwise; an object that does not parse is
        # left to the parser's own 400.
        found = "an empty body" if not start else repr(body.strip()[:40].decode(
            "utf-8", "replace"))
        return problems.problem(
            422, "invalid-request", "Invalid request",
            f"expected a JSON object as the request body, found {found}")
    return None
