"""MemoryQueue: per-model flows and slot counts in this process.

Everything runs on one event loop and no method awaits, so each operation is atomic by
construction. Each band keeps a heap per flow; withdrawn tickets stay in their heap until they
reach its top (lazy deletion), while the band's count and work cover only live ones. As the fallback
of a shared store, it uses at most this replica's share of each backend's slots (`slot_divisor`),
and no more than the shared store still counts for it (`limit`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gateway.queues.base import Batching, Flow, Full, Granted, Offer, Queued, Slot, Ticket
from gateway.queues.estimates import PoolEstimates, StoreCounters
from gateway.queues.shares import Capacity
from gateway.settings import Estimation
from gateway.upstream.backends import BackendState, ModelPool
from policies.balancing import free_slots, pick_backend
from policies.fairness import tags, virtual_time_after
from policies.ordering import Ordering
from policies.outcomes import Outcome
from policies.wait import QueueStats, Throughput, work_before_grant

_HeapEntry = tuple[float, int, Ticket]


@dataclass(slots=True, eq=False)
class _Band:
    """One band's waiting tickets: a heap per flow (by tenant), and the live count and work; and
    its fair-queuing clock (policies.fairness): the virtual time and each flow's finish tag."""

    flows: dict[str, list[_HeapEntry]] = field(default_factory=dict)
    count: int = 0
    work: float = 0.0
    virtual_time: float = 0.0
    finish: dict[str, float] = field(default_factory=dict)

    def fair_start(self, tenant: str, cost: float, weight: float) -> float:
        """The start tag of a request of `cost` joining `tenant`'s flow, which moves its finish tag."""
        tagged = tags(self.virtual_time, self.finish.get(tenant, 0.0), cost, weight)
        self.finish[tenant] = tagged.finish
        return tagged.start


class _ModelQueue:
    def __init__(
        self, pool: ModelPool, bands: int, estimation: Estimation, divisor: int, clock: Callable[[], float]
    ) -> None:
        self.pool = pool
        self.clock = clock
        self.slot_divisor = divisor
        self.limits: dict[str, int] | None = None
        """Backend url -> slots at most (MemoryQueue.limit); a backend not named gets none."""
        self.capacity: list[Capacity] = []
        self.capacity_of: dict[BackendState, Capacity] = {}
        self.follow_backends()
        self.bands = [_Band() for _ in range(bands)]
        self.live: set[Ticket] = set()
        self.running: dict[Slot, float] = {}
        """The slots in use, with when each was handed over (its request's age follows)."""
        self.estimates = PoolEstimates(bands, pool.expected_service_s, estimation)
        self.counters = StoreCounters.empty(bands)
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
        current = {b: self.capacity_of.get(b) or Capacity(b, self.slot_divisor) for b in self.pool.backends}
        for backend, capacity in current.items():
            capacity.limit = None if self.limits is None else self.limits.get(backend.url, 0)
        for backend, capacity in self.capacity_of.items():
            if backend not in current and capacity.inflight:
                capacity.departed = True
                current[backend] = capacity
        self.capacity_of = current
        self.capacity = list(current.values())

    def stats(self) -> QueueStats:
        return QueueStats(
            queued_by_band=tuple(b.count for b in self.bands),
            free_slots=free_slots(self.capacity),
            queued_work_by_band=tuple(b.work for b in self.bands),
            started_at=tuple(self.running.values()),
        )

    @property
    def total_slots(self) -> int:
        return sum(c.max_concurrency for c in self.capacity if c.ready)

    def take(self, index: int, cost: float, batch: tuple[Ticket, ...] = ()) -> Slot:
        capacity = self.capacity[index]
        capacity.inflight += 1
        capacity.backend.inflight += 1  # the gateway-wide count of slots held, for metrics
        return self.running_since(Slot(self.pool.name, capacity.backend, cost, batch))

    def running_since(self, slot: Slot) -> Slot:
        self.running[slot] = self.clock()
        return slot

    def insert(self, ticket: Ticket, rank: float, sequence: int) -> None:
        band = self.bands[ticket.band]
        heapq.heappush(band.flows.setdefault(ticket.flow.tenant, []), (rank, sequence, ticket))
        band.count += 1
        band.work += ticket.cost
        self.live.add(ticket)

    def remove(self, ticket: Ticket) -> bool:
        if ticket not in self.live:
            return False
        self.live.discard(ticket)
        band = self.bands[ticket.band]
        band.count -= 1
        band.work = band.work - ticket.cost if band.count else 0.0  # no float residue when empty
        if not self.live:
            self.backlogged_handover_at = None
        heap = band.flows.get(ticket.flow.tenant)
        if heap is not None and len(heap) > 64 and len(heap) > 4 * band.count:
            heap[:] = [entry for entry in heap if entry[2] in self.live]
            heapq.heapify(heap)
        return True

    def pop_next(self) -> list[Ticket]:
        """The next tickets to get a slot, removed from the queue: the head of the flow with the
        lowest head score in the most urgent band with work, and the batch it leads, if any."""
        for band in self.bands:
            if band.count == 0:
                continue
            tenant = min(
                (tenant for tenant, heap in band.flows.items() if self._clean_head(heap)),
                key=lambda tenant: band.flows[tenant][0][:2],
            )
            heap = band.flows[tenant]
            rank, _, leader = heapq.heappop(heap)
            band.virtual_time = virtual_time_after(band.virtual_time, rank)
            self.remove(leader)
            taken = [leader]
            if leader.batching is not None:
                taken += self._batch_behind(heap, leader.batching, leader.cost)
            if not heap:
                del band.flows[tenant]
            return taken
        return []

    def _batch_behind(self, heap: list[_HeapEntry], batching: Batching, cost: float) -> list[Ticket]:
        followers: list[Ticket] = []
        while self._clean_head(heap):
            ticket = heap[0][2]
            if ticket.batching is None or ticket.batching.key != batching.key:
                break
            if cost + ticket.cost > batching.max_cost:
                break
            heapq.heappop(heap)
            self.remove(ticket)
            followers.append(ticket)
            cost += ticket.cost
        return followers

    def _clean_head(self, heap: list[_HeapEntry]) -> bool:
        """Drop withdrawn tickets off the heap's top; True when a live one is left."""
        while heap and heap[0][2] not in self.live:
            heapq.heappop(heap)
        return bool(heap)


