"""MemoryQueue: per-model band heaps and slot counts in this process.

Everything runs on one event loop and no method awaits, so each operation is atomic by
construction. Withdrawn tickets stay in their heap until they reach its top (lazy deletion); the
per-band `depth` counts only live ones. As the fallback of a shared store, it uses only this
replica's share of each backend's slots (`slot_divisor`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.flow.estimates import PoolEstimates
from gateway.queues.base import Full, Granted, Offer, Queued, Slot, Ticket
from gateway.settings import Estimation
from gateway.upstream.backends import BackendState, ModelPool
from policies.balancing import free_slots, pick_backend
from policies.dispatch import next_band
from policies.ordering import Ordering, score
from policies.outcomes import Outcome
from policies.wait import QueueStats, Throughput

_HeapEntry = tuple[float, int, Ticket]


@dataclass(slots=True, eq=False)
class _Capacity:
    """This store's share of one backend's slots, and how many of them are in use."""

    backend: BackendState
    divisor: int
    inflight: int = 0
    departed: bool = False
    """The backend left the pool: its slots in use still count, none is handed out."""

    @property
    def max_concurrency(self) -> int:
        slots = self.backend.max_concurrency  # may be discovered later, or change
        return max(1, slots // self.divisor) if slots else 0

    @property
    def ready(self) -> bool:
        return self.backend.ready and not self.departed

    @property
    def external_waiting(self) -> float:
        return self.backend.external_waiting


class _ModelQueue:
    def __init__(self, pool: ModelPool, bands: int, estimation: Estimation, slot_divisor: int) -> None:
        self.pool = pool
        self.slot_divisor = slot_divisor
        self.capacity: list[_Capacity] = []
        self.capacity_of: dict[BackendState, _Capacity] = {}
        self.follow_backends()
        self.heaps: list[list[_HeapEntry]] = [[] for _ in range(bands)]
        self.depth = [0] * bands
        self.live: set[Ticket] = set()
        self.estimates = PoolEstimates(bands, pool.expected_service_s, estimation)
        # Set after a hand-over that left requests waiting: the gap to the next hand-over is then a
        # clean sample of the drain rate (no idle slot in between).
        self.backlogged_handover_at: float | None = None
        self.idle_waiters: list[asyncio.Future[None]] = []

    @property
    def idle(self) -> bool:
        return not self.live and all(c.inflight == 0 for c in self.capacity)

    def wake_if_idle(self) -> None:
        if self.idle_waiters and self.idle:
            for waiter in self.idle_waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self.idle_waiters.clear()

    def follow_backends(self) -> None:
        """Match the pool's backends, which endpoint discovery may change; a backend that left
        keeps its count until its last slot comes back."""
        current = {b: self.capacity_of.get(b) or _Capacity(b, self.slot_divisor) for b in self.pool.backends}
        for backend, capacity in self.capacity_of.items():
            if backend not in current and capacity.inflight:
                capacity.departed = True
                current[backend] = capacity
        self.capacity_of = current
        self.capacity = list(current.values())

    def stats(self) -> QueueStats:
        return QueueStats(queued_by_band=tuple(self.depth), free_slots=free_slots(self.capacity))

    @property
    def total_slots(self) -> int:
        return sum(c.max_concurrency for c in self.capacity if c.ready)

    def take(self, index: int) -> BackendState:
        capacity = self.capacity[index]
        capacity.inflight += 1
        capacity.backend.inflight += 1  # the gateway-wide count of slots held, for metrics
        return capacity.backend

    def remove(self, ticket: Ticket) -> bool:
        if ticket not in self.live:
            return False
        self.live.discard(ticket)
        self.depth[ticket.band] -= 1
        if not self.live:
            self.backlogged_handover_at = None
        heap = self.heaps[ticket.band]
        if len(heap) > 64 and len(heap) > 4 * self.depth[ticket.band]:
            self.heaps[ticket.band] = [entry for entry in heap if entry[2] in self.live]
            heapq.heapify(self.heaps[ticket.band])
        return True

    def pop_next(self) -> Ticket | None:
        """The head of the most urgent non-empty band, removed from the queue."""
        while (band := next_band(self.depth)) is not None:
            heap = self.heaps[band]
            while heap:
                ticket = heapq.heappop(heap)[2]
                if self.remove(ticket):
                    return ticket
        return None


class MemoryQueue:
    def __init__(
        self,
        pools: Iterable[ModelPool],
        bands: int,
        estimation: Estimation,
        *,
        ordering: Ordering = Ordering.FIFO,
        slot_divisor: int = 1,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.get_running_loop,
    ) -> None:
        self._models = {pool.name: _ModelQueue(pool, bands, estimation, slot_divisor) for pool in pools}
        self._sequence = itertools.count()
        self._ordering = ordering
        self._loop_factory = loop_factory

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def stats(self, model: str) -> QueueStats:
        return self._models[model].stats()

    def throughput(self, model: str, now: float) -> Throughput:
        queue = self._models[model]
        return queue.estimates.throughput(queue.total_slots, now)

    def record_service(self, model: str, service_s: float) -> None:
        self._models[model].estimates.record_service(service_s)

    async def offer(
        self, model: str, band: int, allowed_wait_s: float, max_positions: int, now: float
    ) -> Offer:
        return self.offer_nowait(model, band, allowed_wait_s, max_positions, now)

    def offer_nowait(
        self, model: str, band: int, allowed_wait_s: float, max_positions: int, now: float
    ) -> Offer:
        queue = self._models[model]
        ahead = sum(queue.depth[: band + 1])
        free = free_slots(queue.capacity)
        positions = max(0, ahead + 1 - free)
        if positions > max_positions:
            queue.estimates.record_offer(band, admitted=False, now=now)
            return Full(QueueStats(queued_by_band=tuple(queue.depth), free_slots=free))
        queue.estimates.record_offer(band, admitted=True, now=now)
        if positions == 0 and (index := pick_backend(queue.capacity)) is not None:
            return Granted(Slot(model, queue.take(index)))
        ticket = Ticket(model, band, self._loop_factory().create_future())
        self._enqueue(queue, ticket, score(self._ordering, now, now + allowed_wait_s))
        return Queued(ticket)

    def adopt(self, ticket: Ticket, now: float) -> None:
        """Take over a ticket another store held (its wait goes on here, behind those waiting)."""
        queue = self._models[ticket.model]
        ticket.id = ""
        self._enqueue(queue, ticket, now)
        self._dispatch(queue, now=None)

    def charge(self, slot: Slot) -> None:
        """Count a slot another store granted against this store's share, until `discharge`."""
        queue = self._models[slot.model]
        if slot.backend not in queue.capacity_of:  # a backend that already left the pool
            queue.capacity_of[slot.backend] = _Capacity(slot.backend, queue.slot_divisor, departed=True)
            queue.capacity.append(queue.capacity_of[slot.backend])
        queue.capacity_of[slot.backend].inflight += 1

    def discharge(self, slot: Slot) -> None:
        queue = self._models[slot.model]
        queue.capacity_of[slot.backend].inflight -= 1
        self._dispatch(queue, now=None)
        queue.wake_if_idle()

    def is_idle(self, model: str) -> bool:
        return self._models[model].idle

    async def wait_idle(self, model: str) -> None:
        """Return once nothing waits and no slot is held for `model`."""
        queue = self._models[model]
        if not queue.idle:
            waiter = self._loop_factory().create_future()
            queue.idle_waiters.append(waiter)
            await waiter

    def _enqueue(self, queue: _ModelQueue, ticket: Ticket, rank: float) -> None:
        heapq.heappush(queue.heaps[ticket.band], (rank, next(self._sequence), ticket))
        queue.depth[ticket.band] += 1
        queue.live.add(ticket)

    async def withdraw(self, ticket: Ticket, outcome: Outcome) -> None:
        self.withdraw_nowait(ticket, outcome)

    def withdraw_nowait(self, ticket: Ticket, outcome: Outcome) -> None:
        queue = self._models[ticket.model]
        queue.remove(ticket)
        ticket.interrupt(outcome)
        if not ticket.wakeup.cancelled() and isinstance(slot := ticket.wakeup.result(), Slot):
            self.release_nowait(slot, now=None)
        queue.wake_if_idle()

    async def release(self, slot: Slot, now: float) -> None:
        self.release_nowait(slot, now)

    def release_soon(self, slot: Slot, now: float) -> bool:
        return self.release_nowait(slot, now)

    def release_nowait(self, slot: Slot, now: float | None) -> bool:
        """Give the slot back; True when a waiter took it at once."""
        if slot.released:
            return False
        slot.released = True
        queue = self._models[slot.model]
        capacity = queue.capacity_of[slot.backend]
        capacity.inflight -= 1
        slot.backend.inflight -= 1
        if capacity.departed and not capacity.inflight:
            queue.follow_backends()
        handed_over = self._dispatch(queue, now) > 0
        queue.wake_if_idle()
        return handed_over

    def backends_changed(self, model: str) -> None:
        queue = self._models[model]
        queue.follow_backends()
        if queue.pool.any_ready:
            self._dispatch(queue, now=None)
            return
        while (ticket := queue.pop_next()) is not None:
            ticket.interrupt(Outcome.NO_BACKEND)

    def _dispatch(self, queue: _ModelQueue, now: float | None) -> int:
        """Hand free slots to waiters, most urgent first; returns how many were handed over.

        `now` is given when exactly one slot just freed, which makes the hand-over a drain sample.
        """
        granted = 0
        while queue.live and (index := pick_backend(queue.capacity)) is not None:
            ticket = queue.pop_next()
            if ticket is None:
                break
            if ticket.wakeup.done():
                continue  # its wait already ended; it only awaited removal
            ticket.grant(Slot(ticket.model, queue.take(index)))
            granted += 1
            if now is not None and queue.backlogged_handover_at is not None:
                queue.estimates.record_handover_gap(now - queue.backlogged_handover_at, now)
            queue.backlogged_handover_at = now if (now is not None and queue.live) else None
        return granted
