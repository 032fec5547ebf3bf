"""Operator routes: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.runtime import Runtime


def ops_routes(runtime: Runtime) -> list[BaseRoute]:
    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"live": True})

    async def readyz(request: Request) -> JSONResponse:
        models = {name: pool.any_ready for name, pool in runtime.pools.items()}
        ready = runtime.ready
        down = runtime.loops_down  # the Redis store's heartbeat or grant listeners, by loop name
        body = {"ready": ready, "draining": runtime.draining, "models": models, "loops_down": down}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