class MemoryQueue:
    def __init__(
        self,
        pools: Iterable[ModelPool],
        bands: int,
        estimation: Estimation,
        *,
        ordering: Ordering = Ordering.FIFO,
        weights: Mapping[str, float] | None = None,
        slot_divisor: int = 1,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.get_running_loop,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._models = {p.name: _ModelQueue(p, bands, estimation, slot_divisor, clock) for p in pools}
        self._sequence = itertools.count()
        self._ordering = ordering
        self._weights = dict(weights or {})
        """Tenant -> weight in its bands' fair queuing; a tenant not named (and "") weighs 1."""
        self._loop_factory = loop_factory

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def stats(self, model: str) -> QueueStats:
        return self._models[model].stats()

    def throughput(self, model: str, now: float) -> Throughput:
        queue = self._models[model]
        queue.estimates.observe(queue.counters, now)
        return queue.estimates.throughput(queue.total_slots, now)

    def record_service(self, model: str, service_s: float) -> None:
        self._models[model].estimates.record_service(service_s)

    async def offer(
        self,
        flow: Flow,
        cost: float,
        allowed_wait_s: float,
        max_work: float,
        now: float,
        batching: Batching | None = None,
    ) -> Offer:
        return self.offer_nowait(flow, cost, allowed_wait_s, max_work, now, batching)

    def offer_nowait(
        self,
        flow: Flow,
        cost: float,
        allowed_wait_s: float,
        max_work: float,
        now: float,
        batching: Batching | None = None,
    ) -> Offer:
        queue = self._models[flow.model]
        queue.estimates.observe(queue.counters, now)  # closes the counting interval before this one
        counters = queue.counters
        counters.offered_work[flow.band] += cost
        ahead = sum(band.work for band in queue.bands[: flow.band + 1]) if queue.live else 0.0
        free = free_slots(queue.capacity)
        to_drain = work_before_grant(ahead, free, queue.estimates.handover_cost)
        if to_drain > max_work:
            return Full(queue.stats())
        counters.admitted_work[flow.band] += cost
        if free > 0 and ahead == 0 and (index := pick_backend(queue.capacity)) is not None:
            return Granted(queue.take(index, cost))
        ticket = Ticket(flow, cost, self._loop_factory().create_future(), batching=batching)
        queue.insert(ticket, self._rank(queue, ticket, now + allowed_wait_s), next(self._sequence))
        return Queued(ticket)

    def _rank(self, queue: _ModelQueue, ticket: Ticket, leave_by: float) -> float:
        """The ticket's ordering score: its deadline under EDF, else its start tag in its band's
        fair queuing, first come, first served within its flow (policies.ordering, policies.fairness)."""
        if self._ordering is Ordering.EDF:
            return leave_by
        weight = self._weights.get(ticket.flow.tenant, 1.0)
        return queue.bands[ticket.band].fair_start(ticket.flow.tenant, ticket.cost, weight)

    def adopt(self, ticket: Ticket, now: float) -> None:
        """Take over a ticket another store held (its wait goes on here, behind those waiting)."""
        queue = self._models[ticket.model]
        ticket.id = ""
        # Under EDF its deadline is not known here: `now` puts it before those queued here.
        queue.insert(ticket, self._rank(queue, ticket, now), next(self._sequence))
        self._dispatch(queue, now=None)

    def charge(self, slot: Slot) -> None:
        """Count a slot another store granted against this store's share, until `discharge`."""
        queue = self._models[slot.model]
        if slot.backend not in queue.capacity_of:  # a backend that already left the pool
            queue.capacity_of[slot.backend] = Capacity(slot.backend, queue.slot_divisor, departed=True)
            queue.capacity.append(queue.capacity_of[slot.backend])
        queue.capacity_of[slot.backend].inflight += 1
        queue.running_since(slot)  # a request already running: its start is not known here

    def discharge(self, slot: Slot) -> None:
        queue = self._models[slot.model]
        queue.capacity_of[slot.backend].inflight -= 1
        queue.running.pop(slot, None)
        self._dispatch(queue, now=None)
        queue.wake_if_idle()

    def limit(self, model: str, slots: dict[str, int]) -> None:
        """Use at most `slots[url]` of each backend (within the share), none of a backend not named.

        As a fallback, so that it never uses more than the shared store still counts for it.
        """
        queue = self._models[model]
        queue.limits = dict(slots)
        queue.follow_backends()
        self._dispatch(queue, now=None)

    def refuse_waiting(self, model: str, outcome: Outcome) -> None:
        """End every wait for `model` with `outcome`."""
        queue = self._models[model]
        while tickets := queue.pop_next():
            for ticket in tickets:
                ticket.interrupt(outcome)
        queue.wake_if_idle()

    def reservation(self, model: str) -> dict[str, int]:
        """Backend url -> the slots this store may still use, while it has work: what a shared
        store must hold for it (empty once it is idle)."""
        queue = self._models[model]
        if queue.idle:
            return {}
        return {c.backend.url: max(c.max_concurrency, c.inflight) for c in queue.capacity}

    def is_idle(self, model: str) -> bool:
        return self._models[model].idle

    async def wait_idle(self, model: str) -> None:
        """Return once nothing waits and no slot is held for `model`."""
        queue = self._models[model]
        if not queue.idle:
            waiter = self._loop_factory().create_future()
            queue.idle_waiters.append(waiter)
            await waiter

    async def withdraw(self, ticket: Ticket, outcome: Outcome) -> None:
        self.withdraw_nowait(ticket, outcome)

    def withdraw_nowait(self, ticket: Ticket, outcome: Outcome) -> None:
        queue = self._models[ticket.model]
        queue.remove(ticket)
        ticket.interrupt(outcome)
        if not ticket.wakeup.cancelled() and isinstance(slot := ticket.wakeup.result(), Slot):
            if not slot.batch:  # a batch's slot is released by whoever runs the batch's call
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
        queue.running.pop(slot, None)
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
        self.refuse_waiting(model, Outcome.NO_BACKEND)

    def _dispatch(self, queue: _ModelQueue, now: float | None) -> int:
        """Hand free slots to waiters, most urgent first; returns how many slots were handed over.

        `now` is given when exactly one slot just freed, which makes the hand-over a drain sample.
        """
        granted = 0
        counters = queue.counters
        while queue.live and (index := pick_backend(queue.capacity)) is not None:
            # Read before taking the next tickets: taking the last of them ends the backlog, but
            # the gap to this hand-over is still a clean sample.
            backlogged_at = queue.backlogged_handover_at
            popped = queue.pop_next()
            if not popped:
                break
            tickets = [t for t in popped if not t.wakeup.done()]  # done: it only awaited removal
            if not tickets:
                continue
            cost = sum(t.cost for t in tickets)
            slot = queue.take(index, cost, tuple(tickets) if len(tickets) > 1 else ())
            for ticket in tickets:
                ticket.grant(slot)
            granted += 1
            counters.handovers += 1
            counters.handed_work += cost
            if now is not None and backlogged_at is not None:
                counters.drained_work += cost
                counters.drained_s += now - backlogged_at
                counters.drained_at = now
            queue.backlogged_handover_at = now if (now is not None and queue.live) else None
        return granted
