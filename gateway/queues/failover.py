"""FailoverQueue: the shared Redis store while Redis answers, and a configured fallback when not.

`on_store_failure: local` keeps serving from in-memory queues with this replica's share of each
backend's slots (max_concurrency / replicas), so that replicas cut off from Redis together still
stay within the backends' limits; `reject` answers 503 + Retry-After instead. Either way the switch
is logged once and exported as `gateway_store_up 0`.

When Redis answers again: the replica rejoins (its stale tickets and unused leases are dropped),
new requests go to Redis, and while the fallback still has work in flight this replica holds its
share of the shared slots as leases, so that the two stores together never hand out more slots
than a backend has. Requests waiting in Redis when it fails move to the fallback queue (or get
503 under `reject`); requests in flight finish either way, and a lease whose release cannot reach
Redis expires with its TTL, so no slot stays counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Literal

from anyio.abc import TaskStatus
from redis.exceptions import RedisError

from gateway.queues.base import Batching, Flow, Offer, Slot, Ticket, Unavailable
from gateway.queues.memory import MemoryQueue
from gateway.queues.redis import RedisQueue
from gateway.supervision import Loop, Supervisor
from gateway.upstream.backends import ModelPool
from policies.outcomes import Outcome
from policies.wait import QueueStats, Throughput

log = logging.getLogger("gateway.store")


class FailoverQueue:
    def __init__(
        self,
        redis: RedisQueue,
        local: MemoryQueue,
        pools: Iterable[ModelPool],
        *,
        mode: Literal["local", "reject"],
        slot_divisor: int,
        probe_interval_s: float = 0.5,
        on_state: Callable[[bool], None] = lambda up: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis
        self._local = local
        self._pools = list(pools)
        self._mode = mode
        self._divisor = slot_divisor
        self._probe_interval_s = probe_interval_s
        self._on_state = on_state
        self._clock = clock
        self.up = False
        self._stopping = False
        self._probe: Loop | None = None
        self._reservations: Loop | None = None

    @property
    def supervisor(self) -> Supervisor:
        """The Redis store's: the probe and the reservations run beside its loops."""
        return self._redis.supervisor

    def redis_failed(self, error: BaseException) -> None:
        """Called by the Redis store (and by this class) whenever a Redis command fails."""
        if not self.up:
            return
        self.up = False
        self._on_state(False)
        log.error("Redis unreachable (%r): %s", error, self._fallback_words())
        if self._mode == "local":
            # What this replica still runs on shared slots counts against its local share first:
            # cut off from the others, it can only keep its own part of each backend.
            for slot in self._redis.in_flight():
                if not slot.charged:
                    slot.charged = True
                    self._local.charge(slot)
        now = self._clock()
        for ticket in self._redis.abandon():
            if self._mode == "local":
                self._local.adopt(ticket, now)
            else:
                ticket.interrupt(Outcome.STORE_UNAVAILABLE)
        self._start_probe()

    async def start(self) -> None:
        await self.supervisor.open()  # a failure below starts the probe
        try:
            await self._redis.start()
        except RedisError as error:
            self.up = True  # so that the failure below is reported once, like any other
            self.redis_failed(error)
            return
        self.up = True
        self._on_state(True)

    async def stop(self) -> None:
        self._stopping = True  # a failure from here on starts no probe
        for loop in (self._probe, self._reservations):
            if loop is not None:
                loop.cancel()
                await loop.wait()
        await self._redis.stop()

    # -- the RequestQueue protocol ---------------------------------------------------------------

    def stats(self, model: str) -> QueueStats:
        return self._redis.stats(model) if self.up else self._local.stats(model)

    def throughput(self, model: str, now: float) -> Throughput:
        return self._redis.throughput(model, now) if self.up else self._local.throughput(model, now)

    def record_service(self, model: str, service_s: float) -> None:
        self._redis.record_service(model, service_s)
        self._local.record_service(model, service_s)

    async def offer(
        self,
        flow: Flow,
        cost: float,
        allowed_wait_s: float,
        max_work: float,
        now: float,
        batching: Batching | None = None,
    ) -> Offer:
        if self.up:
            try:
                return await self._redis.offer(flow, cost, allowed_wait_s, max_work, now, batching)
            except RedisError as error:
                self.redis_failed(error)
        if self._mode == "reject":
            return Unavailable(retry_after_s=self._probe_interval_s)
        return await self._local.offer(flow, cost, allowed_wait_s, max_work, now, batching)

    async def withdraw(self, ticket: Ticket, outcome: Outcome) -> None:
        if not ticket.id:
            await self._local.withdraw(ticket, outcome)
            return
        try:
            await self._redis.withdraw(ticket, outcome)
        except RedisError as error:
            ticket.interrupt(outcome)
            self.redis_failed(error)

    async def release(self, slot: Slot, now: float) -> None:
        if not slot.lease:
            await self._local.release(slot, now)
            return
        self._discharge(slot)
        try:
            await self._redis.release(slot, now)
        except RedisError as error:  # the lease expires with its TTL
            self.redis_failed(error)

    def release_soon(self, slot: Slot, now: float) -> bool:
        if not slot.lease:
            return self._local.release_soon(slot, now)
        self._discharge(slot)
        return self._redis.release_soon(slot, now)

    def _discharge(self, slot: Slot) -> None:
        if slot.charged and not slot.released:
            slot.charged = False
            self._local.discharge(slot)

    def backends_changed(self, model: str) -> None:
        self._local.backends_changed(model)
        if self.up:
            self._redis.backends_changed(model)

    # -- recovery --------------------------------------------------------------------------------

    def _fallback_words(self) -> str:
        if self._mode == "reject":
            return "answering 503 until it is back"
        return f"serving from local queues with 1/{self._divisor} of each backend's slots"

    def _start_probe(self) -> None:
        if not self._stopping and (self._probe is None or self._probe.finished):
            self._probe = self.supervisor.start_soon("redis_probe", self._rejoin_when_back)

    async def _rejoin_when_back(self, *, task_status: TaskStatus[None]) -> None:
        task_status.started()
        while True:
            await asyncio.sleep(self._probe_interval_s)
            try:
                share = {pool.name: self._local_share_in_use(pool) for pool in self._pools}
                reserved = await self._redis.rejoin(share)
            except RedisError:
                continue
            break
        self.up = True
        self._on_state(True)
        log.warning("Redis is back: new requests use the shared queue again")
        if any(reserved.values()) and not self._stopping:
            self._reservations = self.supervisor.start_soon(
                "redis_share", functools.partial(self._return_share, reserved)
            )

    def _local_share_in_use(self, pool: ModelPool) -> dict[str, int]:
        """The fallback's share of each backend, while it still has work: that much stays reserved."""
        if self._local.is_idle(pool.name):
            return {}
        return {b.url: max(1, b.max_concurrency // self._divisor) for b in pool.backends}

    async def _return_share(self, reserved: dict[str, list[str]], *, task_status: TaskStatus[None]) -> None:
        """Hold the reserved leases until the fallback's last request is done, then free them."""
        task_status.started()
        for model in list(reserved):
            await self._local.wait_idle(model)
            with contextlib.suppress(RedisError):  # unreleased leases expire with their TTL
                await self._redis.release_leases(model, reserved[model])
            del reserved[model]  # a restart after a crash goes on with the models left
