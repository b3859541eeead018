"""OpenTelemetry spans of actions, and the trace an operation was recorded in.

With `opentelemetry-api` installed (an optional dependency), each `@receipts.action` call
is one span following the GenAI semantic conventions for tool calls: name
`execute_tool {operation}`, `gen_ai.operation.name` = execute_tool, `gen_ai.tool.name`,
`gen_ai.tool.call.id` (the operation id), plus `ledger.operation_id`, `ledger.state` (as
last recorded) and `ledger.idempotency_key`. Nothing else goes into a span: no intent, no
result, no target (they may hold secrets).

The execution-state tools are spans too, beside the tool calls, named as the MCP tools
are (`execute_tool state_read_facts`, `state_assert_fact`, `state_open_obligation`,
`state_commit`, `episodes_record`, `run_resume`; `state_tool`), whichever door called them
(in process, HTTP, MCP): the fact versions read or written (`ledger.facts.read`,
`ledger.fact.version`: "subject predicate@version", never a value), the obligation's key
and state, the run and its fencing token. A refusal is recorded on its span as an
exception (its message says what was expected and found: no values either).

`record_intent` stores the trace and span ids of the span it runs in (or of the caller's
W3C `traceparent` over HTTP) on the operation, so the desk can link a receipt to its trace
(`LEDGER_TRACE_URL`). Without OpenTelemetry nothing is recorded and nothing is imported.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
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


def state_tool(name: str, describe: Callable[..., dict[str, Any]]):
    """Decorator: each call of the function is the span `execute_tool {name}`, its
    attributes `describe(result, *args, **kwargs)` (identifiers and versions only) once it
    returns. Without OpenTelemetry the function is called as it is."""

    def decorate(fn):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if _trace is None:
                return fn(*args, **kwargs)
            tracer = _trace.get_tracer(TRACER_NAME)
            with tracer.start_as_current_span(
                f"execute_tool {name}", kind=_trace.SpanKind.INTERNAL,
                attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name},
            ) as span:
                result = fn(*args, **kwargs)
                if not span.is_recording():  # no SDK configured: nothing to describe
                    return result
                try:
                    attributes = describe(result, *args, **kwargs)
                except Exception:  # noqa: BLE001 - a span never breaks the call it describes
                    attributes = {}
                span.set_attributes({k: v for k, v in attributes.items() if v is not None})
                return result

        return traced

    return decorate


def fact_version(fact: Any) -> str:
    """"subject predicate@version" of a Fact ("@candidate" for a candidate)."""
    version = fact.version if getattr(fact, "version", None) is not None else "candidate"
    return f"{fact.subject} {fact.predicate}@{version}"


def _run_id(run: Any) -> str:
    return run if isinstance(run, str) else getattr(run, "run_id", "")


def read_facts_attributes(found, subject, *, tenant="default", **_) -> dict[str, Any]:
    return {"ledger.tenant": tenant, "ledger.fact.subject": subject,
            "ledger.facts.read": [fact_version(f) for f in found]}


def assert_fact_attributes(fact, subject, predicate, *_args, tenant="default",
                           expected_version=None, **_) -> dict[str, Any]:
    return {"ledger.tenant": tenant, "ledger.fact.subject": subject,
            "ledger.fact.predicate": predicate, "ledger.fact.version": fact_version(fact),
            "ledger.fact.is_candidate": bool(getattr(fact, "is_candidate", False)),
            "ledger.fact.expected_version": expected_version}


def obligation_attributes(obligation, *_args, **_) -> dict[str, Any]:
    # The run only as already loaded: a span never costs a query.
    run = obligation._state.fields_cache.get("run")
    return {"ledger.tenant": obligation.tenant, "ledger.obligation.key": obligation.key,
            "ledger.obligation.kind": obligation.kind,
            "ledger.obligation.state": str(obligation.state),
            "ledger.run_id": _run_id(run) or None}


def open_obligation_attributes(obligation, run, *_args, **_) -> dict[str, Any]:
    return {**obligation_attributes(obligation), "ledger.run_id": _run_id(run) or None}


def episode_attributes(episode, run, role, **_) -> dict[str, Any]:
    return {"ledger.run_id": _run_id(run), "ledger.episode.role": role,
            "ledger.episode.id": episode.pk}


def resume_attributes(view, run_id, *, worker, **_) -> dict[str, Any]:
    return {"ledger.run_id": view.run.run_id, "ledger.tenant": view.run.tenant,
            "ledger.worker": worker, "ledger.fencing_token": view.token,
            "ledger.facts.read": [fact_version(f) for f in view.facts],
            "ledger.open_operations": len(view.open_operations),
            "ledger.pending_obligations": len(view.pending_obligations)}
