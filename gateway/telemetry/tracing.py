"""Traces (OpenTelemetry): one per request, in the client's trace when it sends `traceparent`.

On when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` names
an endpoint (OTLP over HTTP); the SDK reads the rest of the standard variables itself: the
sampler (`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`; parent-based always-on by default), the
service name (`OTEL_SERVICE_NAME`, else "inference-gateway"), the batch processor's pace (its
export batch 128 spans unless told: EXPORT_BATCH_SPANS).

A request's spans: its server span, from arrival to answer; `admission` (its class, tenant, cost,
the decision, and for a refusal the reason, the rule and the Retry-After; a refusal's server span
ends with status ERROR); `queue wait`, from admission to its grant; and the upstream call, a client
span whose context the backend is sent as `traceparent`, so the backend's own spans are children
of the gateway's call rather than of the client's request.

Context is passed explicitly, never through context variables: a grant and its upstream send run
inside another request's callback (the one that freed the slot), where the current context is
that other request's. Every span here is started with its parent given, and its times where they
were measured elsewhere (the queue wait is known once it is over).
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
SERVICE_NAME = "inference-gateway"
EXPORT_BATCH_SPANS = 128
"""Spans a batch exports at most, unless OTEL_BSP_MAX_EXPORT_BATCH_SIZE says otherwise (the SDK's
default is 512). Encoding a batch holds the interpreter for about 45 us a span, in the exporter's
thread, and requests wait for it: 512 spans put 10-65 ms on the refusals' p99 under overload at
10% sampling, 128 about 1-5 ms (docs/benchmarks/index.md, "Tracing costs")."""
_LOW_64_BITS = (1 << 64) - 1
"""What the ratio sampler compares with its bound (TraceIdRatioBased.TRACE_ID_LIMIT)."""


def tracing_from_environment() -> Tracing | None:
    """The gateway's tracing where the environment names an OTLP endpoint; None (off) otherwise."""
    if not any(os.environ.get(name) for name in ENDPOINT_VARIABLES):
        return None
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    # Imported only here: a gateway without tracing never loads the SDK.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import _get_from_env_or_default

    resource = Resource.create({} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME})
    sampler = _get_from_env_or_default()  # OTEL_TRACES_SAMPLER, as the SDK reads it
    ids = PresampledIds()
    # PresampledIds has IdGenerator's methods (it is not its subclass: the SDK loads only here).
    provider = TracerProvider(resource=resource, sampler=sampler, id_generator=ids)  # type: ignore[arg-type]
    batch = None if os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE") else EXPORT_BATCH_SPANS
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), max_export_batch_size=batch))
    return Tracing(provider.get_tracer("inference-gateway"), provider, ids, root_ratio_bound(sampler))


def root_ratio_bound(sampler: Any) -> int | None:
    """The trace-id bound below which a request without a parent is sampled, where the sampler
    decides a root by ratio (`traceidratio`, `parentbased_traceidratio`); None for any other."""
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    root = getattr(sampler, "_root", None) if isinstance(sampler, ParentBased) else sampler
    return root.bound if isinstance(root, TraceIdRatioBased) else None


