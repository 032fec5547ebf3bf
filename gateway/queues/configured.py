"""The store the config names: in memory, or Redis with its fallback."""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypedDict

from gateway.queues.base import RequestQueue, Reservations, weight_lookup
from gateway.queues.memory.store import MemoryQueue
from gateway.settings import Settings
from gateway.telemetry.metrics import GatewayMetrics
from gateway.upstream.backends import ModelPool
from policies.ordering import Ordering
from policies.quotas import Quota

if TYPE_CHECKING:
    from gateway.queues.redis.peers import BeaconAt


def replica_name() -> str:
    """Unique per process: host, pid and a random tag (a restarted pod must not reuse leases)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class StorePolicy(TypedDict):
    """What every store orders and grants by, whichever store it is."""

    ordering: Ordering
    weights: Callable[[str], float]
    tenants: bool
    """Requests may come in several tenants' flows (without tenants a turn is the whole band)."""
    reserved: Reservations
    quotas: dict[str, Quota]


def configured_store(
    settings: Settings,
    pools: Sequence[ModelPool],
    metrics: GatewayMetrics,
    *,
    clock: Callable[[], float] = time.monotonic,
    weight_of: Callable[[str], float] | None = None,
    reserved_of: Callable[[], tuple[int, ...]] | None = None,
) -> RequestQueue:
    """The store the settings name; `weight_of` gives a tenant's weight at enqueue (its configured
    weight when not given), `reserved_of` the classes' reservations now (their configured ones)."""
    bands = len(settings.priorities)
    weights = weight_of if weight_of is not None else weight_lookup(settings.tenant_weights())
    policy = StorePolicy(
        ordering=settings.ordering,
        weights=weights,
        tenants=bool(settings.tenants),
        reserved=reserved_of if reserved_of is not None else settings.reserved_slots(),
        quotas=settings.quotas(),
    )
    config = settings.store
    if config.kind == "memory":
        metrics.store_up.set(1)
        return MemoryQueue(pools, bands, settings.estimation, **policy)

    # Imported here: redis-py takes 80 ms to import, which a gateway on the memory store never needs.
    from gateway.queues.failover import FailoverQueue
    from gateway.queues.redis.clients import redis_clients
    from gateway.queues.redis.scripts import ScriptRunning
    from gateway.queues.redis.store import LISTEN_WAKE_S, RedisQueue
    from gateway.telemetry.store_calls import StoreCalls

    commands, listener = redis_clients(config, LISTEN_WAKE_S)
    calls = StoreCalls()
    metrics.registry.register(calls)
    failover: FailoverQueue | None = None

    def failed(error: BaseException) -> None:
        if failover is not None:
            failover.redis_failed(error)

    shared = RedisQueue(
        commands,
        listener,
        pools,
        bands,
        settings.estimation,
        key_prefix=config.key_prefix,
        replica_id=replica_name(),
        lease_ttl_s=config.lease_ttl_ms / 1000,
        clock=clock,
        on_failure=failed,
        close_clients=True,
        expected_replicas=config.replicas,
        fallback_max_s=config.fallback_max_ms / 1000 if config.on_store_failure == "local" else 0.0,
        beacon_at=beacon_at(settings),
        running=ScriptRunning(config.pool_size if config.cluster else None, calls),
        **policy,
    )
    local = MemoryQueue(pools, bands, settings.estimation, slot_divisor=config.replicas, **policy)
    failover = FailoverQueue(
        shared,
        local,
        pools,
        mode=config.on_store_failure,
        slot_divisor=config.replicas,
        on_state=lambda up: metrics.store_up.set(1 if up else 0),
        clock=clock,
    )
    return failover


def beacon_at(settings: Settings) -> BeaconAt | None:
    """Where the replica's beacon listens: on the client listener's interface, a port of its own."""
    from gateway.queues.redis.peers import BeaconAt

    port = settings.store.peer_port
    if port is None:
        return None
    return BeaconAt(settings.listen.host, port, settings.store.peer_address)
