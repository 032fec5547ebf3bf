"""Runtime: the gateway's parts, each built once before serving, and `running`, the lifespan that
starts and stops their loops.

Nothing here is passed to a route: gateway.programs.app hands each route the parts it needs. Every part
exists from the start; only the aiohttp session for the gateway's own calls (health checks,
metric scrapes) is opened by `running`, and it is passed to the loops that use it.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from gateway.flow.admitted import Admission
from gateway.flow.controller import AdmissionController
from gateway.flow.drain import Drain
from gateway.flow.readiness import Readiness
from gateway.flow.windows import WindowClock
from gateway.queues.base import RequestQueue
from gateway.settings import Settings
from gateway.signals.scraper import SignalBoard
from gateway.supervision import Supervisor
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.scaling import ScalingHints
from gateway.telemetry.tracing import Tracing
from gateway.upstream.backends import ModelPool
from gateway.upstream.client import create_session
from gateway.upstream.discovery import TritonDiscovery
from gateway.upstream.endpoints import EndpointDiscovery
from gateway.upstream.exchange import Forwarder
from gateway.upstream.health import HealthChecker
from gateway.upstream.http1 import UpstreamClient

if TYPE_CHECKING:  # grpc: imported where a model is decoupled, not by every gateway
    from gateway.upstream.streamed import GrpcChannels


@dataclass(frozen=True, eq=False)
class Runtime:
    settings: Settings
    pools: dict[str, ModelPool]
    store: RequestQueue
    controller: AdmissionController
    metrics: GatewayMetrics
    signals: SignalBoard
    hints: ScalingHints
    health: HealthChecker
    triton_discovery: TritonDiscovery
    endpoint_discovery: EndpointDiscovery
    upstream: UpstreamClient
    """For proxied requests (its connections open as requests need them)."""
    forwarder: Forwarder
    admission: Admission
    drain: Drain
    readiness: Readiness
    supervisor: Supervisor
    """Runs the app's loops (health, discovery, scrapers, hints); the store may run its own."""
    clock: Callable[[], float] = time.monotonic
    windows: WindowClock | None = None
    """The time windows, and the tenants' weights a reload may change."""
    tracing: Tracing | None = None
    """Traces, where the environment names an OTLP endpoint (gateway.telemetry.tracing)."""
    grpc_channels: GrpcChannels | None = None
    """To the backends' gRPC ports, where a model is decoupled (gateway.upstream.streamed)."""

    @property
    def ready(self) -> bool:
        return self.readiness.ready


@runtime_checkable
class Supervised(Protocol):
    """A store that runs its loops under a supervisor of its own (Redis)."""

    @property
    def supervisor(self) -> Supervisor: ...


def supervisors_of(supervisor: Supervisor, store: RequestQueue) -> list[Supervisor]:
    """The app's supervisor and the store's own, if it has one."""
    return [supervisor, *([store.supervisor] if isinstance(store, Supervised) else [])]


@asynccontextmanager
async def running(rt: Runtime) -> AsyncIterator[None]:
    """Start everything's loops, serve, stop them: the app's lifespan."""
    session = create_session()
    await rt.endpoint_discovery.refresh_all()
    await rt.triton_discovery.discover_all()
    await rt.health.check_all(session)
    # Serving starts once these return: each waits until its loops run (the Redis store's
    # grant listeners and heartbeat among them).
    await rt.store.start()
    await rt.signals.start(session)
    await rt.supervisor.start("health", partial(rt.health.run, session))
    await rt.supervisor.start("triton_discovery", rt.triton_discovery.run)
    await rt.supervisor.start("endpoint_discovery", rt.endpoint_discovery.run)
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
        await session.close()
        await rt.upstream.close()
        if rt.tracing is not None:
            await asyncio.to_thread(rt.tracing.shutdown)  # sends the spans still held
