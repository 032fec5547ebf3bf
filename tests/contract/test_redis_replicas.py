"""Two RedisQueue replicas in one process, hammered at once: the shared protocol never loses a
grant, never hands out more slots than there are, and leaves no slot counted when done; the returns
each promises refused clients count at the other."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import BlockingConnectionPool, Redis

from gateway.flow.controller import AdmissionController, Lease, Refusal
from gateway.flow.return_schedules import ReturnSchedules
from gateway.queues.base import Flow
from gateway.queues.redis.store import RedisQueue
from gateway.settings import Estimation, PriorityClass
from gateway.telemetry.metrics import GatewayMetrics
from policies.retry_after import RetryAfterConfig
from policies.wait import Throughput
from tests.contract.conftest import MODEL, make_pool
from tests.eventually import eventually
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


@contextlib.asynccontextmanager
async def one_slot_replicas(*names: str) -> AsyncIterator[tuple[list[RedisQueue], Redis, str]]:
    """Replicas of a one-slot model on one Redis under a prefix of their own, started: (the stores,
    a client of that Redis, the prefix). A store the test stops itself it takes off the list."""
    url = redis_url_or_skip()
    prefix = unique_prefix()
    admin = Redis.from_url(url)
    stores: list[RedisQueue] = []
    try:
        for name in names:  # one by one: those started are stopped if the next fails
            stores.append(await started_replica(Redis.from_url(url), url, prefix, name, slots=1))  # noqa: PERF401
        yield stores, admin, prefix
    finally:
        for store in stores:
            await store.stop()
        keys = [key async for key in admin.scan_iter(match=f"{{{prefix}:*")]
        if keys:
            await admin.delete(*keys)
        await admin.aclose()


async def test_the_returns_a_replica_promises_its_refused_clients_reach_the_other_replica():
    # One slot, held; the low class may wait 1 ms, so every low request is refused and told when
    # to come back. The 30 returns replica a promised reach replica b, and still count there
    # after a has left: its clients come back all the same.
    classes = [PriorityClass(name="high", max_wait_ms=20_000), PriorityClass(name="low", max_wait_ms=1)]
    async with one_slot_replicas("a", "b") as (stores, _, _):
        store_a, store_b = stores
        a = AdmissionController(store_a, classes, GatewayMetrics(CollectorRegistry()))
        held = await a.acquire(Flow(MODEL, 0), 1.0, None, never)
        assert isinstance(held, Lease)
        for _ in range(30):
            refusal = await a.acquire(Flow(MODEL, 1), 1.0, None, never)
            assert isinstance(refusal, Refusal) and refusal.retry_after_s is not None, refusal

        def seen_at_b() -> float:
            return sum(sum(p.booked) for p in store_b.shared_returns.elsewhere(MODEL, 1))

        await eventually(lambda: abs(seen_at_b() - 30) < 1e-6, what="a's 30 promises at b")
        await a.release(held, service_s=0.04)
        await store_a.stop()
        stores.remove(store_a)
        seen = store_b.shared_returns.elsewhere(MODEL, 1)
        await eventually(
            lambda: store_b.shared_returns.elsewhere(MODEL, 1) is not seen, what="another exchange"
        )
        assert abs(seen_at_b() - 30) < 1e-6  # a's, though a has left


async def test_a_replica_books_its_returns_after_those_the_other_replica_promised():
    # Both replicas see the same pool in overload (drain 25/s, returns booked at 5/s). Replica a
    # books 30 returns (6 s of room); replica b, once it has seen them, books its own after them,
    # where a single replica would have: the two never promise more than the queue can take.
    overload = Throughput(0.04, 25.0, admitted_rate_by_band=(25.0, 25.0), offered_rate_by_band=(75.0, 75.0))
    async with one_slot_replicas("a", "b") as (stores, _, _):
        a, b = (ReturnSchedules(2, RetryAfterConfig()).shared_as(MODEL, s.shared_returns) for s in stores)
        # No exchange can come between these bookings: b sees all 30 or none.
        told_a = [a.advise(0, 1.0, 0.0, overload, time.monotonic(), 0.5) for _ in range(30)]
        last_return_at = time.monotonic() + told_a[-1]
        await eventually(
            lambda: len(stores[1].shared_returns.elsewhere(MODEL, 0)) == 1, what="a's promises at b"
        )
        told_b = b.advise(0, 1.0, 0.0, overload, time.monotonic(), 0.5)
        # A slice (0.25 s) of slack: others' promises count in whole slices.
        assert told_a[-1] > 5 and time.monotonic() + told_b > last_return_at - 0.25, (told_a, told_b)


async def test_promised_returns_a_replica_cannot_read_are_left_out_and_the_upkeep_goes_on():
    async with one_slot_replicas("b") as ([store], admin, prefix):
        key = f"{{{prefix}:{MODEL}}}:returns"
        unreadable = {
            "old-version": "{not json",
            "other-shape": "[[1, 2]]",
            "text": '[null, [0, 1, 1, 0, 0, "x"]]',
        }
        await admin.hset(key, mapping=unreadable)
        good = [None, [0.0, 0.25, 1.0, 0.0, 0.0, 2.0]]
        await admin.hset(key, "a", json.dumps(good))
        await eventually(lambda: len(store.shared_returns.elsewhere(MODEL, 1)) == 1, what="a's promises read")
        assert store.shared_returns.elsewhere(MODEL, 0) == ()
        await admin.hset(key, "c", json.dumps(good))  # the exchanges go on
        await eventually(lambda: len(store.shared_returns.elsewhere(MODEL, 1)) == 2, what="c's promises read")
