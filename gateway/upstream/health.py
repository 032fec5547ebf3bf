"""Health checks: poll each backend's readiness path and tell the store when readiness changes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import aiohttp
import anyio
from anyio.abc import TaskStatus

from gateway.upstream.backends import BackendState, ModelPool

log = logging.getLogger("gateway.health")


class HealthChecker:
    """Built before serving; its probes take the session the lifespan opens (`check_all`, `run`)."""

    def __init__(
        self,
        pools: Sequence[ModelPool],
        on_change: Callable[[str], None],
        *,
        interval_s: float,
        timeout_s: float,
        failures_to_down: int = 2,
    ) -> None:
        self._pools = pools
        self._on_change = on_change
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        # One slow probe on a busy host is not a dead backend: it takes this many in a row.
        self._failures_to_down = failures_to_down
        self._failures: dict[int, int] = {}
        self._judged: set[int] = set()
        """Backends whose readiness has been logged once: every verdict after is a transition."""

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        """Probe every backend once, concurrently."""
        await asyncio.gather(*(self._check(session, pool, b) for pool in self._pools for b in pool.backends))

    async def run(
        self, session: aiohttp.ClientSession, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            await asyncio.sleep(self._interval_s)
            await self.check_all(session)

    def mark_unreachable(
        self, pool: ModelPool, backend: BackendState, reason: str = "a request could not reach it"
    ) -> None:
        """Passive check: a connection to the backend failed, so stop dispatching to it now."""
        self._set(pool, backend, ready=False, reason=reason)

    async def _check(self, session: aiohttp.ClientSession, pool: ModelPool, backend: BackendState) -> None:
        refused = False
        url = backend.url + backend.health_path
        try:
            async with session.get(url, timeout=self._timeout) as reply:
                ready, reason = reply.status == 200, f"{url} answered {reply.status}"
        except aiohttp.ClientConnectorError as error:
            ready, refused = False, True  # nothing listens there: down at once
            reason = f"cannot connect to {url}: {error.os_error.strerror or error}"
        except TimeoutError:
            ready, reason = False, f"{url} did not answer within {self._timeout.total} s"
        except aiohttp.ClientError as error:
            ready, reason = False, f"{url} failed: {type(error).__name__}"
        failures = 0 if ready else self._failures.get(id(backend), 0) + 1
        self._failures[id(backend)] = failures
        if ready or refused or failures >= self._failures_to_down or not backend.ready:
            self._set(pool, backend, ready, reason)

    def _set(self, pool: ModelPool, backend: BackendState, ready: bool, reason: str) -> None:
        if ready and backend.max_concurrency == 0:  # a Triton backend's slots come from discovery
            ready, reason = False, "its slots are not known yet (model config not read)"
        first = id(backend) not in self._judged
        if backend.ready == ready and not first:
            return
        self._judged.add(id(backend))
        changed = backend.ready != ready
        backend.ready = ready
        if ready:
            log.info("backend %s of model %s is ready", backend.url, pool.name)
        else:
            log.warning("backend %s of model %s is not ready: %s", backend.url, pool.name, reason)
        if changed:
            self._on_change(pool.name)
