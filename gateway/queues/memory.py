"""MemoryQueue: per-model band heaps and slot counts in this process.

Everything runs on one event loop and no method awaits, so each operation is atomic by
construction. Withdrawn tickets stay in their heap until they reach its top (lazy deletion); the
per-band `depth` counts only live ones.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Iterable

from gateway.flow.estimates import PoolEstimates
from gateway.queues.base import Full, Granted, Offer, Queued, Slot, Ticket
from gateway.settings import Estimation
from gateway.upstream.backends import ModelPool
from policies.balancing import free_slots, pick_backend
from policies.dispatch import next_band
from policies.ordering import Ordering, score
from policies.outcomes import Outcome
from policies.wait import QueueStats, Throughput

_HeapEntry = tuple[float, int, Ticket]


class _ModelQueue:
    def __init__(self, pool: ModelPool, bands: int, estimation: Estimation) -> None:
        self.pool = pool
        self.heaps: list[list[_HeapEntry]] = [[] for _ in range(bands)]
        self.depth = [0] * bands
        self.live: set[Ticket] = set()
        self.estimates = PoolEstimates(bands, pool.expected_service_s, estimation)
        # Set after a hand-over that left requests waiting: the gap to the next hand-over is then a
        # clean sample of the drain rate (no idle slot in between).
        self.backlogged_handover_at: float | None = None

    def stats(self) -> QueueStats:
        return QueueStats(queued_by_band=tuple(self.depth), free_slots=free_slots(self.pool.backends))

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
        loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.get_running_loop,
    ) -> None:
        self._models = {pool.name: _ModelQueue(pool, bands, estimation) for pool in pools}
        self._sequence = itertools.count()
        self._ordering = ordering
        self._loop_factory = loop_factory

    def stats(self, model: str) -> QueueStats:
        return self._models[model].stats()

    def throughput(self, model: str, now: float) -> Throughput:
        queue = self._models[model]
        return queue.estimates.throughput(queue.pool.total_slots, now)

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
        free = free_slots(queue.pool.backends)
        positions = max(0, ahead + 1 - free)
        if positions > max_positions:
            queue.estimates.record_offer(band, admitted=False, now=now)
            return Full(QueueStats(queued_by_band=tuple(queue.depth), free_slots=free))
        queue.estimates.record_offer(band, admitted=True, now=now)
        if positions == 0 and (index := pick_backend(queue.pool.backends)) is not None:
            backend = queue.pool.backends[index]
            backend.inflight += 1
            return Granted(Slot(model, backend))
        ticket = Ticket(model, band, self._loop_factory().create_future())
        rank = score(self._ordering, now, now + allowed_wait_s)
        heapq.heappush(queue.heaps[band], (rank, next(self._sequence), ticket))
        queue.depth[band] += 1
        queue.live.add(ticket)
        return Queued(ticket)

    async def withdraw(self, ticket: Ticket, outcome: Outcome) -> None:
        self.withdraw_nowait(ticket, outcome)

    def withdraw_nowait(self, ticket: Ticket, outcome: Outcome) -> None:
        self._models[ticket.model].remove(ticket)
        ticket.interrupt(outcome)
        if not ticket.wakeup.cancelled() and isinstance(slot := ticket.wakeup.result(), Slot):
            self.release_nowait(slot, now=None)

    async def release(self, slot: Slot, now: float) -> None:
        self.release_nowait(slot, now)

    def release_soon(self, slot: Slot, now: float) -> bool:
        return self.release_nowait(slot, now)

    def release_nowait(self, slot: Slot, now: float | None) -> bool:
        """Give the slot back; True when a waiter took it at once."""
        if slot.released:
            return False
        slot.released = True
        slot.backend.inflight -= 1
        return self._dispatch(self._models[slot.model], now) > 0

    def backends_changed(self, model: str) -> None:
        queue = self._models[model]
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
        while queue.live and (index := pick_backend(queue.pool.backends)) is not None:
            ticket = queue.pop_next()
            if ticket is None:
                break
            if ticket.wakeup.done():
                continue  # its wait already ended; it only awaited removal
            backend = queue.pool.backends[index]
            backend.inflight += 1
            ticket.wakeup.set_result(Slot(ticket.model, backend))
            granted += 1
            if now is not None and queue.backlogged_handover_at is not None:
                queue.estimates.record_handover_gap(now - queue.backlogged_handover_at, now)
            queue.backlogged_handover_at = now if (now is not None and queue.live) else None
        return granted
