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
that other request's. Every span here is recorded with its parent given, and its times where they
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
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.trace import Link, SpanContext, SpanKind

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
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import _get_from_env_or_default

    resource = Resource.create({} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME})
    sampler = _get_from_env_or_default()  # OTEL_TRACES_SAMPLER, as the SDK reads it
    batch = None if os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE") else EXPORT_BATCH_SPANS
    return Tracing(sampler, BatchSpanProcessor(OTLPSpanExporter(), max_export_batch_size=batch), resource)


def root_ratio_bound(sampler: Any) -> int | None:
    """The trace-id bound below which a request without a parent is sampled, where the sampler
    decides a root by ratio (`traceidratio`, `parentbased_traceidratio`); None for any other."""
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    root = getattr(sampler, "_root", None) if isinstance(sampler, ParentBased) else sampler
    return root.bound if isinstance(root, TraceIdRatioBased) else None


@functools.cache
def _api() -> Any:
    """The OpenTelemetry API's names, imported once, when the first trace needs them: a gateway
    without tracing loads nothing of OpenTelemetry, and a traced one pays no import a call."""
    from opentelemetry import trace

    return trace


def _empty_context() -> Any:
    from opentelemetry.context import Context

    return Context()


@functools.cache
def _readable_span() -> Any:
    from opentelemetry.sdk.trace import ReadableSpan

    return ReadableSpan


_SAMPLED = 0x01
_RANDOM_TRACE_ID = 0x02
"""W3C trace flags: the trace is sampled; its id is random (trace context level 2, set by the SDK on
the roots it draws)."""


def _status(error: str | None) -> Any:
    api = _api()
    return api.Status(api.StatusCode.UNSET) if error is None else api.Status(api.StatusCode.ERROR, error)


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
    """Starts each request's trace; `shutdown` sends what is left.

    Spans are recorded here and handed to the span processor as the SDK's `ReadableSpan`s when
    they end, not made by the SDK's tracer: its live spans (a lock, bounded attributes, the
    processor's start hook) cost 55-100 us for a refusal's trace and 230-270 us for an admitted
    one's (three spans) on the 2-core machine of docs/benchmarks, against 17 and 57 us recorded so;
    tracing's share of the gateway's CPU at 10% sampling fell from 4.3-5.0% to 2.2-2.6%. The
    SDK still samples (the configured sampler, asked as the tracer would), batches, encodes and
    exports; the processor is the gateway's own, so no other processor misses a start."""

    def __init__(self, sampler: Sampler, processor: SpanProcessor, resource: Resource) -> None:
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.sampler = sampler
        self.processor = processor
        self.resource = _hashed_once(resource)
        self.scope = InstrumentationScope(SERVICE_NAME)
        self.propagator = TraceContextTextMapPropagator()
        self._root_bound = root_ratio_bound(sampler)
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
        api = _api()
        if not carrier and self._root_bound is not None:
            # A root sampled by ratio: the sampler's own rule, so that the requests left out (most
            # of them) cost a draw and nothing more.
            trace_id = _trace_id()
            if trace_id & _LOW_64_BITS >= self._root_bound:
                return None
            parent, flags, state = None, _SAMPLED | _RANDOM_TRACE_ID, None
        else:
            # An empty context, never the current one (see the module): no carrier is a root.
            context = self.propagator.extract(carrier) if carrier else _empty_context()
            parent = api.get_current_span(context).get_span_context()
            if parent.is_valid:
                trace_id, random_id = parent.trace_id, parent.trace_flags & _RANDOM_TRACE_ID
            else:
                parent, trace_id, random_id = None, _trace_id(), _RANDOM_TRACE_ID
            kind = api.SpanKind.SERVER
            decided = self.sampler.should_sample(context, trace_id, name, kind, attributes, ())
            if not decided.decision.is_sampled():  # type: ignore[no-untyped-call]
                # Nothing is made for it (what tracing costs is the sampled share's), and the
                # backend gets the client's own `traceparent`, if it sent one, as it came.
                return None
            if decided.attributes:
                attributes = {**attributes, **decided.attributes}
            flags, state = _SAMPLED | random_id, decided.trace_state
        own = api.SpanContext(
            trace_id, _span_id(), is_remote=False, trace_flags=api.TraceFlags(flags), trace_state=state
        )
        return RequestTrace(self, own, parent, name, api.SpanKind.SERVER, attributes)

    def shutdown(self) -> None:
        self.processor.shutdown()


def _hashed_once(resource: Resource) -> Resource:
    """The resource, hashing as it does but computed once: the OTLP encoder groups every span by its
    resource, and a Resource hashes by writing its attributes as JSON (10-20 us a span here, a
    fifth of the span's encoding)."""
    from opentelemetry.sdk.resources import Resource

    class HashedOnce(Resource):
        def __init__(self) -> None:
            super().__init__(resource.attributes, resource.schema_url)
            self._hash = super().__hash__()

        def __hash__(self) -> int:
            return self._hash

    return HashedOnce()


def _trace_id() -> int:
    return random.getrandbits(128) or 1  # 0 is the invalid id


def _span_id() -> int:
    return random.getrandbits(64) or 1


