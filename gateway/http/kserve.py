"""KServe v2 / Triton HTTP routes: inference through admission, the rest passed through or answered here."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from gateway.errors import ErrorStyle
from gateway.http.exchange import read_body
from gateway.http.proxy import AdmittedEndpoint, Exchange, Proxy
from gateway.http.request_meta import Problem
from gateway.runtime import Runtime
from policies.outcomes import Outcome


class InferEndpoint(AdmittedEndpoint):
    """POST /v2/models/{model}[/versions/{version}]/infer: the body passes byte for byte."""

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = Exchange(scope, receive, send, ErrorStyle.KSERVE)
        model = scope["path_params"]["model"]
        pool = self.runtime.pools.get(model)
        if pool is None:
            await self.proxy.fail(exchange, Outcome.UNKNOWN_MODEL, detail=repr(model))
            return
        meta = self.runtime.classifier.classify(scope["headers"])
        if isinstance(meta, Problem):
            await self.proxy.fail(exchange, meta.outcome, model=model, detail=meta.detail)
            return
        body = await read_body(scope, receive, self.runtime.settings.limits.max_body_bytes)
        if isinstance(body, Outcome):
            await self.proxy.fail(exchange, body, model=model, priority=meta.priority)
            return
        exchange.body = body
        await self.proxy.admitted(exchange, pool, meta)


class ModelPassthrough:
    """Model metadata, config and readiness: forwarded to a ready backend, no slot taken."""

    def __init__(self, runtime: Runtime, proxy: Proxy) -> None:
        self._runtime = runtime
        self._proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = Exchange(scope, receive, send, ErrorStyle.KSERVE)
        model = scope["path_params"]["model"]
        pool = self._runtime.pools.get(model)
        if pool is None:
            await self._proxy.fail(exchange, Outcome.UNKNOWN_MODEL, detail=repr(model))
            return
        await self._proxy.unmetered(exchange, pool)


def kserve_routes(runtime: Runtime, proxy: Proxy) -> list[BaseRoute]:
    """The control-plane routes; inference itself is routed by `InferenceRoutes`."""
    passthrough = ModelPassthrough(runtime, proxy)

    async def live(request: Request) -> JSONResponse:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> JSONResponse:
        return JSONResponse({"ready": runtime.ready}, status_code=200 if runtime.ready else 503)

    async def server_metadata(request: Request) -> JSONResponse:
        return JSONResponse({"name": "inference-gateway", "version": "0.1.0", "extensions": []})

    model_paths = ["/v2/models/{model}", "/v2/models/{model}/versions/{version}"]
    return [
        *(
            Route(base + suffix, passthrough, methods=["GET"])
            for base in model_paths
            for suffix in ("", "/ready", "/config")
        ),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2", server_metadata),
    ]
