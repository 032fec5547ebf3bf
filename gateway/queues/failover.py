"""FailoverQueue: the shared Redis store while Redis answers, and a configured fallback when not.

`on_store_failure: local` keeps serving from in-memory queues on the capacity of the leases this
replica still holds for requests when it notices that Redis is gone: per backend, at most as many
requests at once as it holds leases there, and never more than its share (max_concurrency /
replicas). Redis keeps those leases counted (the replica frees none while cut off, and the others
reserve an absent replica's leases), so the replicas together never exceed a backend's slots,
whether one replica is cut off or all of them are. It serves so for at most `fallback_max_s` after
its last heartbeat, then answers 503 until Redis is back: the others hold its leases that long,
and as long again as a request may run, and then take them back. A replica that holds nothing
(one that never reached Redis) serves nothing. `reject` answers 503 + Retry-After at once. Either
way the switch is logged once and exported as `gateway_store_up 0`.

When Redis answers again: the replica rejoins (its stale tickets and unused leases are dropped,
the leases it still uses renewed), new requests go to Redis, and while the fallback still has work
this replica holds what the fallback may use as leases, so that the two stores together never hand
out more slots than a backend has. Requests waiting in Redis when it fails move to the fallback
queue (or get 503); requests in flight finish either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from anyio.abc import TaskStatus
from redis.exceptions import RedisError

from gateway.queues.base import STORE_PROBE_INTERVAL_S, Batching, Flow, Offer, Slot, Ticket, Unavailable
from gateway.queues.memory.store import MemoryQueue
from gateway.queues.redis.presence import Holding
from gateway.queues.redis.store import RedisQueue
from gateway.supervision import Loop, Supervisor
from gateway.upstream.backends import ModelPool
from policies.outcomes import Outcome
from policies.sequences import SequenceRef
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
        probe_interval_s: float = STORE_PROBE_INTERVAL_S,
        on_state: Callable[[bool], None] = lambda up: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis
        self._local = local
        self.shared_returns = redis.shared_returns
        """Redis's, whether it is up or not: refused clients come back either way."""
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
        self._rejoining: asyncio.Event | None = None
        """Set once the rejoin under way ends, either way."""
        self._serving_until: dict[str, float] = {}
        """Per model, while Redis is lost: until when the fallback may start work."""
        self._ended: set[str] = set()
        """Models the fallback stopped serving (until Redis is back)."""
        self._timers: list[asyncio.TimerHandle] = []

    @property
    def supervisor(self) -> Supervisor:
        """The Redis store's: the probe and the reservations run beside its loops."""
        return self._redis.supervisor

    def redis_failed(self, error: BaseException) -> None:
        """Called by the Redis store (and by this class) whenever a Redis command fails."""
        if not self.up:
            return
        self.up = False
        holdings = self._redis.detach()
        self._on_state(False)
        log.error("Redis unreachable (%r): %s", error, self._fallback_words())
        now = self._clock()
        if self._mode == "local":
            for model, holding in holdings.items():
                # What this replica still runs on shared slots counts against its fallback first.
                for slot in holding.slots:
                    if not slot.charged:
                        slot.charged = True
                        self._local.charge(slot)
                self._open_fallback(model, holding, now)
        for ticket in self._redis.abandon():
            if ticket.leave_by <= now:  # waiting for a grant Redis made before its withdrawal
                ticket.interrupt(Outcome.DEADLINE_EXPIRED_IN_QUEUE)
            elif self._serving(ticket.model):
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
        self._cancel_timers()
        for loop in (self._probe, self._reservations):
            if loop is not None:
                loop.cancel()
                await loop.wait()
        await self._redis.stop()

    # -- the RequestQueue protocol ---------------------------------------------------------------

    def stats(self, model: str) -> QueueStats:
        return self._redis.stats(model) if self.up else self._local.stats(model)

    def identify(self, config_hash: str) -> None:
        self._redis.identify(config_hash)

    def replicas(self) -> Mapping[str, str]:
        return self._redis.replicas()

    def throughput(self, model: str, now: float) -> Throughput:
        return self._redis.throughput(model, now) if self.up else self._local.throughput(model, now)

    def record_service(self, model: str, service_s: float, slot: Slot | None = None) -> None:
        self._redis.record_service(model, service_s, slot)
        self._local.record_service(model, service_s, slot)

    async def offer(
        self,
        flow: Flow,
        cost: float,
        allowed_wait_s: float,
        max_work: float,
        now: float,
        batching: Batching | None = None,
        on_grant: Callable[[Slot], None] | None = None,
        kind: str = "",
        reach: Mapping[str, float] | None = None,
        sequence: SequenceRef | None = None,
    ) -> Offer:
        args = (flow, cost, allowed_wait_s, max_work, now, batching, on_grant, kind, reach, sequence)
        if self.up:
            try:
                return await self._redis.offer(*args)
            except RedisError as error:
                self.redis_failed(error)
        if (rejoining := self._rejoining) is not None:
            # The rejoin holds what the fallback used when it began: a grant from the fallback now
            # would run on capacity Redis is about to count as free.
            await rejoining.wait()
            if self.up:
                return await self.offer(*args)
        if not self._serving(flow.model):
            return Unavailable(retry_after_s=self._probe_interval_s)
        return await self._local.offer(*args)

    def expire(self, ticket: Ticket) -> None:
        (self._redis if ticket.id else self._local).expire(ticket)

    async def withdraw(self, ticket: Ticket, outcome: Outcome) -> None:
        if not ticket.id:
            self._serving(ticket.model)  # ends the fallback first when its time ran out
            await self._local.withdraw(ticket, outcome)
            return
        try:
            await self._redis.withdraw(ticket, outcome)
        except RedisError as error:
            ticket.interrupt(outcome)
            self.redis_failed(error)
        if not ticket.wakeup.cancelled() and isinstance(slot := ticket.wakeup.result(), Slot):
            if slot.released:  # granted meanwhile and given back through the Redis store
                self._discharge(slot)

    async def release(self, slot: Slot, now: float) -> None:
        if not slot.lease:
            self._serving(slot.model)
            await self._local.release(slot, now)
            return
        self._discharge(slot)
        try:
            await self._redis.release(slot, now)
        except RedisError as error:  # the lease expires with its TTL
            self.redis_failed(error)

    def release_soon(self, slot: Slot, now: float) -> bool:
        if not slot.lease:
            self._serving(slot.model)
            return self._local.release_soon(slot, now)
        self._discharge(slot)
        return self._redis.release_soon(slot, now)

    def _discharge(self, slot: Slot) -> None:
        if slot.charged:
            slot.charged = False
            self._serving(slot.model)
            self._local.discharge(slot)

    def backends_changed(self, model: str) -> None:
        self._serving(model)
        self._local.backends_changed(model)
        if self.up:
            self._redis.backends_changed(model)

    async def share_limit(self, model: str, url: str, slots: int, lead_s: float) -> tuple[bool, int]:
        """Cut off from Redis, this replica's fallback runs on its share of whatever limit it
        finds itself."""
        if self.up:
            try:
                return await self._redis.share_limit(model, url, slots, lead_s)
            except (RedisError, OSError, TimeoutError):
                pass  # the upkeep loop notices Redis is gone; the limit holds meanwhile
        return True, slots

    def dispatch_held(self, model: str) -> None:
        self._local.dispatch_held(model)  # a batch held while the fallback served
        if self.up:
            self._redis.dispatch_held(model)

    # -- the fallback's time ------------------------------------------------------------------------

    def _open_fallback(self, model: str, holding: Holding, now: float) -> None:
        """Serve `model` from the fallback on the leases Redis still counts for this replica, until
        the others may stop holding them."""
        self._local.limit(model, holding.leases)
        until = self._serving_until[model] = holding.serve_until
        self._ended.discard(model)
        if until > now and any(holding.leases.values()):
            log.warning(
                "model %s: serving from the fallback for %.1f s on the leases held: %s",
                model,
                until - now,
                ", ".join(f"{url} {n}" for url, n in holding.leases.items()),
            )
            loop = asyncio.get_running_loop()
            self._timers.append(loop.call_later(until - now, self._serving, model))
        else:
            self._end_fallback(model)

    def _serving(self, model: str) -> bool:
        """Whether the fallback may start work on `model` now; it ends once its time ran out.

        Checked before every step that could grant a slot, besides the timer, since the event loop
        may run that timer late.
        """
        if self.up or self._mode == "reject" or model in self._ended or model not in self._serving_until:
            return False
        if self._clock() >= self._serving_until[model]:
            self._end_fallback(model)
            return False
        return True

    def _end_fallback(self, model: str) -> None:
        if model in self._ended:
            return
        self._ended.add(model)
        self._local.limit(model, {})
        self._local.refuse_waiting(model, Outcome.STORE_UNAVAILABLE)
        log.warning(
            "model %s: not serving from the fallback (no leases to serve on, or %.0f s since the "
            "last heartbeat): 503 until Redis is back",
            model,
            self._redis.fallback_max_s,
        )

    def _cancel_timers(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()

    # -- recovery --------------------------------------------------------------------------------

    def _fallback_words(self) -> str:
        if self._mode == "reject":
            return "answering 503 until it is back"
        return (
            f"serving from local queues on the slots this replica holds (at most 1/{self._divisor} "
            f"of each backend's), for {self._redis.fallback_max_s:.0f} s after its last heartbeat"
        )

    def _start_probe(self) -> None:
        if not self._stopping and (self._probe is None or self._probe.finished):
            self._probe = self.supervisor.start_soon("redis_probe", self._rejoin_when_back)

    async def _rejoin_when_back(self, *, task_status: TaskStatus[None]) -> None:
        task_status.started()
        while True:
            await asyncio.sleep(self._probe_interval_s)
            rejoined = self._rejoining = asyncio.Event()
            try:
                # What the fallback may still use stays held, as leases, until it is idle.
                reserve = {pool.name: self._local.reservation(pool.name) for pool in self._pools}
                reserved = await self._redis.rejoin(reserve)
            except RedisError:
                continue
            else:
                self.up = True
                break
            finally:  # the offers that came meanwhile go on, to Redis once it is up
                self._rejoining = None
                rejoined.set()
        self._cancel_timers()
        self._serving_until.clear()
        self._ended.clear()
        self._on_state(True)
        log.warning("Redis is back: new requests use the shared queue again")
        if reserved and not self._stopping:
            self._reservations = self.supervisor.start_soon(
                "redis_share", functools.partial(self._return_share, reserved)
            )

    async def _return_share(self, reserved: set[str], *, task_status: TaskStatus[None]) -> None:
        """Hold the reserved leases until the fallback's last request is done, then free them."""
        task_status.started()
        for model in list(reserved):
            await self._local.wait_idle(model)
            with contextlib.suppress(RedisError):  # unreleased leases lapse: no beat names them
                await self._redis.release_reserved(model)
            reserved.discard(model)  # a restart after a crash goes on with the models left