class RequestTrace:
    """One request's spans (see the module); each method is called at most once, in order. Its
    server span is sent when it ends, each child as it ends."""

    def __init__(
        self,
        tracing: Tracing,
        context: SpanContext,
        parent: SpanContext | None,
        name: str,
        kind: SpanKind,
        attributes: dict[str, Any],
        started_ns: int | None = None,
        links: Sequence[Link] = (),
    ) -> None:
        self._tracing = tracing
        self.context = context
        """Its span's context (opentelemetry.trace.SpanContext)."""
        self.trace_id = format(context.trace_id, "032x")
        self._parent = parent
        self._name = name
        self._kind = kind
        self._attributes = dict(attributes)
        self._links = links
        self._started_ns = time.time_ns() if started_ns is None else started_ns
        self._error: str | None = None
        self._upstream: RequestTrace | None = None

    def _child(
        self,
        name: str,
        kind: SpanKind,
        attributes: dict[str, Any],
        started_ns: int | None = None,
        links: Sequence[Link] = (),
    ) -> RequestTrace:
        api = _api()
        own = api.SpanContext(
            self.context.trace_id,
            _span_id(),
            is_remote=False,
            trace_flags=self.context.trace_flags,
            trace_state=self.context.trace_state,
        )
        return RequestTrace(self._tracing, own, self.context, name, kind, attributes, started_ns, links)

    def _send(self, ended_ns: int | None = None) -> None:
        """Its span, ended at `ended_ns` (now when not given), to the span processor."""
        tracing = self._tracing
        span = _readable_span()(
            name=self._name,
            context=self.context,
            parent=self._parent,
            resource=tracing.resource,
            # The SDK drops None values (with a warning); the OTLP encoder refuses them.
            attributes={k: v for k, v in self._attributes.items() if v is not None},
            links=self._links,
            kind=self._kind,
            status=_status(self._error),
            start_time=self._started_ns,
            end_time=time.time_ns() if ended_ns is None else ended_ns,
            instrumentation_scope=tracing.scope,
        )
        tracing.processor.on_end(span)

    def admission(
        self, attributes: dict[str, Any], *, refused: bool, started_ns: int, ended_ns: int | None = None
    ) -> None:
        """The admission decision, from `started_ns` to `ended_ns` (now when not given), as
        attributes of the server span. Not a span of its own: a span costs its OTLP encoding
        (about 30 us), and under overload most sampled requests are refusals, whose trace is then
        one span instead of two."""
        ended_ns = time.time_ns() if ended_ns is None else max(started_ns, ended_ns)
        self._attributes.update(attributes)
        self._attributes["gateway.admission_ms"] = (ended_ns - started_ns) / 1e6
        if refused:
            self._error = str(attributes.get("gateway.reason", "refused"))

    def queued(self, started_ns: int, ended_ns: int) -> None:
        """The wait for a slot, from `started_ns` to its grant at `ended_ns`."""
        self._child("queue wait", _api().SpanKind.INTERNAL, {}, started_ns)._send(ended_ns)

    def upstream_started(self, attributes: dict[str, object]) -> str:
        """The upstream call starts now: its client span, and the `traceparent` its backend gets."""
        api = _api()
        operation = attributes.get("gen_ai.operation.name")
        name = (
            f"{operation} {attributes.get('gen_ai.request.model', '')}"
            if operation
            else f"{attributes.get('http.request.method', 'POST')} upstream"
        )
        call = self._upstream = self._child(name, api.SpanKind.CLIENT, attributes)
        carrier: dict[str, str] = {}
        context = api.set_span_in_context(api.NonRecordingSpan(call.context), _empty_context())
        self._tracing.propagator.inject(carrier, context=context)
        return carrier.get("traceparent", "")

    def upstream_ended(self, status: int | None, error: str | None = None) -> None:
        call = self._upstream
        if call is None:
            return
        if status:
            call._attributes["http.response.status_code"] = status
        if error is not None or (status is not None and status >= 500):
            call._error = error or str(status)
        call._send()
        self._upstream = None

    def usage(self, input_tokens: float, output_tokens: float) -> None:
        """The tokens the engine counted (an OpenAI answer's `usage`), as the GenAI semantic
        conventions name them, on the server span: the upstream call's has ended by then."""
        self._attributes["gen_ai.usage.input_tokens"] = int(input_tokens)
        self._attributes["gen_ai.usage.output_tokens"] = int(output_tokens)

    def status(self, code: int) -> None:
        """The answer's HTTP status, as it starts (a 5xx is an error of the server span)."""
        self._attributes["http.response.status_code"] = code
        if code >= 500:
            self._error = str(code)

    def end(self, attributes: dict[str, Any], *, error: str | None = None) -> None:
        """The answer is out (or the request ended without one)."""
        self.upstream_ended(None, "abandoned")  # a call still open was cut short
        self._attributes.update(attributes)
        if error is not None:
            self._error = error
        self._send()

    @property
    def exemplar(self) -> dict[str, str]:
        """The trace id as a histogram's exemplar (OpenMetrics): a slow bucket on a dashboard
        leads to a trace that was kept."""
        return {"trace_id": self.trace_id}


class BatchTrace:
    """A merged call's spans: `batch`, from the round's forming (the slot's grant) to the call's
    end, in the first traced member's trace and linked to every traced member's server span (one
    call serves them all); and the upstream call as its child, whose context the backend gets."""

    __slots__ = ("_batch",)

    def __init__(self, members: Sequence[RequestTrace], started_ns: int, attributes: dict[str, Any]) -> None:
        api = _api()
        first = members[0]
        links = [api.Link(m.context) for m in members]
        self._batch = first._child("batch", api.SpanKind.INTERNAL, attributes, started_ns, links)

    @property
    def exemplar(self) -> dict[str, str]:
        return self._batch.exemplar

    def upstream_started(self, attributes: dict[str, object]) -> str:
        return self._batch.upstream_started(attributes)

    def upstream_ended(self, status: int | None, error: str | None = None) -> None:
        self._batch.upstream_ended(status, error)
        self._batch._send()


def batch_trace(members: Sequence[object], started_ns: int, attributes: dict[str, Any]) -> BatchTrace | None:
    """The merged call's trace, where any of its members' is traced (None otherwise)."""
    traced = [m for m in members if isinstance(m, RequestTrace)]
    return BatchTrace(traced, started_ns, attributes) if traced else None
