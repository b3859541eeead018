"""OpenTelemetry spans of actions, and the trace an operation was recorded in.

With `opentelemetry-api` installed (an optional dependency), each `@receipts.action` call
is one span following the GenAI semantic conventions for tool calls: name
`execute_tool {operation}`, `gen_ai.operation.name` = execute_tool, `gen_ai.tool.name`,
`gen_ai.tool.call.id` (the operation id), plus `ledger.operation_id`, `ledger.state` (as
last recorded) and `ledger.idempotency_key`. Nothing else goes into a span: no intent, no
result, no target (they may hold secrets).

`record_intent` stores the trace and span ids of the span it runs in (or of the caller's
W3C `traceparent` over HTTP) on the operation, so the desk can link a receipt to its trace
(`LEDGER_TRACE_URL`). Without OpenTelemetry nothing is recorded and nothing is imported.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import trace as _trace
except ImportError:  # the optional dependency is not installed
    _trace = None

TRACER_NAME = "agent_ledger"
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


class ActionSpan:
    """The span of one action call (or nothing, without OpenTelemetry)."""

    def __init__(self, span: Any = None):
        self.span = span

    def record(self, op: Any) -> None:
        """Name the operation on the span: its id, key and state as last recorded."""
        if self.span is None or op is None:
            return
        self.span.set_attributes({
            "gen_ai.tool.call.id": op.operation_id,
            "ledger.operation_id": op.operation_id,
            "ledger.state": str(op.state),
            "ledger.idempotency_key": op.idempotency_key,
        })


@contextmanager
def action_span(operation: str):
    if _trace is None:
        yield ActionSpan()
        return
    tracer = _trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        f"execute_tool {operation}", kind=_trace.SpanKind.INTERNAL,
        attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": operation},
    ) as span:
        yield ActionSpan(span)


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) in lowercase hex of the current span, or None (no
    OpenTelemetry, or no span being recorded)."""
    if _trace is None:
        return None
    context = _trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def from_traceparent(header: str | None) -> tuple[str, str] | None:
    """(trace id, span id) of a W3C `traceparent` header, or None when there is none or it
    is malformed (a bad header never refuses a request: the trace link is a nicety)."""
    if not header or len(header) > 100:
        return None
    found = _TRACEPARENT.match(header.strip().lower())
    if found is None or set(found[1]) == {"0"} or set(found[2]) == {"0"}:
        return None
    return found[1], found[2]


def check_ids(trace: Any) -> tuple[str, str] | None:
    """`trace` as record_intent takes it: None, or (32 hex digits, 16 hex digits)."""
    if trace is None:
        return None
    from ledger.errors import InvalidInput

    if (not isinstance(trace, tuple | list) or len(trace) != 2
            or from_traceparent(f"00-{trace[0]}-{trace[1]}-01") is None):
        raise InvalidInput(f"expected trace to be (trace id of 32 hex digits, span id of 16 "
                           f"hex digits), found {trace!r}")
    return str(trace[0]).lower(), str(trace[1]).lower()
