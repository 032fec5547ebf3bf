"""Tracing's own sampling shortcut holds to the SDK's sampler: the requests it leaves out are the
ones the SDK would, and the ones it keeps get the trace id it drew; the spans it records reach the
SDK's processor as the SDK's own would, with their parents, flags and attributes."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBasedTraceIdRatio, TraceIdRatioBased

from gateway.telemetry.tracing import Tracing, batch_trace, root_ratio_bound


def tracing(sampler) -> tuple[Tracing, InMemorySpanExporter]:
    exported = InMemorySpanExporter()
    return Tracing(sampler, SimpleSpanProcessor(exported), Resource.create({"service.name": "t"})), exported


def test_roots_are_sampled_at_the_configured_ratio_and_every_kept_one_is_recorded():
    traced, exported = tracing(ParentBasedTraceIdRatio(0.25))
    kept = [traced.request("r", [], {}) for _ in range(4000)]
    sampled = [t for t in kept if t is not None]
    assert 850 <= len(sampled) <= 1150  # 1000 expected: 25% of 4000, within 4.5 sigma
    for trace in sampled:  # each one the SDK's own sampler keeps too
        assert TraceIdRatioBased(0.25).should_sample(None, trace.context.trace_id, "r").decision.is_sampled()
        trace.end({})
    assert len(exported.get_finished_spans()) == len(sampled)


def test_a_client_parent_decides_over_the_ratio():
    traced, _ = tracing(ParentBasedTraceIdRatio(0.0))
    parent = [(b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]
    trace = traced.request("r", parent, {})
    assert trace is not None and trace.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert traced.request("r", [], {}) is None


def test_other_samplers_take_the_sdks_own_way():
    assert root_ratio_bound(ALWAYS_ON) is None
    assert root_ratio_bound(TraceIdRatioBased(0.5)) == TraceIdRatioBased(0.5).bound
    traced, _ = tracing(ALWAYS_ON)
    assert all(traced.request("r", [], {}) is not None for _ in range(50))


def test_a_clients_tracestate_is_kept_beside_its_traceparent_wherever_it_comes():
    traced, exported = tracing(ALWAYS_ON)
    headers = [
        (b"tracestate", b"vendor=abc"),
        (b"host", b"gw"),
        (b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    ]
    trace = traced.request("r", headers, {})
    assert trace is not None
    trace.end({})
    (span,) = exported.get_finished_spans()
    assert span.parent is not None and span.parent.span_id == 0x00F067AA0BA902B7
    assert span.get_span_context().trace_state.get("vendor") == "abc"


def test_a_refusals_trace_is_its_server_span_carrying_the_decision():
    traced, exported = tracing(ALWAYS_ON)
    trace = traced.request("POST infer", [], {"http.request.method": "POST"})
    assert trace is not None
    decision = {"gateway.class": "low", "gateway.decision": "refused", "gateway.reason": "queue_full"}
    trace.admission(decision, refused=True, started_ns=1_000_000, ended_ns=3_500_000)
    trace.end({})
    (span,) = exported.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["gateway.reason"] == "queue_full"
    assert span.attributes["gateway.admission_ms"] == 2.5
    assert span.status.status_code.name == "ERROR" and span.status.description == "queue_full"


def test_a_gateway_without_tracing_loads_nothing_of_opentelemetry():
    import subprocess
    import sys

    probe = (
        "import sys, gateway.programs.cli, gateway.flow.admitted, gateway.telemetry.tracing;"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_spans_are_exported_in_batches_short_enough_not_to_stall_requests_unless_told(monkeypatch):
    from gateway.telemetry.tracing import EXPORT_BATCH_SPANS, tracing_from_environment

    def batch_size() -> int:
        traced = tracing_from_environment()
        assert traced is not None
        traced.shutdown()
        return traced.processor._batch_processor._max_export_batch_size

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    assert batch_size() == EXPORT_BATCH_SPANS == 128
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "300")
    assert batch_size() == 300


def test_an_admitted_requests_spans_are_one_trace_parented_as_the_sdks_would_be_and_encode():
    traced, exported = tracing(ALWAYS_ON)
    trace = traced.request("POST infer", [], {"http.request.method": "POST", "gateway.tenant": None})
    assert trace is not None
    trace.admission({"gateway.decision": "admitted"}, refused=False, started_ns=1, ended_ns=2)
    trace.queued(2, 3)
    traceparent = trace.upstream_started({"http.request.method": "POST", "url.full": "http://b/x"})
    trace.upstream_ended(503)
    trace.end({"gateway.outcome": "upstream_error"})
    queue, call, server = exported.get_finished_spans()
    assert server.parent is None and queue.parent == call.parent == server.context
    assert {queue.context.trace_id, call.context.trace_id} == {server.context.trace_id}
    assert len({queue.context.span_id, call.context.span_id, server.context.span_id}) == 3
    # The backend is told the upstream call as its parent, sampled, the trace id random.
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00" and int(trace_id, 16) == server.context.trace_id
    assert int(span_id, 16) == call.context.span_id
    assert flags == "03" and server.context.trace_flags == 0x03
    assert (queue.start_time, queue.end_time) == (2, 3)
    assert call.attributes["http.response.status_code"] == 503 and call.status.status_code.name == "ERROR"
    assert "gateway.tenant" not in server.attributes  # None is left out, as the SDK does
    assert server.status.status_code.name == "UNSET" and server.end_time >= server.start_time > 0
    (resource_spans,) = encode_spans([queue, call, server]).resource_spans  # one resource, hashed once
    assert {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"] == "t"
    assert len(resource_spans.scope_spans[0].spans) == 3


def test_a_batchs_span_links_its_members_and_parents_its_call():
    traced, exported = tracing(ALWAYS_ON)
    members = [traced.request("r", [], {}) for _ in range(2)]
    batch = batch_trace([*members, None], 5, {"gateway.batch_size": 2})
    assert batch is not None
    batch.upstream_started({"http.request.method": "POST"})
    batch.upstream_ended(200)
    call, span = exported.get_finished_spans()
    assert span.name == "batch" and span.start_time == 5 and call.parent == span.context
    assert [link.context for link in span.links] == [m.context for m in members if m is not None]
    assert span.parent == members[0].context
