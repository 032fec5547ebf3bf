"""Tracing's own sampling shortcut holds to the SDK's sampler: the requests it leaves out are the
ones the SDK would, and the ones it keeps get the trace id it drew."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBasedTraceIdRatio, TraceIdRatioBased

from gateway.telemetry.tracing import PresampledIds, Tracing, root_ratio_bound


def tracing(sampler) -> tuple[Tracing, InMemorySpanExporter]:
    ids = PresampledIds()
    provider = TracerProvider(sampler=sampler, id_generator=ids)
    exported = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    return Tracing(provider.get_tracer("t"), provider, ids, root_ratio_bound(sampler)), exported


def test_roots_are_sampled_at_the_configured_ratio_and_every_kept_one_is_recorded():
    traced, exported = tracing(ParentBasedTraceIdRatio(0.25))
    kept = [traced.request("r", [], {}) for _ in range(4000)]
    sampled = [t for t in kept if t is not None]
    assert 850 <= len(sampled) <= 1150  # 1000 expected: 25% of 4000, within 4.5 sigma
    for trace in sampled:
        assert trace.sampled
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
        (processor,) = traced._provider._active_span_processor._span_processors
        traced.shutdown()
        return processor._batch_processor._max_export_batch_size

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    assert batch_size() == EXPORT_BATCH_SPANS == 128
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "300")
    assert batch_size() == 300
