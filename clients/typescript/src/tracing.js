// OpenTelemetry spans of actions when @opentelemetry/api is installed (else nothing), with
// the Python client's attributes: `execute_tool {operation}`, gen_ai.operation.name,
// gen_ai.tool.name, gen_ai.tool.call.id, ledger.operation_id, ledger.state,
// ledger.idempotency_key. Nothing else of the call: no intent, result, key or header.

const TRACER_NAME = "agent-ledger-client";
let loaded; // a promise of the API module or null

function api() {
  if (loaded === undefined) {
    loaded = import("@opentelemetry/api").catch(() => null);
  }
  return loaded;
}

class ActionSpan {
  constructor(span = null) { this.span = span; }

  record(receipt) {
    if (!this.span) return;
    const data = receipt.data ?? receipt;
    this.span.setAttributes({
      "gen_ai.tool.call.id": data.operation_id ?? "",
      "ledger.operation_id": data.operation_id ?? "",
      "ledger.state": data.state ?? "",
      "ledger.idempotency_key": data.idempotency_key ?? "",
    });
  }

  /** The W3C traceparent of this span, or null without a recording span. */
  traceparent() {
    if (!this.span) return null;
    const context = this.span.spanContext();
    if (!context || !/^[0-9a-f]{32}$/.test(context.traceId) || /^0+$/.test(context.traceId)) return null;
    return `00-${context.traceId}-${context.spanId}-01`;
  }
}

/** Run `body(span)` inside a span `execute_tool {operation}` (or without one). */
export async function withActionSpan(operation, body) {
  const otel = await api();
  if (!otel) return body(new ActionSpan());
  const tracer = otel.trace.getTracer(TRACER_NAME);
  return tracer.startActiveSpan(`execute_tool ${operation}`, {
    kind: otel.SpanKind.INTERNAL,
    attributes: { "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": operation },
  }, async (span) => {
    try {
      return await body(new ActionSpan(span));
    } catch (exc) {
      span.recordException(exc);
      span.setStatus({ code: otel.SpanStatusCode.ERROR, message: exc?.name });
      throw exc;
    } finally {
      span.end();
    }
  });
}
