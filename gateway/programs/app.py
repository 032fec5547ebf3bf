"""create_app(settings) -> the ASGI app: the gateway's parts (`build_runtime`), each route given the
ones it needs, and a lifespan that runs the background loops (gateway.programs.runtime.running)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import route_error
from gateway.flow.admitted import Admission
from gateway.flow.auto_limits import AutoLimits
from gateway.flow.batch_calls import Batches
from gateway.flow.controller import AdmissionController
from gateway.flow.drain import Drain
from gateway.flow.queued_bytes import QueuedBytes
from gateway.flow.readiness import Readiness
from gateway.flow.request_meta import RequestClassifier
from gateway.flow.status import StatusBoard
from gateway.flow.windows import WindowClock
from gateway.http.hot_routes import InferenceRoutes
from gateway.http.intake import Intake
from gateway.http.kserve import InferEndpoint, ModelPassthrough, kserve_routes
from gateway.http.openai import OpenAIEndpoint, openai_routes
from gateway.http.ops import health_route, ops_routes
from gateway.http.status import request_status_route, status_routes
from gateway.programs.reload import ConfigReloader
from gateway.programs.runtime import Runtime, running, supervisors_of
from gateway.queues.configured import configured_store
from gateway.settings import Settings
from gateway.signals.scraper import SignalBoard
from gateway.supervision import Supervisor
from gateway.telemetry.access_log import AccessLog
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.scaling import ScalingHints
from gateway.telemetry.tracing import tracing_from_environment
from gateway.upstream.backends import ModelPool
from gateway.upstream.client import HeaderRules
from gateway.upstream.discovery import TritonDiscovery
from gateway.upstream.endpoints import EndpointDiscovery
from gateway.upstream.exchange import Forwarder
from gateway.upstream.health import HealthChecker
from gateway.upstream.http1 import UpstreamClient
from gateway.version import package_version

if TYPE_CHECKING:  # gRPC loads only where it is configured
    from gateway.grpc.server import GrpcListener


def build_runtime(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    clock: Callable[[], float] = time.monotonic,
    jitter: Callable[[], float] = random.random,
    supervisor: Supervisor | None = None,
) -> Runtime:
    """Every part of the gateway, wired to the parts it uses; nothing is started (see `running`)."""
    pools = {model.name: ModelPool.from_settings(model) for model in settings.models}
    pool_list = list(pools.values())
    metrics = GatewayMetrics(registry if registry is not None else CollectorRegistry())
    windows = WindowClock(settings)
    reserved_of = windows.reserved_slots if windows.moves_reservations else None
    store = configured_store(
        settings, pool_list, metrics, clock=clock, weight_of=windows.weight, reserved_of=reserved_of
    )
    store.identify(settings.config_hash())  # told to the replicas that share it (the status page)
    metrics.watch_pools(pool_list, [p.name for p in settings.priorities], store, clock, settings.quotas())
    supervisor = supervisor if supervisor is not None else Supervisor()
    signals = SignalBoard(
        pool_list, settings.signals, settings.kueue, metrics, supervisor=supervisor, clock=clock
    )
    auto_limits = AutoLimits(settings.models, store, settings.signals.scrape_interval_ms / 1000, clock)
    if auto_limits.any:
        signals.on_engine_sample = auto_limits.on_sample
    queued_bytes = QueuedBytes(settings.queued_byte_limits())
    metrics.watch_queued_bytes([m.name for m in settings.models], queued_bytes.held)
    hints = ScalingHints(pool_list, store, settings.autoscaling, clock=clock)
    metrics.registry.register(hints)
    controller = AdmissionController(
        store,
        settings.priorities,
        metrics,
        admission=settings.admission_policy(),
        signals=signals,
        backlog_limits=signals.cluster.limits if signals.cluster is not None else None,
        queued_bytes=queued_bytes,
        rates_seen_s=settings.estimation.rate_window_s,
        settled_seen_s=settings.estimation.settled_window_s,
        windows=windows,
        quotas=settings.quotas(),
        clock=clock,
        jitter=jitter,
    )
    grpc_channels = None
    if any(model.decoupled for model in settings.models):
        from gateway.upstream.streamed import GrpcChannels

        grpc_channels = GrpcChannels()
    health = HealthChecker.from_settings(
        pool_list, store.backends_changed, settings.health, clock=clock, grpc_channels=grpc_channels
    )

    def backends_moved(model: str) -> None:
        store.backends_changed(model)
        signals.follow(model)

    upstream = UpstreamClient()
    drain = Drain()
    supervisors = supervisors_of(supervisor, store)
    metrics.watch_loops(supervisors)
    return Runtime(
        settings=settings,
        pools=pools,
        store=store,
        controller=controller,
        metrics=metrics,
        signals=signals,
        hints=hints,
        health=health,
        triton_discovery=TritonDiscovery(
            pool_list,
            store.backends_changed,
            interval_s=settings.signals.discovery_interval_ms / 1000,
            timeout_s=settings.health.timeout_ms / 1000,
        ),
        endpoint_discovery=EndpointDiscovery(
            pool_list,
            settings.models,
            backends_moved,
            interval_s=settings.signals.endpoints_interval_ms / 1000,
            timeout_s=settings.health.timeout_ms / 1000,
        ),
        upstream=upstream,
        forwarder=Forwarder(
            upstream,
            on_unreachable=health.mark_unreachable,
            on_verdict=health.judge,
            observe_upstream_s=metrics.observe_upstream,
            clock=clock,
        ),
        # Retry-After when no backend is ready: when one may be again (its cool-down, the next probe).
        admission=Admission(
            controller,
            metrics,
            drain,
            no_backend_retry_s=settings.health.interval_ms / 1000,
            ready_again_in_s=health.ready_again_in_s,
        ),
        drain=drain,
        readiness=Readiness(pools, drain, supervisors),
        supervisor=supervisor,
        clock=clock,
        tracing=tracing_from_environment(),
        windows=windows,
        grpc_channels=grpc_channels,
    )


def create_app(
    settings: Settings, *, runtime: Runtime | None = None, config_path: str | None = None
) -> ASGIApp:
    """The app of `settings`; with `config_path`, the file it came from, reloaded on SIGHUP, when it
    changes, and on `POST /admin/config/reload` (gateway.programs.reload)."""
    rt = runtime if runtime is not None else build_runtime(settings)
    header_rules = HeaderRules.from_settings(settings)
    classifier = RequestClassifier(settings)
    intake = Intake(
        pools=rt.pools,
        classifier=classifier,
        admission=rt.admission,
        forwarder=rt.forwarder,
        max_body_bytes=settings.limits.max_body_bytes,
        header_rules=header_rules,
        batches=Batches(rt.forwarder, rt.metrics, rt.admission.no_backend_retry_s),
        access=AccessLog(
            settings.access_log.format,
            settings.access_log.max_lines_per_s,
            enabled=settings.access_log.enabled,
        ),
        tracing=rt.tracing,
    )
    passthrough = ModelPassthrough(
        rt.pools,
        rt.forwarder,
        rt.metrics,
        rt.drain,
        no_backend_retry_s=rt.admission.no_backend_retry_s,
        header_rules=header_rules,
        classifier=classifier,
        access=intake.access,
    )

    grpc_listener = None if settings.grpc_listen is None else grpc_listener_of(settings, rt, intake)

    board = status_board(settings, rt)
    reloader = None
    if config_path is not None and rt.windows is not None:
        reloader = ConfigReloader(
            config_path,
            settings,
            classifier=classifier,
            windows=rt.windows,
            controller=rt.controller,
            board=board,
            store=rt.store,
            access=intake.access,
            registry=rt.metrics.registry,
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with running(rt), reloading(reloader, rt):
            if grpc_listener is None:
                yield
                return
            await grpc_listener.start()
            try:
                yield
            finally:
                await grpc_listener.stop()

    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        status, allow = (exc.status_code, exc.headers) if isinstance(exc, HTTPException) else (404, None)
        # scope's path, not request.url: urlsplit caches the URLs it parses, input anyone can send.
        error = route_error(status, request.scope["path"], request.method)
        return JSONResponse(error, status_code=status, headers=allow)  # a 405's Allow

    errors = {404: not_found, 405: not_found}
    queued = rt.admission.queued
    ops = [*ops_routes(rt.readiness, rt.metrics.registry), *status_routes(board)]
    client_routes = [
        *kserve_routes(rt.readiness, passthrough),
        *openai_routes(rt.pools, classifier),
        health_route(),
        request_status_route(board, queued, classifier),
    ]
    if settings.admin_listen is None:
        client_routes += ops
    else:
        ops.append(request_status_route(board, queued, None))  # operators find every request
        if reloader is not None:
            ops.append(reload_route(reloader))
    app = _GatewayApp(routes=client_routes, lifespan=lifespan, exception_handlers=errors)
    app.inference = (InferEndpoint(intake), OpenAIEndpoint(intake))
    if settings.admin_listen is None:
        return app
    admin = Starlette(routes=ops, exception_handlers=errors)
    return ByListener(app, admin=admin, admin_port=settings.admin_listen.port)


def grpc_listener_of(settings: Settings, rt: Runtime, intake: Intake) -> GrpcListener:
    """The gRPC listener of `grpc_listen`, sharing the HTTP routes' admission and classifier."""
    from gateway.grpc.inference import GrpcInference
    from gateway.grpc.server import GrpcListener
    from gateway.grpc.service import InferenceService
    from gateway.upstream.streamed import GrpcChannels

    assert settings.grpc_listen is not None
    channels = rt.grpc_channels or GrpcChannels()
    inference = GrpcInference(
        rt.pools,
        intake.classifier,
        rt.admission,
        rt.forwarder,
        intake.batches,
        intake.access,
        intake.tracing,
        channels,
    )
    service = InferenceService(
        inference,
        rt.pools,
        intake.classifier,
        rt.forwarder,
        rt.readiness,
        version=package_version(),
        no_backend_retry_s=rt.admission.no_backend_retry_s,
    )
    return GrpcListener(
        settings.grpc_listen, service, max_message_bytes=settings.limits.max_body_bytes, channels=channels
    )


