"""An OTLP/HTTP trace receiver that counts what it is sent and keeps nothing: the far end of the
traced benchmark target (loadtests.bench, `traced`).

    python -m loadtests.otlp_sink --port 4318
"""

from __future__ import annotations

import argparse

from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

_EMPTY = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    received = {"spans": 0}

    async def export(request: web.Request) -> web.Response:
        message = trace_service_pb2.ExportTraceServiceRequest.FromString(await request.read())
        received["spans"] += sum(len(s.spans) for r in message.resource_spans for s in r.scope_spans)
        return web.Response(body=_EMPTY, content_type="application/x-protobuf")

    async def count(request: web.Request) -> web.Response:
        return web.json_response(received)

    app = web.Application()
    app.router.add_post("/v1/traces", export)
    app.router.add_get("/", count)
    print(f"otlp sink listening on http://127.0.0.1:{args.port}", flush=True)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