class PresampledIds:
    """The SDK's random ids, but a trace id drawn ahead (`next_trace_id`) when there is one: the
    gateway draws a root's trace id, sees whether the ratio samples it, and asks the SDK for a span
    only when it does, which then gets that id and makes the same decision."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self._random = RandomIdGenerator()
        self.next_trace_id: int | None = None

    def generate_span_id(self) -> int:
        return self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        drawn, self.next_trace_id = self.next_trace_id, None
        return drawn if drawn is not None else self._random.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return True


@functools.cache
def _api() -> Any:
    """The OpenTelemetry API's names, imported once, when the first trace needs them: a gateway
    without tracing loads nothing of OpenTelemetry, and a traced one pays no import a call."""
    from opentelemetry import trace

    return trace


def _error(span: Span, description: str) -> None:
    api = _api()
    span.set_status(api.Status(api.StatusCode.ERROR, description))


_GENAI_OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}


def upstream_attributes(method: str, url: str, path: str, served_model: str) -> dict[str, object]:
    """The upstream span's attributes: HTTP's, and on OpenAI routes the GenAI semantic
    conventions' (`gen_ai.operation.name`, `gen_ai.request.model`; the span is then named
    "{operation} {model}", as they ask)."""
    attributes: dict[str, object] = {"http.request.method": method, "url.full": url + path}
    if (operation := _GENAI_OPERATIONS.get(path)) is not None:
        attributes["gen_ai.operation.name"] = operation
        attributes["gen_ai.request.model"] = served_model
    return attributes


class Tracing:
    """Starts each request's trace; `shutdown` sends what is left."""

    def __init__(
        self, tracer: Tracer, provider: Any, ids: PresampledIds | None = None, root_bound: int | None = None
    ) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._server_kind = _api().SpanKind.SERVER
        self._tracer = tracer
        self._provider = provider
        self._propagator = TraceContextTextMapPropagator()
        self._ids = ids
        self._root_bound = root_bound
        """Where roots are sampled by ratio: the bound their trace id's low 64 bits must be under."""

    def request(
        self, name: str, headers: Sequence[tuple[bytes, bytes]], attributes: dict[str, Any]
    ) -> RequestTrace | None:
        """A request's trace, its server span started now, in the trace its `traceparent` names;
        None where the sampler leaves it out."""
        carrier = {}
        for key, value in headers:  # every request's: one comparison a header
            if key == b"traceparent":
                carrier["traceparent"] = value.decode("latin-1")
                carrier.update((k.decode(), v.decode("latin-1")) for k, v in headers if k == b"tracestate")
                break
        if not carrier and self._root_bound is not None and self._ids is not None:
            # A root sampled by ratio: the SDK's own rule on an id drawn here, so that the requests
            # left out (most of them) cost a draw and never reach the SDK.
            trace_id = random.getrandbits(128) or 1
            if trace_id & _LOW_64_BITS >= self._root_bound:
                return None
            self._ids.next_trace_id = trace_id
        parent = self._propagator.extract(carrier) if carrier else None
        span = self._tracer.start_span(name, context=parent, kind=self._server_kind, attributes=attributes)
        if not span.is_recording():
            # Not sampled: nothing more is made for it (what tracing costs is the sampled share's),
            # and the backend gets the client's own `traceparent`, if it sent one, as it came.
            return None
        return RequestTrace(self._tracer, self._propagator, span)

    def shutdown(self) -> None:
        self._provider.shutdown()


