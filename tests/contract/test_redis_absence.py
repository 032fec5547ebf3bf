"""Replicas that go absent from Redis, step by step on an injected Redis clock: a lease is renewed
by the work it covers, an absent replica's leases stay reserved until its work could have ended
(and up to its fallback's share of them until its fallback's time has run out too), it cannot beat,
take or free anything until it rejoins, and its rejoining replaces the reservation by its work."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from redis.asyncio import BlockingConnectionPool, Redis

from gateway.queues.base import Flow, Granted, Queued, Slot
from gateway.queues.redis import RedisQueue
from gateway.queues.redis_presence import ReplicaAbsent
from gateway.settings import Estimation
from gateway.upstream.backends import BackendState, ModelPool
from tests.contract.conftest import MODEL
from tests.redis_server import redis_url_or_skip, unique_prefix

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

# On the injected clock. The real upkeep loop beats every TTL / 3 of real time: never, in a test.
TTL_S = 600.0
UPSTREAM_TIMEOUT_S = 1_000.0
FALLBACK_MAX_S = 2_000.0
BOUND_S = UPSTREAM_TIMEOUT_S + TTL_S  # a lease's work ends within this of its grant
HOLD_S = FALLBACK_MAX_S + BOUND_S  # an absent replica's fallback work, within this of its last beat
SLOTS = 4
SHARE = 2  # of SLOTS, for each of 2 replicas


def pool() -> ModelPool:
    backend = BackendState(MODEL, "http://127.0.0.1:9000", SLOTS, "/v2/health/ready", ready=True)
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
        self, name: str, *, fallback_max_s: float = FALLBACK_MAX_S, model: ModelPool | None = None
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


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    made = Cluster(redis_url_or_skip())
    await made.seed()
    yield made
    await made.close()


async def take(store: RedisQueue) -> Slot:
    offer = await store.offer(Flow(MODEL, 0), 1.0, 5.0, 100.0, 0.0)
    assert isinstance(offer, Granted), offer
    return offer.slot


async def free_slots_seen_by(store: RedisQueue) -> int:
    await store._refresh(store._models[MODEL])
    return store.stats(MODEL).free_slots


async def test_a_lease_in_use_is_renewed_past_the_ttl_and_one_whose_release_was_lost_lapses(cluster):
    a = await cluster.start("a")
    used, lost = await take(a), await take(a)
    a._models[MODEL].let_go(lost)  # its request ended, and its release never reached Redis
    lost.released = True
    for _ in range(3):
        cluster.now += TTL_S / 2
        await cluster.beat(a)
        await cluster.reap(a)
    assert await cluster.leases("a") == {used.lease}
    assert await cluster.expiry(used.lease) == cluster.now + TTL_S
    assert await cluster.slots_in_use() == 1


async def test_an_absent_replicas_leases_stay_reserved_until_its_work_could_have_ended(cluster):
    a, b = await cluster.start("a"), await cluster.start("b")
    beat_at = cluster.now
    a_slots = [await take(a) for _ in range(SHARE + 1)]  # one more than its fallback's share
    assert await free_slots_seen_by(b) == SLOTS - SHARE - 1

    await cluster.advance_to(cluster.now + TTL_S + 1, beating=b)  # a's lapses (cut off, or dead)
    assert await cluster.leases("a") == {slot.lease for slot in a_slots}, "reaped at the TTL"
    assert await free_slots_seen_by(b) == SLOTS - SHARE - 1

    # The one beyond its share only until its request is surely over (upstream timeout + a TTL).
    await cluster.advance_to(beat_at + BOUND_S + 1, beating=b)
    assert await free_slots_seen_by(b) == SLOTS - SHARE
    # Its share for as long as its fallback may start work, and that work run.
    await cluster.advance_to(beat_at + HOLD_S - 1, beating=b)
    assert await free_slots_seen_by(b) == SLOTS - SHARE
    await cluster.advance_to(beat_at + HOLD_S + 1, beating=b)
    assert await free_slots_seen_by(b) == SLOTS
    assert await cluster.leases("a") == set()
    assert isinstance(await b.offer(Flow(MODEL, 0), 1.0, 5.0, 100.0, 0.0), Granted)


async def test_without_a_fallback_an_absent_replicas_leases_are_held_until_their_bounds_only(cluster):
    a, b = await cluster.start("a", fallback_max_s=0.0), await cluster.start("b")
    granted_at = cluster.now
    await take(a)
    await cluster.advance_to(cluster.now + TTL_S + 1, beating=b)
    assert await free_slots_seen_by(b) == SLOTS - 1
    await cluster.advance_to(granted_at + BOUND_S + 1, beating=b)
    assert await free_slots_seen_by(b) == SLOTS


async def test_an_absent_replica_can_neither_beat_nor_take_nor_free_until_it_rejoins(cluster):
    a, b = await cluster.start("a"), await cluster.start("b")
    kept, ended = await take(a), await take(a)
    await cluster.advance_to(cluster.now + TTL_S + 1, beating=b)

    with pytest.raises(ReplicaAbsent):
        await cluster.beat(a)
    with pytest.raises(ReplicaAbsent):
        await a.offer(Flow(MODEL, 0), 1.0, 5.0, 100.0, 0.0)
    await a.release(ended, 0.0)  # a late release: its fallback may be reusing the slot
    assert await cluster.leases("a") == {kept.lease, ended.lease}

    await a.rejoin({})  # its work replaces the reservation: the lease it still uses, nothing more
    assert await cluster.leases("a") == {kept.lease}
    assert await cluster.expiry(kept.lease) == cluster.now + TTL_S
    assert await free_slots_seen_by(b) == SLOTS - 1
    await cluster.beat(a)  # live again
    assert isinstance(await a.offer(Flow(MODEL, 0), 1.0, 5.0, 100.0, 0.0), Granted)


async def test_grants_an_absent_replica_never_took_are_freed_when_it_is_reaped(cluster):
    b = await cluster.start("b")
    a = cluster.replica("a")  # joined, but its grant listener never runs
    await a._presence.join(a._models[MODEL], {})
    held = [await take(b) for _ in range(SLOTS)]
    queued = await a.offer(Flow(MODEL, 0), 1.0, 5.0, 100.0, 0.0)
    assert isinstance(queued, Queued)
    await b.release(held[0], 0.0)  # granted to a's ticket, onto a's list
    assert await cluster.client.llen(f"{cluster.tag}:grants:a") == 1
    await cluster.advance_to(cluster.now + TTL_S + 1, beating=b)
    assert await cluster.leases("a") == set()
    assert await free_slots_seen_by(b) == 1


async def test_a_replica_that_leaves_holds_no_fallback_share(cluster):
    a, b = await cluster.start("a"), await cluster.start("b")
    granted_at = cluster.now
    await take(a)  # cut short by the shutdown: its request may still run to its bound
    await cluster.stop(a)
    assert await free_slots_seen_by(b) == SLOTS - 1
    await cluster.advance_to(granted_at + BOUND_S + 1, beating=b)  # long before a fallback's time
    assert await free_slots_seen_by(b) == SLOTS


async def test_a_new_state_presumes_the_fallback_share_of_replicas_it_does_not_know(cluster):
    await cluster.client.delete(f"{cluster.tag}:stats")  # as after Redis lost what it held
    a = await cluster.start("a")
    joined_at = cluster.now
    assert await free_slots_seen_by(a) == SLOTS - SHARE  # the other expected replica's share
    await cluster.advance_to(joined_at + FALLBACK_MAX_S + BOUND_S + 1, beating=a)
    assert await free_slots_seen_by(a) == SLOTS
    b = await cluster.start("b")
    cluster.now = joined_at
    assert await free_slots_seen_by(b) == SLOTS, "both expected replicas are live"
