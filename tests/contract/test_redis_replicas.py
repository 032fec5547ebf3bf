"""Two RedisQueue replicas in one process, hammered at once: the shared protocol never loses a
grant, never hands out more slots than there are, and leaves no slot counted when done."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import BlockingConnectionPool, Redis

from gateway.flow.controller import AdmissionController, Lease
from gateway.queues.base import Flow
from gateway.queues.redis import RedisQueue
from gateway.settings import Estimation, PriorityClass
from gateway.telemetry.metrics import GatewayMetrics
from tests.contract.conftest import MODEL, make_pool
from tests.redis_server import redis_url_or_skip, unique_prefix

pytestmark = [pytest.mark.anyio, pytest.mark.redis]
CLASSES = [PriorityClass(name="high", max_wait_ms=20_000), PriorityClass(name="low", max_wait_ms=20_000)]


async def never() -> None:
    await asyncio.Event().wait()


async def started_replica(client: Redis, url: str, prefix: str, name: str, slots: int) -> RedisQueue:
    """A replica of one model of `slots` on the Redis at `url`, under `prefix`, started."""
    store = RedisQueue(
        client,
        Redis.from_url(url),
        [make_pool((slots,))],
        2,
        Estimation(),
        key_prefix=prefix,
        replica_id=name,
        lease_ttl_s=5.0,
        close_clients=True,
    )
    await store.start()
    return store


async def test_two_replicas_under_contention_keep_the_count():
    url = redis_url_or_skip()
    prefix = unique_prefix()
    admin = Redis.from_url(url)
    replicas: list[tuple[RedisQueue, AdmissionController]] = []
    for name in ("a", "b"):
        client = Redis(connection_pool=BlockingConnectionPool.from_url(url, max_connections=32, timeout=5))
        store = await started_replica(client, url, prefix, name, slots=3)
        controller = AdmissionController(store, CLASSES, GatewayMetrics(CollectorRegistry()))
        replicas.append((store, controller))

    rng = random.Random(3)
    in_use, peak, done = 0, 0, 0

    async def request(index: int) -> None:
        nonlocal in_use, peak, done
        _, controller = replicas[index % 2]
        lease = await controller.acquire(Flow(MODEL, index % 2), 1.0, None, never)
        assert isinstance(lease, Lease), lease
        in_use += 1
        peak = max(peak, in_use)
        await asyncio.sleep(rng.uniform(0, 0.01))  # the request's service: it holds the slot a while
        in_use -= 1
        if index % 3:
            await controller.release(lease, service_s=0.005)
        else:
            controller.release_soon(lease.slot, service_s=0.005)
        done += 1

    try:
        await asyncio.wait_for(asyncio.gather(*(request(i) for i in range(300))), timeout=60)
        assert done == 300
        assert peak <= 3
        for store, _ in replicas:
            await store.settle()
        slots = await admin.hvals(f"{{{prefix}:{MODEL}}}:slots")
        assert sum(int(v) for v in slots) == 0
    finally:
        for store, _ in replicas:
            await store.stop()
        keys = [key async for key in admin.scan_iter(match=f"{{{prefix}:*")]
        if keys:
            await admin.delete(*keys)
        await admin.aclose()