class RequestTrace:
    """One request's spans (see the module); each method is called at most once, in order."""

    __slots__ = ("_parent", "_propagator", "_server", "_tracer", "_upstream")

    def __init__(self, tracer: Tracer, propagator: Any, server: Span) -> None:
        self._tracer = tracer
        self._propagator = propagator
        self._server = server
        self._parent: Context | None = None
        self._upstream: Span | None = None

    @property
    def _context(self) -> Context:
        """The server span as its children's parent, made for the first of them (a refusal has none)."""
        if self._parent is None:
            self._parent = _api().set_span_in_context(self._server)
        return self._parent

    @property
    def sampled(self) -> bool:
        return bool(self._server.get_span_context().trace_flags.sampled)

    def admission(
        self, attributes: dict[str, Any], *, refused: bool, started_ns: int, ended_ns: int | None = None
    ) -> None:
        """The admission decision, from `started_ns` to `ended_ns` (now when not given), as
        attributes of the server span. Not a span of its own: a span costs about 40 us of CPU
        (the SDK's and its OTLP encoding's), and under overload most sampled requests are refusals,
        whose trace is then one span instead of two."""
        ended_ns = time.time_ns() if ended_ns is None else max(started_ns, ended_ns)
        self._server.set_attributes({**attributes, "gateway.admission_ms": (ended_ns - started_ns) / 1e6})
        if refused:
            _error(self._server, str(attributes.get("gateway.reason", "refused")))

    def queued(self, started_ns: int, ended_ns: int) -> None:
        """The wait for a slot, from `started_ns` to its grant at `ended_ns`."""
        span = self._tracer.start_span("queue wait", context=self._context, start_time=started_ns)
        span.end(end_time=ended_ns)

    def upstream_started(self, attributes: dict[str, object]) -> str:
        """The upstream call starts now: its client span, and the `traceparent` its backend gets."""
        api = _api()
        operation = attributes.get("gen_ai.operation.name")
        name = (
            f"{operation} {attributes.get('gen_ai.request.model', '')}"
            if operation
            else f"{attributes.get('http.request.method', 'POST')} upstream"
        )
        span = self._upstream = self._tracer.start_span(
            name,
            context=self._context,
            kind=api.SpanKind.CLIENT,
            attributes=attributes,  # type: ignore[arg-type]  # values are strings and numbers
        )
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=api.set_span_in_context(span))
        return carrier.get("traceparent", "")

    def upstream_ended(self, status: int | None, error: str | None = None) -> None:
        span = self._upstream
        if span is None:
            return
        if status:
            span.set_attribute("http.response.status_code", status)
        if error is not None or (status is not None and status >= 500):
            _error(span, error or str(status))
        span.end()
        self._upstream = None

    def usage(self, input_tokens: float, output_tokens: float) -> None:
        """The tokens the engine counted (an OpenAI answer's `usage`), as the GenAI semantic
        conventions name them, on the server span: the upstream call's has ended by then."""
        self._server.set_attribute("gen_ai.usage.input_tokens", int(input_tokens))
        self._server.set_attribute("gen_ai.usage.output_tokens", int(output_tokens))

    def status(self, code: int) -> None:
        """The answer's HTTP status, as it starts (a 5xx is an error of the server span)."""
        self._server.set_attribute("http.response.status_code", code)
        if code >= 500:
            _error(self._server, str(code))

    def end(self, attributes: dict[str, Any], *, error: str | None = None) -> None:
        """The answer is out (or the request ended without one)."""
        self.upstream_ended(None, "abandoned")  # a call still open was cut short
        if attributes:
            self._server.set_attributes(attributes)
        if error is not None:
            _error(self._server, error)
        self._server.end()

    @property
    def trace_id(self) -> str:
        return format(self._server.get_span_context().trace_id, "032x")

    @property
    def exemplar(self) -> dict[str, str] | None:
        """The trace id as a histogram's exemplar (OpenMetrics), where the trace is sampled: a slow
        bucket on a dashboard leads to a trace that was kept."""
        return {"trace_id": self.trace_id} if self.sampled else None


class BatchTrace:
    """A merged call's spans: `batch`, from the round's forming (the slot's grant) to the call's
    end, in the first traced member's trace and linked to every traced member's server span (one
    call serves them all); and the upstream call as its child, whose context the backend gets."""

    __slots__ = ("_batch", "_calls")

    def __init__(self, members: Sequence[RequestTrace], started_ns: int, attributes: dict[str, Any]) -> None:
        first = members[0]
        self._batch = first._tracer.start_span(
            "batch",
            context=first._context,
            links=[_api().Link(m._server.get_span_context()) for m in members],
            attributes=attributes,
            start_time=started_ns,
        )
        self._calls = RequestTrace(first._tracer, first._propagator, self._batch)

    @property
    def exemplar(self) -> dict[str, str] | None:
        return self._calls.exemplar

    def upstream_started(self, attributes: dict[str, object]) -> str:
        return self._calls.upstream_started(attributes)

    def upstream_ended(self, status: int | None, error: str | None = None) -> None:
        self._calls.upstream_ended(status, error)
        self._batch.end()


def batch_trace(members: Sequence[object], started_ns: int, attributes: dict[str, Any]) -> BatchTrace | None:
    """The merged call's trace, where any of its members' is sampled (None otherwise)."""
    traced = [m for m in members if isinstance(m, RequestTrace) and m.sampled]
    return BatchTrace(traced, started_ns, attributes) if traced else None
