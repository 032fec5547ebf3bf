"""What a sampled request's trace costs in CPU, outside any server (issue 40's 3% at 10% sampling):
a served request's spans and a refused one's through the OpenTelemetry SDK, then their OTLP
encoding, each timed on its own, and the mix at 3x overload (two refused for each served).

    PYTHONPATH=. python -m loadtests.span_costs
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.telemetry.tracing import RequestTrace, Tracing

REQUESTS = 3000


def main() -> None:
    # Spans stay queued (no export during the loop): the encoding is timed apart below.
    os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "600000"
    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(10 * REQUESTS)
    os.environ["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] = str(10 * REQUESTS)
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from gateway.telemetry.tracing import tracing_from_environment

    tracing = tracing_from_environment()
    assert tracing is not None
    processor = tracing.processor
    queue = processor._batch_processor._queue

    def timed(shape: Callable[[RequestTrace, int], None]) -> tuple[float, float, int]:
        """CPU per request to make its spans, to encode them, and how many it has."""
        queue.clear()
        started = time.process_time()
        for _ in range(REQUESTS):
            trace = _request(tracing)
            shape(trace, time.time_ns())
        made = (time.process_time() - started) / REQUESTS * 1e6
        spans = list(queue)
        started = time.process_time()
        encode_spans(spans).SerializeToString()
        encoded = (time.process_time() - started) / REQUESTS * 1e6
        return made, encoded, len(spans) // REQUESTS

    served = timed(_served)
    refused = timed(_refused)
    for name, (made, encoded, spans) in (("served", served), ("refused", refused)):
        print(f"{name}: {spans} spans, {made:.0f} us CPU to make, {encoded:.0f} us to encode for OTLP")
    mix = (sum(served[:2]) + 2 * sum(refused[:2])) / 3
    print(f"at 3x overload (2 refused a served): {mix:.0f} us a sampled request, {mix / 10:.1f} us at 10%")
    os._exit(0)  # nothing to export: the exporter would retry an endpoint that is not there


def _request(tracing: Tracing) -> RequestTrace:
    parent = b"00-" + os.urandom(16).hex().encode() + b"-" + os.urandom(8).hex().encode() + b"-01"
    trace = tracing.request("POST infer", [(b"traceparent", parent)], {"http.request.method": "POST"})
    assert trace is not None
    return trace


_REQUEST = {"gateway.model": "sim", "gateway.class": "low", "gateway.tenant": "-", "gateway.cost": 1.0}


def _served(trace: RequestTrace, now: int) -> None:
    trace.admission(_REQUEST | {"gateway.decision": "admitted"}, refused=False, started_ns=now)
    trace.queued(now, now + 1000)
    trace.upstream_started(
        {"http.request.method": "POST", "url.full": "http://127.0.0.1:1/v2/models/sim/infer"}
    )
    trace.upstream_ended(200)
    trace.status(200)
    trace.end({})


def _refused(trace: RequestTrace, now: int) -> None:
    refusal = {"gateway.decision": "refused", "gateway.reason": "queue_full", "gateway.retry_after_s": 1.5}
    trace.admission(_REQUEST | refusal, refused=True, started_ns=now)
    trace.status(429)
    trace.end({})


if __name__ == "__main__":
    main()
