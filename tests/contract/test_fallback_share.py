"""The cut-off side of a partition: a replica that lost Redis serves from its fallback only on the
capacity Redis still counts for it (the slots it holds, at most its share), frees no lease while
cut off, stops when its fallback's time runs out, and on rejoining holds what its fallback still
uses. Redis is real and reachable; the failure is declared (FailoverQueue.redis_failed), as the
Redis store does on a failed command."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from redis.exceptions import RedisError

from gateway.queues.base import Flow, Granted, Queued, Slot, Unavailable
from gateway.queues.failover import FailoverQueue
from gateway.queues.memory.store import MemoryQueue
from gateway.settings import Estimation
from policies.outcomes import Outcome
from tests.contract.conftest import MODEL
from tests.contract.redis_cluster import SLOTS, Cluster, pool
from tests.eventually import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.redis]
FALLBACK_MAX_S = 30.0


class Replica:
    """One replica's FailoverQueue over the cluster's Redis, on a local clock the test moves."""

    def __init__(self, cluster: Cluster, name: str, probe_interval_s: float) -> None:
        self.now = 100.0
        model = pool()  # both stores count on the same backends, as configured_store builds them
        self.redis = cluster.replica(name, fallback_max_s=FALLBACK_MAX_S, model=model)
        self.redis._clock = self.redis._presence._clock = lambda: self.now
        self.local = MemoryQueue([model], 1, Estimation(), slot_divisor=2)
        self.store = FailoverQueue(
            self.redis,
            self.local,
            [model],
            mode="local",
            slot_divisor=2,
            probe_interval_s=probe_interval_s,
            clock=lambda: self.now,
        )

    async def offer(self) -> Granted | Queued | Unavailable:
        offer = await self.store.offer(Flow(MODEL, 0), 1.0, 60.0, 100.0, self.now)
        assert isinstance(offer, Granted | Queued | Unavailable), offer
        return offer

    async def take(self) -> Slot:
        offer = await self.offer()
        assert isinstance(offer, Granted), offer
        return offer.slot


@pytest.fixture
async def cut_off(cluster) -> AsyncIterator[Replica]:
    """A replica that will not find Redis back by itself (its probe waits long)."""
    replica = Replica(cluster, "a", probe_interval_s=3600.0)
    await replica.store.start()
    yield replica
    await replica.store.stop()


async def test_a_cut_off_replica_serves_from_its_fallback_only_on_the_slots_it_holds(cluster, cut_off):
    shared = await cut_off.take()  # 1 of its share of 2
    cut_off.store.redis_failed(RedisError("injected: the link to Redis is cut"))
    waiting = await cut_off.offer()
    assert isinstance(waiting, Queued) and not waiting.ticket.id, "queued in the fallback"
    await cut_off.store.release(shared, cut_off.now)
    granted = waiting.ticket.wakeup.result()
    assert isinstance(granted, Slot) and not granted.lease, "the fallback reuses the slot it held"
    assert isinstance(await cut_off.offer(), Queued), "and no more than that one"
    assert await cluster.slots_in_use() == 1, "its lease stays counted while it is cut off"


async def test_the_fallback_uses_no_more_than_the_share_redis_holds_for_it(cluster, cut_off):
    first, second = await cut_off.take(), await cut_off.take()  # its share of 2
    state = cut_off.redis._models[MODEL]
    backend = state.pool.backends[0]
    backend.max_concurrency = SLOTS // 2  # the limit lowered (auto concurrency, a circuit): a share of 1
    await cut_off.redis._keep_up(state)
    hold = json.loads(await cluster.client.hget(f"{cluster.tag}:hold", "a"))
    assert hold["s"] == {backend.url: 1}, "Redis holds one of its leases for its fallback"
    backend.max_concurrency = SLOTS  # raised again before the next beat
    cut_off.store.redis_failed(RedisError("injected: the link to Redis is cut"))
    await cut_off.store.release(first, cut_off.now)
    await cut_off.store.release(second, cut_off.now)
    assert isinstance(await cut_off.offer(), Granted)
    # A second would run on a lease the others take back at its bound, while this one serves on.
    assert isinstance(await cut_off.offer(), Queued)


async def test_a_ticket_past_its_leave_by_when_redis_is_lost_is_not_adopted_by_the_fallback(cluster, cut_off):
    # Its leave-by passed while its replica asked Redis whether it had granted it first
    # (RequestQueue.expire): the fallback must not serve it late.
    other = await cluster.start("b")
    for _ in range(SLOTS // 2):  # the other replica holds half the slots, this one its share
        assert isinstance(await other.offer(Flow(MODEL, 0), 1.0, 60.0, 100.0, cut_off.now), Granted)
        await cut_off.take()
    waiting = await cut_off.store.offer(Flow(MODEL, 0), 1.0, 5.0, 100.0, cut_off.now)  # 5 s to wait
    assert isinstance(waiting, Queued) and waiting.ticket.id, "queued in Redis"
    cut_off.now += 5.1  # well within the fallback's time
    cut_off.store.redis_failed(RedisError("injected: the link to Redis is cut"))
    assert waiting.ticket.wakeup.done(), "adopted by the fallback, to be served past its leave-by"
    assert waiting.ticket.wakeup.result() is Outcome.DEADLINE_EXPIRED_IN_QUEUE
    assert cut_off.local.stats(MODEL).queued_by_band == (0,)


async def test_a_replica_that_holds_nothing_serves_nothing_from_its_fallback(cluster, cut_off):
    cut_off.store.redis_failed(RedisError("injected: the link to Redis is cut"))
    refused = await cut_off.offer()
    assert isinstance(refused, Unavailable) and refused.retry_after_s > 0


async def test_the_fallback_stops_when_its_time_runs_out_and_refuses_its_waiters(cluster, cut_off):
    shared = await cut_off.take()
    cut_off.now += 1.0
    cut_off.store.redis_failed(RedisError("injected: the link to Redis is cut"))
    waiting = await cut_off.offer()
    assert isinstance(waiting, Queued)
    cut_off.now += FALLBACK_MAX_S  # past its last beat + fallback_max_s
    assert isinstance(await cut_off.offer(), Unavailable)
    assert waiting.ticket.wakeup.result() is Outcome.STORE_UNAVAILABLE
    await cut_off.store.release(shared, cut_off.now)
    assert cut_off.local.stats(MODEL).free_slots == 0, "nothing more starts from the fallback"


async def test_a_replica_that_rejoins_holds_what_its_fallback_still_uses_until_it_is_idle(cluster):
    replica = Replica(cluster, "a", probe_interval_s=0.01)
    await replica.store.start()
    try:
        shared = await replica.take()
        replica.store.redis_failed(RedisError("injected: the link to Redis went away"))
        waiting = await replica.offer()  # before the probe rejoins: the fallback's request
        await replica.store.release(shared, replica.now)
        local = waiting.ticket.wakeup.result() if isinstance(waiting, Queued) else waiting.slot
        assert isinstance(local, Slot) and not local.lease
        await eventually(lambda: replica.store.up, what="the probe to rejoin")
        assert await cluster.slots_in_use() == 1, "the fallback's slot is held as a lease"
        assert len(await cluster.leases("a")) == 1 and shared.lease not in await cluster.leases("a")
        await replica.store.release(local, replica.now)
        await eventually(lambda: cluster.slots_in_use_now() == 0, what="the reserved lease to be freed")
    finally:
        await replica.store.stop()


async def test_a_request_that_arrives_while_the_replica_rejoins_is_not_granted_by_its_fallback(cluster):
    """The rejoin holds, as leases, what the fallback used when it began: a request granted by the
    fallback during its round trips would run on capacity Redis then counts as free."""
    replica = Replica(cluster, "a", probe_interval_s=0.01)
    await replica.store.start()
    try:
        ran = await replica.take()
        replica.store.redis_failed(RedisError("injected: one command timed out"))
        await replica.store.release(ran, replica.now)  # ends while cut off: the fallback is idle
        arrivals: list[Granted | Queued | Unavailable] = []
        join = replica.redis._presence.join

        async def join_while_one_arrives(state, reserve):
            # It runs while the join's script is on its way to Redis, and meets the rejoin there.
            arrivals.append(asyncio.ensure_future(replica.offer()))  # type: ignore[arg-type]
            return await join(state, reserve)

        replica.redis._presence.join = join_while_one_arrives  # type: ignore[method-assign]
        await eventually(lambda: replica.store.up, what="the probe to rejoin")
        arrival = await arrivals[0]  # type: ignore[misc]
        assert isinstance(arrival, Granted) and arrival.slot.lease, "granted by Redis once it was back"
        assert await cluster.slots_in_use() == 1, "and counted there"
        await replica.store.release(arrival.slot, replica.now)
    finally:
        await replica.store.stop()
