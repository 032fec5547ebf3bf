"""What a sampled request's trace costs in CPU, outside any server (issue 40's 3% at 10% sampling):
the gateway's four spans through the OpenTelemetry SDK (server, admission, queue wait, upstream),
then their OTLP encoding, each timed on its own.

    PYTHONPATH=. python -m loadtests.span_costs
"""

from __future__ import annotations

import os
import time

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
    started = time.process_time()
    for _ in range(REQUESTS):
        parent = b"00-" + os.urandom(16).hex().encode() + b"-" + os.urandom(8).hex().encode() + b"-01"
        trace = tracing.request("POST infer", [(b"traceparent", parent)], {"http.request.method": "POST"})
        assert trace is not None
        now = time.time_ns()
        admission = {"gateway.class": "low", "gateway.cost": 1.0, "gateway.decision": "admitted"}
        trace.admission(admission, refused=False, started_ns=now)
        trace.queued(now, now + 1000)
        trace.upstream_started({"http.request.method": "POST", "server.address": "127.0.0.1"})
        trace.upstream_ended(200)
        trace.status(200)
        trace.end({})
    per_request_us = (time.process_time() - started) / REQUESTS * 1e6
    processor = tracing._provider._active_span_processor._span_processors[0]  # type: ignore[attr-defined]
    spans = list(processor._batch_processor._queue)
    started = time.process_time()
    encode_spans(spans).SerializeToString()
    per_span_us = (time.process_time() - started) / len(spans) * 1e6
    print(f"{per_request_us:.0f} us CPU per sampled request to make its {len(spans) // REQUESTS} spans")
    print(f"{per_span_us:.0f} us CPU per span to encode them for OTLP ({len(spans)} spans)")
    os._exit(0)  # nothing to export: the exporter would retry an endpoint that is not there


if __name__ == "__main__":
    main()
