"""Triton discovery: read each Triton backend's model config with tritonclient, at start and then
periodically, so that a backend's slots default to what the model can really run at once.

A Triton model executes one batch per instance at a time; with dynamic batching a batch gathers up
to max_batch_size requests. So, unless the config sets max_concurrency, a backend gets
instances x max_batch_size slots with dynamic batching, and one slot per instance without it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import anyio
from anyio.abc import TaskStatus

from gateway.upstream.backends import BackendState, ModelPool
from gateway.upstream.origin import tls_context

log = logging.getLogger("gateway.discovery")


@dataclass(frozen=True, slots=True)
class TritonModel:
    ready: bool
    instances: int
    max_batch_size: int
    dynamic_batching: bool
    decoupled: bool = False
    """Its transaction policy is decoupled: several responses to a request, over gRPC streams only."""

    @property
    def slots(self) -> int:
        """Requests the model can execute at once."""
        per_instance = self.max_batch_size if self.dynamic_batching and self.max_batch_size > 0 else 1
        return max(1, self.instances * per_instance)

    @classmethod
    def from_config(cls, ready: bool, config: dict[str, Any]) -> TritonModel:
        groups = config.get("instance_group") or [{}]
        return cls(
            ready=ready,
            instances=sum(int(group.get("count", 1) or 1) for group in groups),
            max_batch_size=int(config.get("max_batch_size", 0) or 0),
            dynamic_batching="dynamic_batching" in config,
            decoupled=bool((config.get("model_transaction_policy") or {}).get("decoupled")),
        )


class TritonDiscovery:
    def __init__(
        self,
        pools: Sequence[ModelPool],
        on_change: Callable[[str], None],
        *,
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self._pools = pools
        self._on_change = on_change
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._told: set[tuple[str, str]] = set()
        """(model, backend URL) of the decoupled models served as if they were not, said once."""

    async def discover_all(self) -> None:
        # Backends may come and go (endpoint discovery): take the list as it is now.
        await asyncio.gather(
            *(self._discover(p, b) for p in self._pools for b in p.backends if b.kind == "triton")
        )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await asyncio.sleep(self._interval_s)
            await self.discover_all()

    async def _discover(self, pool: ModelPool, backend: BackendState) -> None:
        # tritonclient imports numpy (80 ms): only a gateway with Triton backends pays for it.
        from tritonclient.utils import InferenceServerException

        try:
            async with asyncio.timeout(self._timeout_s):  # not wait_for: it can drop a cancellation
                model = await self._read(backend)
        except (InferenceServerException, OSError, TimeoutError, aiohttp.ClientError) as error:
            log.debug("discovery of %s at %s failed: %r", backend.served_model, backend.url, error)
            return
        except Exception as error:  # an answer that is no model config: this backend's problem alone
            log.warning("discovery of %s at %s failed: %r", backend.served_model, backend.url, error)
            return
        backend.max_batch_size = model.max_batch_size
        backend.dynamic_batching = model.dynamic_batching
        if model.decoupled and not pool.decoupled and (pool.name, backend.url) not in self._told:
            self._told.add((pool.name, backend.url))
            log.warning(
                "model %s is decoupled on %s (several responses to a request): its requests fail until"
                " the model is configured decoupled: true, with the backend's grpc_port",
                pool.name,
                backend.url,
            )
        if not backend.configured_slots and model.ready and model.slots != backend.known_slots:
            log.info(
                "backend %s: model %s has %d instance(s), max_batch_size %d%s: %d slots",
                backend.url,
                backend.served_model,
                model.instances,
                model.max_batch_size,
                ", dynamic batching" if model.dynamic_batching else "",
                model.slots,
            )
            backend.known_slots = model.slots
            self._on_change(pool.name)

    async def _read(self, backend: BackendState) -> TritonModel:
        import tritonclient.http.aio as triton

        parts = urlsplit(backend.url)
        # Its CAs and client certificate, as its requests and probes go.
        tls = tls_context(backend.connection.tls) if parts.scheme == "https" else None
        client = triton.InferenceServerClient(
            parts.netloc, ssl=tls is not None, ssl_context=tls, conn_timeout=self._timeout_s
        )
        try:
            ready = await client.is_model_ready(backend.served_model)
            config = await client.get_model_config(backend.served_model) if ready else {}
        finally:
            await client.close()
        return TritonModel.from_config(ready, config)
