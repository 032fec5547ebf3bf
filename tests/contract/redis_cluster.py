"""Replicas of one model on one Redis key prefix, on one injected Redis clock: the rig of the
contract tests on replicas going absent (test_redis_absence, test_fallback_share)."""

from __future__ import annotations

from typing import Any

import redis
from redis.asyncio import BlockingConnectionPool, Redis

from gateway.queues.redis.peers import BeaconAt
from gateway.queues.redis.store import RedisQueue
from gateway.settings import Estimation
from gateway.upstream.backends import BackendState, ModelPool
from gateway.upstream.origin import OnAbandon
from tests.contract.conftest import MODEL
from tests.redis_server import unique_prefix

# On the injected clock. The real upkeep loop beats every TTL / 3 of real time: never, in a test.
TTL_S = 600.0
UPSTREAM_TIMEOUT_S = 1_000.0
FALLBACK_MAX_S = 2_000.0
BOUND_S = UPSTREAM_TIMEOUT_S + TTL_S  # a lease's work ends within this of its grant
HOLD_S = FALLBACK_MAX_S + BOUND_S  # an absent replica's fallback work, within this of its last beat
SLOTS = 4
SHARE = 2  # of SLOTS, for each of 2 replicas


def pool(on_abandon: OnAbandon = OnAbandon.DRAIN) -> ModelPool:
    backend = BackendState(
        MODEL, "http://127.0.0.1:9000", SLOTS, "/v2/health/ready", ready=True, on_abandon=on_abandon
    )
    return ModelPool(MODEL, [backend], expected_service_s=0.04, upstream_timeout_s=UPSTREAM_TIMEOUT_S)


class Cluster:
    """Replicas of one model on one key prefix, on one injected Redis clock."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = Redis(connection_pool=BlockingConnectionPool.from_url(url, max_connections=32))
        self.prefix = unique_prefix()
        self.tag = f"{{{self.prefix}:{MODEL}}}"
        self.now = 1_000_000.0
        self.listeners: list[Redis] = []
        self.running: list[RedisQueue] = []

    async def seed(self) -> None:
        """A state that has run a while: no window of presumed fallback work after a new one."""
        await self.client.hset(f"{self.tag}:stats", "epoch", "1")

    def replica(
        self,
        name: str,
        *,
        fallback_max_s: float = FALLBACK_MAX_S,
        model: ModelPool | None = None,
        beacon_at: BeaconAt | None = None,
    ) -> RedisQueue:
        listener = Redis.from_url(self.url)
        store = RedisQueue(
            self.client,
            listener,
            [model or pool()],
            1,
            Estimation(),
            key_prefix=self.prefix,
            replica_id=name,
            lease_ttl_s=TTL_S,
            redis_clock=lambda: self.now,
            expected_replicas=2,
            fallback_max_s=fallback_max_s,
            beacon_at=beacon_at,
        )
        self.listeners.append(listener)
        return store

    async def start(self, name: str, **options: Any) -> RedisQueue:
        store = self.replica(name, **options)
        await store.start()
        self.running.append(store)
        return store

    async def stop(self, store: RedisQueue) -> None:
        self.running.remove(store)
        await store.stop()

    async def slots_in_use(self) -> int:
        return sum(int(v) for v in await self.client.hvals(f"{self.tag}:slots"))

    def slots_in_use_now(self) -> int:
        """`slots_in_use` for a synchronous check (tests.eventually)."""
        with redis.Redis.from_url(self.url) as client:
            return sum(int(v) for v in client.hvals(f"{self.tag}:slots"))

    async def leases(self, replica: str) -> set[str]:
        return {lease.decode() for lease in await self.client.smembers(f"{self.tag}:held:{replica}")}

    async def expiry(self, lease: str) -> float | None:
        return await self.client.zscore(f"{self.tag}:leases", lease)

    async def reap(self, by: RedisQueue) -> None:
        await by._presence.reap(by._models[MODEL])

    async def beat(self, store: RedisQueue) -> None:
        await store._beat(store._models[MODEL])

    async def advance_to(self, moment: float, *, beating: RedisQueue) -> None:
        """Move the clock to `moment` in steps of half a TTL, `beating` beating and reaping at each."""
        while self.now < moment:
            self.now = min(moment, self.now + TTL_S / 2)
            await self.beat(beating)
            await self.reap(beating)

    async def close(self) -> None:
        for store in self.running:
            store._presence.detached = True  # no need to leave: the keys are deleted below
            await store.stop()
        for listener in self.listeners:
            await listener.aclose()
        keys = [key async for key in self.client.scan_iter(match=f"{{{self.prefix}:*")]
        if keys:
            await self.client.delete(*keys)
        await self.client.aclose(close_connection_pool=True)
