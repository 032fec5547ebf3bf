"""create_app(settings) -> Starlette: routes, the store, and a lifespan that runs the background loops."""

from __future__ import annotations

import contextlib
import gc
import random
import time
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from gateway.flow.controller import AdmissionController
from gateway.http.hot_routes import InferenceRoutes
from gateway.http.kserve import InferEndpoint, kserve_routes
from gateway.http.openai import OpenAIEndpoint, openai_routes
from gateway.http.ops import ops_routes
from gateway.http.proxy import Proxy
from gateway.http.request_meta import RequestClassifier
from gateway.queues.configured import configured_store
from gateway.runtime import Runtime
from gateway.settings import Settings
from gateway.signals.scraper import SignalBoard
from gateway.supervision import Supervisor
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.scaling import ScalingHints
from gateway.upstream.backends import ModelPool
from gateway.upstream.client import create_session
from gateway.upstream.discovery import TritonDiscovery
from gateway.upstream.endpoints import EndpointDiscovery
from gateway.upstream.health import HealthChecker
from gateway.upstream.http1 import UpstreamClient


def build_runtime(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    clock: Callable[[], float] = time.monotonic,
    jitter: Callable[[], float] = random.random,
    supervisor: Supervisor | None = None,
) -> Runtime:
    pools = {model.name: ModelPool.from_settings(model) for model in settings.models}
    metrics = GatewayMetrics(registry if registry is not None else CollectorRegistry())
    store = configured_store(settings, list(pools.values()), metrics, clock=clock)
    metrics.watch_pools(list(pools.values()), [p.name for p in settings.priorities], store, clock)
    supervisor = supervisor if supervisor is not None else Supervisor()
    signals = SignalBoard(
        list(pools.values()), settings.signals, settings.kueue, metrics, supervisor=supervisor, clock=clock
    )
    hints = ScalingHints(list(pools.values()), store, settings.autoscaling, clock=clock)
    metrics.registry.register(hints)
    controller = AdmissionController(
        store,
        settings.priorities,
        metrics,
        admission=settings.admission_policy(),
        signals=signals,
        backlog_limits=signals.cluster.limits if signals.cluster is not None else None,
        clock=clock,
        jitter=jitter,
    )
    runtime = Runtime(
        settings=settings,
        pools=pools,
        store=store,
        controller=controller,
        metrics=metrics,
        classifier=RequestClassifier(settings),
        signals=signals,
        hints=hints,
        supervisor=supervisor,
        clock=clock,
    )
    metrics.watch_loops(runtime.supervisors)
    return runtime


def create_app(settings: Settings, *, runtime: Runtime | None = None) -> Starlette:
    rt = runtime if runtime is not None else build_runtime(settings)
    proxy = Proxy(rt)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        rt.session = create_session()
        rt.upstream = UpstreamClient()
        rt.health = HealthChecker(
            rt.session,
            list(rt.pools.values()),
            rt.store.backends_changed,
            interval_s=settings.health.interval_ms / 1000,
            timeout_s=settings.health.timeout_ms / 1000,
            failures_to_down=settings.health.failures_to_down,
        )
        discovery = TritonDiscovery(
            list(rt.pools.values()),
            rt.store.backends_changed,
            interval_s=settings.signals.discovery_interval_ms / 1000,
            timeout_s=settings.health.timeout_ms / 1000,
        )

        def backends_moved(model: str) -> None:
            rt.store.backends_changed(model)
            rt.signals.follow(model)

        endpoints = EndpointDiscovery(
            list(rt.pools.values()),
            settings.models,
            backends_moved,
            interval_s=settings.signals.endpoints_interval_ms / 1000,
        )
        await endpoints.refresh_all()
        await discovery.discover_all()
        await rt.health.check_all()
        # Serving starts once these return: each waits until its loops run (the Redis store's
        # grant listeners and heartbeat among them).
        await rt.store.start()
        await rt.signals.start(rt.session)
        await rt.supervisor.start("health", rt.health.run)
        await rt.supervisor.start("triton_discovery", discovery.run)
        await rt.supervisor.start("endpoint_discovery", endpoints.run)
        await rt.supervisor.start("scaling_hints", rt.hints.run)
        # Everything built so far lives as long as the process: keep it out of the collector's
        # scans so that a collection costs in proportion to per-request garbage only.
        gc.freeze()
        try:
            yield
        finally:
            await rt.signals.stop()
            await rt.supervisor.stop()
            await rt.store.stop()
            await rt.session.close()
            await rt.upstream.close()

    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        message = f"no route for {request.method} {request.url.path}"
        return JSONResponse({"error": message}, status_code=status)

    app = _GatewayApp(
        routes=[*kserve_routes(rt, proxy), *openai_routes(rt), *ops_routes(rt)],
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: not_found},
    )
    app.inference = (InferEndpoint(rt, proxy), OpenAIEndpoint(rt, proxy))
    app.state.runtime = rt
    return app


class _GatewayApp(Starlette):
    """Starlette with the inference routes in front of its whole middleware stack.

    Inference requests skip Starlette's error and exception layers (an unhandled exception there
    still gets a 500 from the server); everything else is plain Starlette.
    """

    inference: tuple[ASGIApp, ASGIApp]

    def build_middleware_stack(self) -> ASGIApp:
        kserve_infer, openai = self.inference
        return InferenceRoutes(super().build_middleware_stack(), kserve_infer=kserve_infer, openai=openai)
