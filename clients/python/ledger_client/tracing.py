"""OpenTelemetry spans of actions, when `opentelemetry-api` is installed (else nothing).

Each action call is one span following the GenAI semantic conventions for tool calls:
name `execute_tool {operation}`, `gen_ai.operation.name` = execute_tool,
`gen_ai.tool.name`, `gen_ai.tool.call.id` (the operation id), plus `ledger.operation_id`,
`ledger.state` (as last recorded) and `ledger.idempotency_key`; `ledger.replayed` true
when the call was answered from the stored receipt (nothing sent). Nothing else of the call
goes into the span: no intent, no result, no key or header (they may hold secrets).
`resume` is a span `execute_tool run_resume` with the run, its fencing token and the fact
versions of the hand-off view (`ledger.facts.read`: "subject predicate@version").
"""

from __future__ import annotations

from contextlib import contextmanager

try:
    from opentelemetry import trace as _trace
except ImportError:  # the optional dependency is not installed
    _trace = None

TRACER_NAME = "ledger_client"


class _Span:
    def __init__(self, span=None):
        self.span = span

    def record(self, receipt) -> None:
        if self.span is None:
            return
        data = receipt.data
        self.span.set_attributes({
            "gen_ai.tool.call.id": data.get("operation_id") or "",
            "ledger.operation_id": data.get("operation_id") or "",
            "ledger.state": data.get("state") or "",
            "ledger.idempotency_key": data.get("idempotency_key") or "",
        })
        if data.get("replayed"):  # answered from the stored receipt: nothing was sent
            self.span.set_attribute("ledger.replayed", True)

    def ids(self) -> tuple[str, str] | None:
        """(trace id, span id) in hex, or None without a recording span."""
        if self.span is None:
            return None
        context = self.span.get_span_context()
        if not context.is_valid:
            return None
        return f"{context.trace_id:032x}", f"{context.span_id:016x}"


@contextmanager
def action_span(operation: str):
    if _trace is None:
        yield _Span()
        return
    tracer = _trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        f"execute_tool {operation}", kind=_trace.SpanKind.INTERNAL,
        attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": operation},
    ) as span:
        yield _Span(span)


class _StateSpan:
    def __init__(self, span=None):
        self.span = span

    def set(self, attributes: dict) -> None:
        if self.span is not None and self.span.is_recording():
            self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})


@contextmanager
def state_span(name: str):
    """The span of an execution-state tool call (`run_resume`), named as the ledger's MCP
    tool is; its attributes are identifiers and versions only."""
    if _trace is None:
        yield _StateSpan()
        return
    tracer = _trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        f"execute_tool {name}", kind=_trace.SpanKind.INTERNAL,
        attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name},
    ) as span:
        yield _StateSpan(span)


def fact_versions(facts) -> list[str]:
    """"subject predicate@version" of each fact the ledger returned (never a value)."""
    return [f"{f.get('subject')} {f.get('predicate')}@{f.get('version')}"
            for f in facts or () if isinstance(f, dict)]