@contextlib.asynccontextmanager
async def reloading(reloader: ConfigReloader | None, rt: Runtime) -> AsyncIterator[None]:
    """SIGHUP and the file watch reload the config while the app runs."""
    if reloader is None:
        yield
        return
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, reloader.reload, "SIGHUP")
    await rt.supervisor.start("config_watch", reloader.watch)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGHUP)


def reload_route(reloader: ConfigReloader) -> Route:
    """`POST /admin/config/reload` (the admin listener only): reload now, and say what changed."""

    async def reload(request: Request) -> JSONResponse:
        done = reloader.reload("POST /admin/config/reload")
        return JSONResponse(done, status_code=200 if done["result"] == "ok" else 422)

    return Route("/admin/config/reload", reload, methods=["POST"])


def status_board(settings: Settings, rt: Runtime) -> StatusBoard:
    return StatusBoard(
        list(rt.pools.values()),
        [p.name for p in settings.priorities],
        rt.store,
        rt.metrics.recent,
        rt.admission.queued,
        store_kind=settings.store.kind,
        store_mode=settings.store.mode,
        replicas=settings.store.replicas,
        config_hash=settings.config_hash(),
        quotas=settings.quotas(),
        draining=lambda: rt.drain.draining,
        clock=rt.clock,
    )


class ByListener:
    """The admin routes on the admin listener only, everything else on the client listener: one
    server and one connection budget serve both, told apart by the port a connection came in on."""

    def __init__(self, client: Starlette, *, admin: ASGIApp, admin_port: int) -> None:
        self.client = client
        self._admin = admin
        self._admin_port = admin_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if scope["type"] != "lifespan" and server is not None and server[1] == self._admin_port:
            await self._admin(scope, receive, send)
        else:
            await self.client(scope, receive, send)


class _GatewayApp(Starlette):
    """Starlette with the inference routes in front of its whole middleware stack.

    Inference requests skip Starlette's error and exception layers (an unhandled exception there
    still gets a 500 from the server); everything else is plain Starlette.
    """

    inference: tuple[ASGIApp, ASGIApp]

    def build_middleware_stack(self) -> ASGIApp:
        kserve_infer, openai = self.inference
        return InferenceRoutes(super().build_middleware_stack(), kserve_infer=kserve_infer, openai=openai)
