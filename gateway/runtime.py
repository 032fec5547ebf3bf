"""Runtime: the gateway's live parts, assembled once and shared by every route."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import aiohttp

from gateway.flow.controller import AdmissionController
from gateway.http.request_meta import RequestClassifier
from gateway.queues.base import RequestQueue
from gateway.settings import Settings
from gateway.signals.scraper import SignalBoard
from gateway.supervision import Supervisor
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.scaling import ScalingHints
from gateway.upstream.backends import ModelPool
from gateway.upstream.health import HealthChecker
from gateway.upstream.http1 import UpstreamClient


@dataclass(eq=False)
class Runtime:
    settings: Settings
    pools: dict[str, ModelPool]
    store: RequestQueue
    controller: AdmissionController
    metrics: GatewayMetrics
    classifier: RequestClassifier
    signals: SignalBoard
    hints: ScalingHints
    supervisor: Supervisor
    """Runs the app's loops (health, discovery, scrapers, hints); the store may run its own."""
    clock: Callable[[], float] = time.monotonic
    session: aiohttp.ClientSession | None = None
    """For the gateway's own calls: health checks and metric scrapes."""
    upstream: UpstreamClient | None = None
    """For proxied requests."""
    health: HealthChecker | None = None
    draining: bool = False
    active_requests: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def supervisors(self) -> list[Supervisor]:
        own = [self.store.supervisor] if isinstance(self.store, Supervised) else []
        return [self.supervisor, *own]

    @property
    def loops_down(self) -> list[str]:
        """The loops serving depends on (the Redis store's heartbeat and grant listeners) that are down."""
        return sorted({name for supervisor in self.supervisors for name in supervisor.required_down()})

    @property
    def ready(self) -> bool:
        return (
            not self.draining and all(pool.any_ready for pool in self.pools.values()) and not self.loops_down
        )

    def request_started(self) -> None:
        self.active_requests += 1
        self._idle.clear()

    def request_finished(self) -> None:
        self.active_requests -= 1
        if self.active_requests == 0:
            self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting and wait for in-flight and queued requests to finish; False on timeout."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


@runtime_checkable
class Supervised(Protocol):
    """A store that runs its loops under a supervisor of its own (Redis)."""

    @property
    def supervisor(self) -> Supervisor: ...
