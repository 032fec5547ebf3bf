"""The Redis store's loops under supervision: a crash of its heartbeat or a grant listener stops new
slots until the loop is back; then leases are renewed and grants delivered again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest
from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.queues.base import Flow, Granted, Queued, Slot, Unavailable
from gateway.queues.failover import FailoverQueue
from gateway.queues.memory.store import MemoryQueue
from gateway.queues.redis.store import RedisQueue
from gateway.settings import Estimation
from gateway.supervision import Backoff, Supervisor
from tests.contract.conftest import MODEL, make_pool
from tests.eventually import eventually
from tests.faults import HeldDown, fail_once
from tests.redis_server import free_port, redis_url_or_skip, unique_prefix

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

TTL_S = 0.9  # a beat every 0.3 s


class Replicas:
    """RedisQueues on one key prefix (one per replica id), stopped and cleaned up at the end."""

    def __init__(self, url: str) -> None:
        self.pool = BlockingConnectionPool.from_url(url, max_connections=32, timeout=5)
        self.client = Redis(connection_pool=self.pool)
        self.listeners: list[Redis] = []
        self.url = url
        self.prefix = unique_prefix()
        self.started: list[RedisQueue] = []

    def make(self, replica: str, supervisor: Supervisor, slots: int = 1) -> RedisQueue:
        listener = Redis.from_url(self.url)
        self.listeners.append(listener)
        return RedisQueue(
            self.client,
            listener,
            [make_pool((slots,))],
            1,
            Estimation(),
            key_prefix=self.prefix,
            replica_id=replica,
            lease_ttl_s=TTL_S,
            supervisor=supervisor,
        )

    async def start(self, replica: str, supervisor: Supervisor, slots: int = 1) -> RedisQueue:
        store = self.make(replica, supervisor, slots)
        await store.start()
        self.started.append(store)
        return store

    async def close(self) -> None:
        for store in self.started:
            await store.stop()
        keys = [key async for key in self.client.scan_iter(match=f"{{{self.prefix}:*")]
        if keys:
            await self.client.delete(*keys)
        await self.client.aclose()
        await self.pool.aclose()
        for listener in self.listeners:
            await listener.aclose()


@pytest.fixture
async def replicas() -> AsyncIterator[Replicas]:
    made = Replicas(redis_url_or_skip())
    yield made
    await made.close()


async def offer(store: Any) -> Any:
    return await store.offer(Flow(MODEL, 0), 1.0, 5.0, 100, 0.0)


def lease_expiry(replicas: Replicas, lease: str) -> Awaitable[float | None]:
    return replicas.client.zscore(f"{{{replicas.prefix}:{MODEL}}}:leases", lease)


async def test_a_crashed_heartbeat_takes_no_new_slot_until_it_is_back_and_then_renews_leases(
    replicas, monkeypatch
):
    held = HeldDown()
    store = await replicas.start("r1", Supervisor(sleep=held.sleep), slots=2)
    granted = await offer(store)
    assert isinstance(granted, Granted)
    lease = granted.slot.lease
    real_beat = store._beat
    beats: list[int] = []
    first_beat_back = asyncio.Event()

    async def beat(state: Any) -> None:
        beats.append(1)
        if len(beats) == 1:
            raise RuntimeError("injected failure in _beat")
        if len(beats) == 2:
            await first_beat_back.wait()
        await real_beat(state)

    monkeypatch.setattr(store, "_beat", beat)
    await eventually(lambda: held.waiting == 1, what="the heartbeat to crash")
    refused = await offer(store)
    assert isinstance(refused, Unavailable) and refused.retry_after_s > 0
    assert store.supervisor.required_down() == ["redis_upkeep"]

    before = await lease_expiry(replicas, lease)
    held.release()
    await eventually(lambda: len(beats) == 2, what="the restarted loop's first beat")
    # Restarted but not yet beaten: still no new slot, since the leases are not renewed yet.
    assert isinstance(await offer(store), Unavailable)
    first_beat_back.set()
    await eventually(lambda: store.supervisor.required_down() == [], what="the heartbeat back")
    assert (await lease_expiry(replicas, lease) or 0) > (before or 0)
    assert isinstance(await offer(store), Granted)
    # Well past the TTL the lease is still there: the restarted loop keeps beating.
    deadline = time.monotonic() + 2 * TTL_S
    while time.monotonic() < deadline:
        assert await lease_expiry(replicas, lease) is not None, "the lease was reaped"
        await asyncio.sleep(0.1)
    await store.release(granted.slot, 0.0)


async def test_a_crashed_grant_listener_takes_no_new_slot_until_it_is_back_and_then_delivers(
    replicas, monkeypatch
):
    held = HeldDown()
    waiter = await replicas.start("r1", Supervisor(sleep=held.sleep))
    holder = await replicas.start("r2", Supervisor())
    taken = await offer(holder)
    assert isinstance(taken, Granted)
    queued = await offer(waiter)
    assert isinstance(queued, Queued)

    fail_once(waiter._listener, "blmpop", monkeypatch)
    await eventually(lambda: held.waiting == 1, what="the listener to crash")
    assert isinstance(await offer(waiter), Unavailable)
    assert waiter.supervisor.required_down() == ["redis_grants"]

    # Released by the other replica: the grant is pushed to r1's list, for r1's listener to deliver.
    await holder.release(taken.slot, 0.0)
    await holder.settle()
    held.release()
    slot = await asyncio.wait_for(queued.ticket.wakeup, 5)
    assert isinstance(slot, Slot)
    await waiter.release(slot, 0.0)
    assert waiter.supervisor.required_down() == []


async def test_a_grant_whose_blmpop_reply_was_lost_is_delivered_and_kept(replicas, monkeypatch):
    waiter = replicas.make("r1", Supervisor(backoff=Backoff(first_s=0.01)))
    real_blmpop, lost = waiter._listener.blmpop, []
    fail_next = asyncio.Event()

    async def blmpop(*args: Any, **kwargs: Any) -> Any:
        if fail_next.is_set():  # a failure that pops nothing: what is held must not come again
            fail_next.clear()
            raise RedisConnectionError("injected: the connection broke")
        popped = await real_blmpop(*args, **kwargs)
        if popped and not lost:
            lost.append(popped)
            raise RedisConnectionError("injected: the connection broke with the reply on the way")
        return popped

    real_run, recoveries = waiter._run, []

    async def run(script: str, state: Any, args: dict[str, Any]) -> Any:
        recoveries.extend([script] if script == "recover" else [])
        return await real_run(script, state, args)

    monkeypatch.setattr(waiter._listener, "blmpop", blmpop)
    monkeypatch.setattr(waiter, "_run", run)  # before the loops start: they hold what they run
    await waiter.start()
    replicas.started.append(waiter)
    holder = await replicas.start("r2", Supervisor())
    taken = await offer(holder)
    assert isinstance(taken, Granted)
    queued = await offer(waiter)  # it may wait 5 s: far longer than a lease lapses unrenewed (TTL_S)
    assert isinstance(queued, Queued)
    await holder.release(taken.slot, 0.0)  # r1's ticket is granted, through its list
    slot = await asyncio.wait_for(queued.ticket.wakeup, 2)
    assert isinstance(slot, Slot) and lost, "delivered after the pop that lost it"
    state = waiter._models[MODEL]
    # Held, it is renewed like any lease in use: still counted well past its TTL, so nobody else
    # gets the slot while this request runs on it.
    fail_next.set()
    await eventually(lambda: len(recoveries) == 2, what="a second recovery, with the grant held")
    recovered_until, recovered_at = await lease_expiry(replicas, slot.lease), time.monotonic()
    assert recovered_until is not None
    # Beats answered for longer than a TTL: a lease they did not renew would have lapsed by then.
    await eventually(lambda: (state.beat_sent_at or 0.0) > recovered_at + TTL_S, what="a TTL of beats")
    renewed_until = await lease_expiry(replicas, slot.lease)
    assert renewed_until is not None and renewed_until > recovered_until, "the lease lapsed"
    assert isinstance(await offer(holder), Unavailable | Queued), "the slot was handed out twice"
    assert list(state.held) == [slot.lease] and slot.backend.inflight == 1, "delivered twice"
    await waiter.release(slot, 0.0)


async def test_a_lease_whose_release_failed_is_not_taken_for_a_lost_grant(replicas, monkeypatch):
    waiter = replicas.make("r1", Supervisor(backoff=Backoff(first_s=0.01)))
    real_blmpop, fail_next = waiter._listener.blmpop, asyncio.Event()

    async def blmpop(*args: Any, **kwargs: Any) -> Any:
        if fail_next.is_set():
            fail_next.clear()
            raise RedisConnectionError("injected: the connection broke")
        return await real_blmpop(*args, **kwargs)

    real_run, recoveries, releases = waiter._run, [], []

    async def run(script: str, state: Any, args: dict[str, Any]) -> Any:
        recoveries.extend([script] if script == "recover" else [])
        if script == "release" and not releases:
            releases.append(args["lease"])
            raise RedisConnectionError("injected: the release's connection broke")
        return await real_run(script, state, args)

    monkeypatch.setattr(waiter._listener, "blmpop", blmpop)
    monkeypatch.setattr(waiter, "_run", run)
    await waiter.start()
    replicas.started.append(waiter)
    holder = await replicas.start("r2", Supervisor())
    taken = await offer(holder)
    queued = await offer(waiter)
    assert isinstance(taken, Granted) and isinstance(queued, Queued)
    await holder.release(taken.slot, 0.0)  # r1's grant comes through its list
    slot = await asyncio.wait_for(queued.ticket.wakeup, 2)
    with pytest.raises(RedisError):
        await waiter.release(slot, 0.0)  # the request is done; Redis never hears of it
    fail_next.set()
    await eventually(lambda: len(recoveries) == 1, what="a recovery after the failed release")
    state = waiter._models[MODEL]
    assert state.held == {} and slot.backend.inflight == 0, "the released lease was held again"
    assert releases == [slot.lease]


async def test_the_failover_probe_restarts_after_a_crash_and_rejoins(replicas, monkeypatch):
    supervisor = Supervisor(backoff=Backoff(first_s=0.01))
    shared = replicas.make("r1", supervisor)
    local = MemoryQueue([make_pool((1,))], 1, Estimation())
    failover = FailoverQueue(
        shared, local, [make_pool((1,))], mode="local", slot_divisor=1, probe_interval_s=0.01
    )
    await failover.start()
    replicas.started.append(shared)
    assert failover.up
    calls = fail_once(shared, "rejoin", monkeypatch)
    failover.redis_failed(RedisError("injected: Redis went away"))
    assert not failover.up
    await eventually(lambda: failover.up, what="the probe to rejoin")
    assert len(calls) == 2 and supervisor.restarts()["redis_probe"] == 1
    await failover.stop()
    replicas.started.remove(shared)


async def test_the_loops_start_even_when_redis_fails_at_start(replicas):
    dead = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
    store = RedisQueue(
        dead,
        dead,
        [make_pool((1,))],
        1,
        Estimation(),
        key_prefix=unique_prefix(),
        replica_id="r1",
        lease_ttl_s=TTL_S,
    )
    try:
        with pytest.raises(RedisError):
            await store.start()
        # They keep trying, so that once the replica rejoins its leases are renewed.
        assert store.supervisor.loops_up() == {"redis_grants": True, "redis_upkeep": True}
    finally:
        await store.stop()
        await dead.aclose()
