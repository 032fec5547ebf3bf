"""Operator routes: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.flow.readiness import Readiness


def ops_routes(readiness: Readiness, registry: CollectorRegistry) -> list[BaseRoute]:
    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"live": True})

    async def readyz(request: Request) -> JSONResponse:
        ready = readiness.ready
        body = {
            "ready": ready,
            "draining": readiness.draining,
            "models": readiness.models,
            "loops_down": readiness.loops_down,
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
