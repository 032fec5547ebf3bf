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
