"""Endpoint discovery: one backend per address its host name resolves to.

Point a backend with `discover: dns` at a headless Service (`clusterIP: None`) and every ready pod
becomes a backend of its own, with the configured `max_concurrency` (or Triton's discovered slots)
each: when the autoscaler adds model-server pods, the gateway gains their slots; when it removes
one, no new request goes there and its in-flight ones finish. The name is resolved again every
`signals.endpoints_interval_ms`; a resolution that takes longer than `health.timeout_ms` counts as
failed (the system resolver has no timeout of its own that the gateway can set).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

import anyio
from anyio.abc import TaskStatus

from gateway.settings import Backend, Model
from gateway.upstream.backends import BackendState, ModelPool

log = logging.getLogger("gateway.endpoints")

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, in a stable order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def at_address(url: str, address: str) -> str:
    """`url` with its host replaced by `address` (bracketed when IPv6), port and path kept."""
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class EndpointDiscovery:
    def __init__(
        self,
        pools: Sequence[ModelPool],
        models: Sequence[Model],
        on_change: Callable[[str], None],
        *,
        interval_s: float,
        timeout_s: float,
        resolve: Resolver = resolve_addresses,
    ) -> None:
        by_name = {pool.name: pool for pool in pools}
        self._templates = [
            (by_name[model.name], model, backend)
            for model in models
            for backend in model.backends
            if backend.discover == "dns"
        ]
        self._on_change = on_change
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._resolve = resolve
        self._departed: dict[tuple[str, str], BackendState] = {}
        """Backends that left the name while requests ran on them: back before those end, they
        are the same server, and they come back as the same backend (with its slots in use)."""

    async def refresh_all(self) -> None:
        await asyncio.gather(*(self._refresh(*template) for template in self._templates))

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        if not self._templates:
            return
        while True:
            await asyncio.sleep(self._interval_s)
            await self.refresh_all()

    async def _refresh(self, pool: ModelPool, model: Model, template: Backend) -> None:
        parts = urlsplit(template.url)
        assert parts.hostname is not None, "validated by settings"
        default_port = 443 if parts.scheme == "https" else 80
        try:
            async with asyncio.timeout(self._timeout_s):
                addresses = await self._resolve(parts.hostname, parts.port or default_port)
        except (OSError, TimeoutError) as error:
            # A name that does not resolve now keeps the backends it had: better stale than none.
            log.warning("cannot resolve %s: %r", parts.hostname, error)
            return
        wanted = {at_address(template.url, address): address for address in addresses}
        # The metrics endpoint follows the pod when it is named by the same host.
        same_host = template.metrics_url and urlsplit(template.metrics_url).hostname == parts.hostname
        mine = {b.url: b for b in pool.backends if b.origin == template.url}
        back = {
            url: self._departed.pop((pool.name, url)) for url in wanted if (pool.name, url) in self._departed
        }
        added = [
            back.get(url)
            or BackendState.from_settings(
                model,
                template.model_copy(
                    update={
                        "url": url,
                        "metrics_url": at_address(template.metrics_url, address)
                        if same_host and template.metrics_url
                        else template.metrics_url,
                    }
                ),
                origin=template.url,
            )
            for url, address in wanted.items()
            if url not in mine
        ]
        gone = [backend for url, backend in mine.items() if url not in wanted]
        self._departed |= {(pool.name, backend.url): backend for backend in gone}
        self._departed = {key: backend for key, backend in self._departed.items() if backend.inflight > 0}
        if not added and not gone:
            return
        pool.backends = [b for b in pool.backends if b not in gone] + added
        log.info(
            "model %s: %s resolves to %d address(es): +%d -%d",
            pool.name,
            parts.hostname,
            len(wanted),
            len(added),
            len(gone),
        )
        self._on_change(pool.name)
