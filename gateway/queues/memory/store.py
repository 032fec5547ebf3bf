"""MemoryQueue: per-model flows and slot counts in this process.

Everything runs on one event loop and no method awaits, so each operation is atomic by
construction. Each band keeps a heap per flow; withdrawn tickets stay in their heap until they
reach its top (lazy deletion), while the band's count and work cover only live ones. As the fallback
of a shared store, it uses at most this replica's share of each backend's slots (`slot_divisor`),
and no more than the shared store still counts for it (`limit`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable, Mapping

from gateway.queues.base import (
    ALONE,
    Batching,
    Flow,
    Full,
    Granted,
    Offer,
    Queued,
    Reservations,
    Slot,
    Ticket,
)
from gateway.queues.memory.model_queue import ModelQueue
from gateway.queues.memory.pins import has_room, index_of
from gateway.queues.shares import Capacity
from gateway.settings import Estimation
from gateway.upstream.backends import ModelPool
from policies.balancing import pick_backend
from policies.displacement import displacement_handovers_per_s
from policies.ordering import Ordering
from policies.outcomes import Outcome
from policies.quotas import Quota
from policies.sequences import SequenceRef
from policies.wait import QueueStats, Throughput, queued_ahead, work_before_grant


class MemoryQueue:
    def __init__(
        self,
        pools: Iterable[ModelPool],
        bands: int,
        estimation: Estimation,
        *,
        ordering: Ordering = Ordering.FIFO,
        weights: Callable[[str], float] = lambda tenant: 1.0,
        tenants: bool = True,
        reserved: Reservations = (),
        quotas: Mapping[str, Quota] | None = None,
        slot_divisor: int = 1,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.get_running_loop,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        fair = weights if ordering is Ordering.FIFO else None
        self._models = {
            p.name: ModelQueue(p, bands, estimation, slot_divisor, clock, reserved, quotas, fair, tenants)
            for p in pools
        }
        self._sequence = itertools.count()
        self._ordering = ordering
        self._loop_factory = loop_factory
        self.shared_returns = ALONE

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def stats(self, model: str) -> QueueStats:
        return self._models[model].stats()

    def identify(self, config_hash: str) -> None:
        pass  # no one else to tell

    def replicas(self) -> Mapping[str, str]:
        return {}

    def throughput(self, model: str, now: float) -> Throughput:
        queue = self._models[model]
        queue.estimates.observe(queue.counters, now)
        return queue.estimates.throughput(queue.total_slots, now, queue.reserved)

    def record_service(self, model: str, service_s: float, slot: Slot | None = None) -> None:
        self._models[model].estimates.record_service(service_s, "" if slot is None else slot.kind)

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
        return self.offer_nowait(
            flow, cost, allowed_wait_s, max_work, now, batching, on_grant, kind, reach, sequence
        )

    def offer_nowait(
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
        queue = self._models[flow.model]
        pinned, anew = queue.pins.backend_of(sequence, queue.capacity, now) if sequence else (None, False)
        per_slot = queue.estimates.handover_cost
        queue.estimates.observe(queue.counters, now)  # closes the counting interval before this one
        if queue.quotas and queue.live and queue.estimates.handover_cost != per_slot:
            # What borrowers may hold is counted in slots of the work a hand-over takes: it moved,
            # and a head the quotas held back may start now, whatever becomes of this offer.
            self._dispatch(queue, now=None)
        counters = queue.counters
        counters.offered_work[flow.band] += cost
        handover = queue.estimates.handover_cost
        free = queue.usable(flow.band)
        ahead = queue.work_ahead(flow.band, flow.tenant, handover) if queue.live else 0.0
        ahead = queued_ahead(ahead, free, queue.only_pinned_ahead(flow.band))
        waits = ahead > 0 or free == 0  # arrivals count only where it waits, as offer.lua reads them
        arriving = queue.arriving_ahead(flow.band, flow.tenant, handover, reach) if reach and waits else 0.0
        to_drain = work_before_grant(ahead, free, handover, cost, arriving)
        if to_drain > max_work:
            return Full(queue.stats())
        immediate = (
            free > 0
            and ahead == 0
            and queue.may_start(flow.tenant, cost)
            and (pinned is None or has_room(queue.capacity, pinned))
        )
        if not immediate and not queue.room_for(flow.band, cost):
            return Full(queue.stats(), at_cap=True)
        if sequence is not None:
            queue.pins.admitted(sequence, pinned, anew, now)
        counters.count_admitted(flow.band, flow.tenant, cost)
        queue.joins(flow)
        held = batching is not None and batching.hold
        index = pick_backend(queue.capacity) if pinned is None else index_of(queue.capacity, pinned)
        if immediate and not held and index is not None:
            slot = queue.take(index, cost, flow, kind=kind)
            if sequence is not None:
                queue.pins.follow(sequence, slot.backend.url, now)
            return Granted(slot)
        leave_by = now + allowed_wait_s
        ticket = Ticket(
            flow,
            cost,
            self._loop_factory().create_future(),
            batching=batching,
            leave_by=leave_by,
            kind=kind,
            on_grant=on_grant,
            sequence=sequence,
            backend=pinned,
        )
        queue.insert(ticket, self._rank(leave_by), next(self._sequence))
        reclaim = queue.reclaims(flow.tenant, cost)
        if reclaim or any(b.count for b in queue.bands[flow.band + 1 :]):
            self._displace_overdue(queue, flow.band, now, reclaim)
        if (
            (queue.quotas and free > 0)
            or (queue.reservations_move and queue.free_slots > 0)
            or (free > 0 and not immediate and not held)
        ):
            # The heads may be held back by quotas where it is not, by a reservation that has
            # since shrunk (a window closed), or a batch may be held for companions (this one
            # joins it and lets it go, or is not for it and must not wait behind a free slot).
            self._dispatch(queue, now=None)
        return Queued(ticket)

    def _displace_overdue(self, queue: ModelQueue, band: int, now: float, reclaim: bool) -> None:
        """Less urgent requests (and borrowers', where it `reclaim`s a quota) this arrival pushed
        past their allowance are told at once."""
        throughput = queue.estimates.throughput(queue.total_slots, now)
        handovers_per_s = displacement_handovers_per_s(throughput)
        fifo = self._ordering is Ordering.FIFO
        queue.displace_overdue(
            band, now, handovers_per_s, throughput.service_cv, in_arrival_order=fifo, reclaim=reclaim
        )

    def _rank(self, leave_by: float) -> float:
        """A ticket's ordering score in its flow: its deadline under EDF, else none (first come,
        first served within its flow; its flow's turn is its head's start tag: policies.ordering,
        policies.fairness)."""
        return leave_by if self._ordering is Ordering.EDF else 0.0

    def adopt(self, ticket: Ticket, now: float) -> None:
        """Take over a ticket another store held (its wait goes on here, behind those waiting)."""
        queue = self._models[ticket.model]
        ticket.id = ""
        # Under EDF its deadline is not known here: `now` puts it before those queued here.
        queue.insert(ticket, self._rank(now), next(self._sequence))
        self._dispatch(queue, now=None)

    def dispatch_held(self, model: str) -> None:
        self._dispatch(self._models[model], now=None)

    async def share_limit(self, model: str, url: str, slots: int, lead_s: float) -> tuple[bool, int]:
        return True, slots

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
        # Every live ticket, not the dispatch order's: that stops where reservations or quotas
        # hold a band back, which is every band once no slot is free.
        for ticket in list(queue.live):
            queue.remove(ticket)
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

    def expire(self, ticket: Ticket) -> None:
        # A grant here sets the ticket's wakeup in the same turn of the loop: whichever came first.
        ticket.interrupt(Outcome.DEADLINE_EXPIRED_IN_QUEUE)

    async def withdraw(self, ticket: Ticket, outcome: Outcome) -> None:
        self.withdraw_nowait(ticket, outcome)

    def withdraw_nowait(self, ticket: Ticket, outcome: Outcome) -> None:
        queue = self._models[ticket.model]
        removed = queue.remove(ticket)
        ticket.interrupt(outcome)
        if removed and queue.quotas and queue.free_slots:
            # It may have been a head its quota held back, or an owner's that kept borrowers
            # waiting: what was behind it may start now, on a slot that would otherwise idle.
            self._dispatch(queue, now=None)
        if not ticket.wakeup.cancelled() and isinstance(slot := ticket.wakeup.result(), Slot):
            # A batch's slot is released by whoever runs the batch's call; a claimed one by its caller.
            if not slot.batch and not ticket.claimed:
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

    def _dispatch(self, queue: ModelQueue, now: float | None) -> int:
        """Hand free slots to waiters, most urgent first; returns how many slots were handed over.

        `now` is given when exactly one slot just freed, which makes the hand-over a drain sample.
        """
        granted = 0
        counters = queue.counters
        # Read before taking the next tickets: taking the last of them ends the backlog, but the
        # gap to this hand-over is still a clean sample. Only the freed slot's hand-over is one:
        # others in the same dispatch go to slots that were free already (held for a batch).
        backlogged_at = queue.backlogged_handover_at
        while queue.live and (index := pick_backend(queue.capacity)) is not None:
            popped = queue.pop_next()
            if not popped:
                break
            tickets = [t for t in popped if not t.wakeup.done()]  # done: it only awaited removal
            if not tickets:
                continue
            cost = sum(t.cost for t in tickets)
            head = tickets[0]
            if head.backend is not None:  # pinned: dispatch gave it only with a slot free there
                index = index_of(queue.capacity, head.backend)
                assert index is not None
            batch = tuple(tickets) if len(tickets) > 1 else ()
            slot = queue.take(index, cost, head.flow, batch, "" if batch else head.kind)
            if head.sequence is not None:
                queue.pins.follow(head.sequence, slot.backend.url, head.leave_by)
            for ticket in tickets:
                ticket.grant(slot)
            granted += 1
            counters.handovers += 1
            counters.handed_work += cost
            if now is not None and backlogged_at is not None:
                counters.drained_work += cost
                counters.drained_s += now - backlogged_at
                counters.drained_at = now
                backlogged_at = None
            queue.backlogged_handover_at = now if (now is not None and queue.live) else None
        return granted
