"""Operator routes: liveness, readiness and Prometheus metrics; and `/health`, the probe load
testers send to the serving port before a run."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.flow.readiness import Readiness


async def _live(request: Request) -> JSONResponse:
    return JSONResponse({"live": True})


def health_route() -> BaseRoute:
    """`GET /health` on the client listener, whatever `admin_listen` says: what load testers
    (GuideLLM, AIPerf, `vllm bench serve`) probe on the port they will load; /healthz's answer."""
    return Route("/health", _live, methods=["GET"])


def ops_routes(readiness: Readiness, registry: CollectorRegistry) -> list[BaseRoute]:
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
        # OpenMetrics where the scraper asks for it (Prometheus does): only it carries exemplars.
        if "application/openmetrics-text" in request.headers.get("accept", ""):
            exposition = openmetrics.generate_latest(registry)  # type: ignore[no-untyped-call]
            return Response(exposition, media_type=openmetrics.CONTENT_TYPE_LATEST)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return [
        Route("/healthz", _live, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
