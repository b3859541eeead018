"""Actions as OpenTelemetry spans (GenAI conventions), the trace ids on the operation, and
the desk's link to the trace; with the SDK's in-memory exporter."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ledger import conf, receipts, tracing
from ledger.errors import InvalidInput
from ledger.models import Operation

_EXPORTER = InMemorySpanExporter()
_PROVIDER = TracerProvider()
_PROVIDER.add_span_processor(SimpleSpanProcessor(_EXPORTER))


@pytest.fixture
def spans(monkeypatch):
    """The finished spans, recorded by a provider of this test alone."""
    monkeypatch.setattr(trace, "get_tracer", _PROVIDER.get_tracer)
    _EXPORTER.clear()
    yield _EXPORTER.get_finished_spans
    _EXPORTER.clear()


@pytest.mark.django_db
def test_an_action_is_an_execute_tool_span_and_its_operation_stores_the_trace(spans):
    @receipts.action("articles.create", target="https://u:hunter2@cms.example/api",
                     key=lambda article: article["slug"])
    def create(article: dict) -> dict:
        return {"id": 1, "token": "sk-live-secret"}

    create({"slug": "hello", "password": "hunter2"})
    [span] = spans()
    op = Operation.objects.get()
    assert span.name == "execute_tool articles.create"
    assert span.kind == trace.SpanKind.INTERNAL
    assert dict(span.attributes) == {
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "articles.create",
        "gen_ai.tool.call.id": op.operation_id, "ledger.operation_id": op.operation_id,
        "ledger.state": "succeeded", "ledger.idempotency_key": "hello"}
    assert (op.trace_id, op.span_id) == (f"{span.context.trace_id:032x}",
                                         f"{span.context.span_id:016x}")
    # Never a secret: neither the intent, nor the target's credentials, nor the result.
    text = repr(dict(span.attributes)) + repr(span.events)
    assert "hunter2" not in text and "sk-live" not in text


@pytest.mark.django_db
def test_a_failed_action_records_its_state_and_the_exception_on_the_span(spans):
    @receipts.action("mail.send", target="smtp://mail", key=lambda to: to)
    def send(to: str):
        raise TimeoutError("read timed out")

    with pytest.raises(TimeoutError):
        send("ann@example.com")
    [span] = spans()
    assert span.attributes["ledger.state"] == "outcome_unknown"
    assert span.status.status_code == trace.StatusCode.ERROR


@pytest.mark.django_db
def test_without_a_span_the_operation_has_no_trace_and_the_desk_no_link(settings):
    settings.LEDGER_TRACE_URL = "http://jaeger:16686/trace/{trace_id}"
    op = receipts.record_intent("x.y", "https://x", {}, idempotency_key="k")
    assert (op.trace_id, op.span_id, op.trace_url) == ("", "", "")


@pytest.mark.django_db
def test_the_trace_url_fills_the_configured_template(settings):
    op = receipts.record_intent("x.y", "https://x", {}, idempotency_key="k",
                                trace=("ab" * 16, "cd" * 8))
    settings.LEDGER_TRACE_URL = ""
    assert op.trace_url == ""
    settings.LEDGER_TRACE_URL = "https://tempo.example/trace/{trace_id}?span={span_id}"
    assert op.trace_url == f"https://tempo.example/trace/{'ab' * 16}?span={'cd' * 8}"


@pytest.mark.parametrize("value", ["jaeger/{trace_id}", "https://x/{trace}",
                                   "https://x/no-placeholder", 5])
def test_a_malformed_trace_url_is_named_by_the_check(settings, value):
    settings.LEDGER_TRACE_URL = value
    [error] = [e for e in conf.check_settings() if "TRACE_URL" in e.msg]
    assert "expected LEDGER_TRACE_URL" in error.msg


@pytest.mark.parametrize("trace_ids", [("xyz", "cd" * 8), ("ab" * 16,), ("0" * 32, "cd" * 8)])
def test_record_intent_refuses_malformed_trace_ids(db, trace_ids):
    with pytest.raises(InvalidInput, match="trace id of 32 hex digits"):
        receipts.record_intent("x.y", "https://x", {}, idempotency_key="k", trace=trace_ids)


@pytest.mark.parametrize(("header", "found"), [
    ("00-" + "ab" * 16 + "-" + "cd" * 8 + "-01", ("ab" * 16, "cd" * 8)),
    ("00-" + "0" * 32 + "-" + "cd" * 8 + "-01", None),
    ("garbage", None), (None, None), ("00-" + "ab" * 16 + "-" + "cd" * 8 + "-01x", None),
])
def test_traceparent_headers_are_read_and_a_bad_one_is_ignored(header, found):
    assert tracing.from_traceparent(header) == found


@pytest.mark.django_db
def test_the_desk_links_an_operation_to_its_trace(client, settings, admin_user):
    settings.LEDGER_TRACE_URL = "http://jaeger:16686/trace/{trace_id}"
    op = receipts.record_intent("x.y", "https://x", {}, idempotency_key="k",
                                trace=("ab" * 16, "cd" * 8))
    client.force_login(admin_user)
    page = client.get(f"/operations/{op.operation_id}/").content.decode()
    assert f'href="http://jaeger:16686/trace/{"ab" * 16}"' in page


# --- the execution-state tools -----------------------------------------------------------


@pytest.mark.django_db
def test_state_tools_are_spans_with_the_fact_versions_they_read_or_wrote(spans):
    from ledger import episodes, facts, obligations, runs

    run = runs.start("ship the order", run_id="run-42")
    first = facts.assert_fact("order:42", "status", "paid", source="billing",
                              run=run)
    facts.assert_fact("order:42", "status", {"state": "shipped", "token": "sk-live-zzz"},
                      source="billing", expected_version=first.version, run=run)
    read = facts.read_facts("order:42")
    obligations.open(run, "email.send", "confirm-42")
    obligations.commit("confirm-42", {"sent": True})
    episodes.record(run, "assistant", content="told the customer")
    view = runs.resume("run-42", worker="worker-2")

    by_name = {}
    for span in spans():
        by_name.setdefault(span.name, []).append(dict(span.attributes))
    assert [a["ledger.fact.version"] for a in by_name["execute_tool state_assert_fact"]] == [
        "order:42 status@1", "order:42 status@2"]
    [reading] = by_name["execute_tool state_read_facts"]
    assert reading["ledger.facts.read"] == ("order:42 status@2",)
    assert read[0].version == 2
    [opened] = by_name["execute_tool state_open_obligation"]
    [committed] = by_name["execute_tool state_commit"]
    assert (opened["ledger.obligation.key"], opened["ledger.obligation.state"],
            opened["ledger.run_id"]) == ("confirm-42", "open", "run-42")
    assert committed["ledger.obligation.state"] == "committed"
    [episode] = by_name["execute_tool episodes_record"]
    assert (episode["ledger.run_id"], episode["ledger.episode.role"]) == ("run-42", "assistant")
    [resumed] = by_name["execute_tool run_resume"]
    assert (resumed["ledger.fencing_token"], resumed["ledger.facts.read"]) == (
        view.token, ("order:42 status@2",))
    for attributes in (a for group in by_name.values() for a in group):
        assert attributes["gen_ai.operation.name"] == "execute_tool"
        assert "shipped" not in repr(attributes) and "sk-live" not in repr(attributes)


@pytest.mark.django_db
def test_a_refused_state_tool_records_the_refusal_on_its_span(spans):
    from opentelemetry.trace import StatusCode

    from ledger import obligations, runs
    from ledger.errors import AlreadyCommitted

    run = runs.start("once")
    obligations.open(run, "report.send", "r-1")
    obligations.commit("r-1", {"n": 1})
    with pytest.raises(AlreadyCommitted):
        obligations.commit("r-1", {"n": 2})
    refused = [s for s in spans() if s.name == "execute_tool state_commit"][-1]
    assert refused.status.status_code == StatusCode.ERROR
    assert refused.events[0].attributes["exception.type"].endswith("AlreadyCommitted")
