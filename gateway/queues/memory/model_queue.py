"""The memory store's state of one model: its bands' waiting tickets, in a heap per flow ordered
by score (first come, first served in fair queuing; by deadline under EDF), each band's
fair-queuing clock, the backends' slot counts and the slots in use.

It is the memory store's (gateway/queues/memory/store.py) and keeps no rule of its own beyond the order:
withdrawn tickets stay in their heap until they reach its top (lazy deletion), while the band's
count and work cover only live ones.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Mapping

from gateway.queues.base import Flow, Reservations, Slot, Ticket, reserved_now
from gateway.queues.estimates import PoolEstimates, StoreCounters
from gateway.queues.memory.band_queue import BandQueue, batch_behind, clean_head
from gateway.queues.memory.pins import SequencePins, next_pinned
from gateway.queues.shares import Capacity
from gateway.settings import Estimation
from gateway.upstream.backends import BackendState, ModelPool
from policies.balancing import free_slots
from policies.dispatch import Head, QuotaState, next_flow, pinned_goes_first
from policies.displacement import (
    OVERDUE_CHECKED,
    Queued,
    cap_victims,
    overdue_in_flow,
    owners_ahead,
    requests_per_handover,
)
from policies.outcomes import Outcome
from policies.quotas import Quota, under_quota
from policies.reservations import usable_by_band, usable_free_slots
from policies.wait import QueueStats


class ModelQueue:
    def __init__(
        self,
        pool: ModelPool,
        bands: int,
        estimation: Estimation,
        divisor: int,
        clock: Callable[[], float],
        reserved: Reservations = (),
        quotas: Mapping[str, Quota] | None = None,
        weights: Callable[[str], float] | None = None,
        tenants: bool = True,
    ) -> None:
        self.pool = pool
        self.weight_of = weights
        """A tenant's weight in its band's fair queuing; None when bands are not fair-queued (EDF)."""
        self.told_weights = weights if tenants else None
        """The weights its statistics tell each band's fair queuing with: none without tenants (one
        flow, whose turn is the whole band), as the Redis store's scripts."""
        self.quotas = dict(quotas or {})
        """Tenant -> its quota of work in flight in this pool (policies.quotas)."""
        self._reserved = reserved
        """Per band, the slots its class keeps from the less urgent ones (policies.reservations)."""
        self.clock = clock
        self.slot_divisor = divisor
        self.limits: dict[str, int] | None = None
        """Backend url -> slots at most (MemoryQueue.limit); a backend not named gets none."""
        self.capacity: list[Capacity] = []
        self.capacity_of: dict[BackendState, Capacity] = {}
        self.follow_backends()
        self.bands = [BandQueue() for _ in range(bands)]
        self.live: set[Ticket] = set()
        self.running: dict[Slot, float] = {}
        """The slots in use, with when each was handed over (its request's age follows)."""
        self.pins = SequencePins()
        self.estimates = PoolEstimates(bands, pool.expected_service_s, estimation)
        self.counters = StoreCounters.empty(bands)
        # Set after a hand-over that left requests waiting: the gap to the next hand-over is then a
        # clean sample of the drain rate (no idle slot in between).
        self.backlogged_handover_at: float | None = None
        self.idle_waiters: list[asyncio.Future[None]] = []

    @property
    def reservations_move(self) -> bool:
        """Whether the reservations change with time (time windows)."""
        return callable(self._reserved)

    @property
    def free_slots(self) -> int:
        """Free slots, whichever class may take them."""
        return free_slots(self.capacity)

    @property
    def reserved(self) -> tuple[int, ...]:
        """Per band, the slots its class keeps from the less urgent ones now (policies.reservations)."""
        return reserved_now(self._reserved)

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
            capacity.departed = False  # one that left and came back (endpoint discovery) with its count
        for backend, capacity in self.capacity_of.items():
            if backend not in current and capacity.inflight:
                capacity.departed = True
                current[backend] = capacity
        self.capacity_of = current
        self.capacity = list(current.values())

    def stats(self) -> QueueStats:
        free, reserved = self.free_slots, self.reserved
        return QueueStats(
            queued_by_band=tuple(b.count for b in self.bands),
            free_slots=free,
            free_by_band=usable_by_band(free, self.held_by_band(), reserved) if reserved else (),
            inflight_by_tenant=self.inflight_by_tenant() if self.quotas else {},
            queued_work_by_band=tuple(b.work for b in self.bands),
            started_at=tuple(self.running.values()),
            started_kinds=tuple(slot.kind for slot in self.running),
            fair_turns=tuple(b.turns(weight) for b in self.bands) if (weight := self.told_weights) else (),
            pinned_by_band=tuple(b.pinned_count for b in self.bands),
        )

    def work_ahead(self, band: int, tenant: str, slack: float) -> float:
        """The queued work handed slots before a new request of `band` and `tenant`, as
        QueueStats.work_ahead counts it."""
        urgent = sum(b.work for b in self.bands[:band])
        own, weight_of = self.bands[band], self.weight_of
        return urgent + (own.work if weight_of is None else own.work_ahead(tenant, weight_of, slack))

    def only_pinned_ahead(self, band: int) -> bool:
        """Whether every request waiting in `band` and the more urgent ones is a pinned sequence's."""
        return all(b.count == b.pinned_count for b in self.bands[: band + 1])

    def arriving_ahead(self, band: int, tenant: str, slack: float, reach: Mapping[str, float]) -> float:
        """What the band's other flows will still send ahead of a new request of `band` and
        `tenant`, each at most its `reach`, as QueueStats.arriving_ahead counts it."""
        if (weight_of := self.told_weights) is None:
            return 0.0
        return self.bands[band].arriving_ahead(tenant, weight_of, slack, reach)

    @property
    def total_slots(self) -> int:
        return sum(c.max_concurrency for c in self.capacity if c.ready)

    def usable(self, band: int) -> int:
        """The free slots a request of `band` may take."""
        free = self.free_slots
        if not (reserved := self.reserved):
            return free
        return usable_free_slots(band, free, self.held_by_band(), reserved)

    def may_start(self, tenant: str, cost: float) -> bool:
        """Whether the tenant's quota, or what it may borrow, lets a request of `cost` start now."""
        quotas = self.quota_state()
        every_head = (head for band in range(len(self.bands)) for head in self.heads(band))
        return quotas is None or quotas.allows(tenant, cost, every_head)

    def quota_state(self) -> QuotaState | None:
        """What dispatch reads of the quotas now; None without quotas."""
        if not self.quotas:
            return None
        inflight = self.inflight_by_tenant()
        return QuotaState(self.quotas, inflight, self.total_slots, self.estimates.handover_cost)

    def inflight_by_tenant(self) -> dict[str, float]:
        inflight: dict[str, float] = {}
        for slot in self.running:
            inflight[slot.tenant] = inflight.get(slot.tenant, 0.0) + slot.cost
        return inflight

    def heads(self, band: int) -> list[Head]:
        """The live head of each of `band`'s flows (withdrawn tickets dropped on the way), scored
        by its start tag in fair queuing, by its heap's score (the deadline) under EDF."""
        queue = self.bands[band]
        if self.weight_of is not None:
            return [
                Head(start, queue.flows[tenant][0][1], tenant, ticket.cost)
                for tenant, (ticket, start) in queue.heads.items()
            ]
        return [
            Head(heap[0][0], heap[0][1], tenant, heap[0][2].cost)
            for tenant, heap in queue.flows.items()
            if clean_head(heap, self.live)
        ]

    def room_for(self, band: int, cost: float) -> bool:
        """Whether `cost` more work of `band` fits under the model's queue cap, displacing (429
        displaced) requests of less urgent bands as policies.displacement.cap_victims picks them
        if that makes it fit; nothing is displaced when even that would not."""
        cap = self.pool.max_queued_work
        excess = sum(b.work for b in self.bands) + cost - cap if cap is not None else 0.0
        if excess <= 0:
            return True
        tickets: list[Ticket] = []
        candidates: list[Queued] = []
        for index in range(band + 1, len(self.bands)):
            for tenant, heap in self.bands[index].flows.items():
                borrower = bool(self.quotas) and tenant not in self.quotas
                for score, sequence, ticket in heap:
                    if ticket in self.live:
                        tickets.append(ticket)
                        candidates.append(Queued(index, borrower, score, sequence, ticket.cost))
        victims = [tickets[i] for i in cap_victims(candidates, band, excess)]
        if not victims:
            return False
        for ticket in victims:
            self.remove(ticket)
            ticket.interrupt(Outcome.DISPLACED)
        return True

    def displace_overdue(
        self,
        band: int,
        now: float,
        handovers_per_s: float,
        service_cv: float,
        in_arrival_order: bool,
        reclaim: bool = False,
    ) -> None:
        """Tell the queued requests of bands less urgent than `band` (and, on an owner's arrival
        that `reclaim`s its quota, the borrowers' of every band) that can no longer get a slot by
        their leave-by time (policies.displacement) at once: 429 displaced. The newest
        `OVERDUE_CHECKED` of each flow are checked, where a new urgent arrival bites first."""
        victims: list[Ticket] = []
        owners = self._owners_ahead() if self.quotas else None
        for index in range(0 if reclaim else band + 1, len(self.bands)):
            lower = self.bands[index]
            if not lower.count:
                continue
            urgent = sum(b.count for b in self.bands[:index])
            for tenant, arrivals in lower.arrivals.items():
                borrower = owners is not None and tenant not in self.quotas
                if index <= band and not borrower:
                    continue
                newest = list(itertools.islice(reversed(arrivals), OVERDUE_CHECKED))
                found = overdue_in_flow(
                    now,
                    urgent + (owners[index] if owners is not None and borrower else 0.0),
                    len(arrivals),
                    ((t.leave_by, requests_per_handover(_batch_max(t))) for t in newest),
                    handovers_per_s,
                    service_cv,
                    in_arrival_order=in_arrival_order,
                )
                victims += (newest[i] for i in found)
        for ticket in victims:
            self.remove(ticket)
            ticket.overdue = True
            ticket.interrupt(Outcome.DISPLACED)

    def reclaims(self, tenant: str, cost: float) -> bool:
        """Whether a request of `tenant` and `cost` would run within its quota: an owner whose
        queued work holds borrowers back."""
        return bool(self.quotas) and under_quota(tenant, cost, self.inflight_by_tenant(), self.quotas)

    def _owners_ahead(self) -> list[float]:
        inflight = self.inflight_by_tenant()
        owners = (
            (
                max(0.0, q.nominal - inflight.get(owner, 0.0)),
                [(b.queued.get(owner, 0.0), len(b.arrivals.get(owner, ()))) for b in self.bands],
            )
            for owner, q in self.quotas.items()
        )
        return owners_ahead(owners, len(self.bands))

    def held_by_band(self) -> list[int]:
        held = [0] * len(self.bands)
        for slot in self.running:
            held[slot.band] += 1
        return held

    def take(
        self, index: int, cost: float, flow: Flow, batch: tuple[Ticket, ...] = (), kind: str = ""
    ) -> Slot:
        self.counters.count_granted(flow.band, flow.tenant, cost)
        capacity = self.capacity[index]
        capacity.inflight += 1
        capacity.backend.inflight += 1  # the gateway-wide count of slots held, for metrics
        slot = Slot(self.pool.name, capacity.backend, cost, flow.band, flow.tenant, batch=batch, kind=kind)
        return self.running_since(slot)

    def running_since(self, slot: Slot) -> Slot:
        self.running[slot] = self.clock()
        return slot

    def joins(self, flow: Flow) -> None:
        """An admitted request of `flow`, queued or granted at once: under fair queuing its weight
        counts in the others' turns from now on (policies.fairness.arrivals_in_turn)."""
        if self.weight_of is not None:
            self.bands[flow.band].weights[flow.tenant] = self.weight_of(flow.tenant)

    def insert(self, ticket: Ticket, rank: float, sequence: int) -> None:
        """Queue `ticket` in its flow's heap at `rank` (its deadline under EDF; in fair queuing
        the same for all, so that its flow is first come, first served by `sequence`)."""
        band = self.bands[ticket.band]
        tenant = ticket.flow.tenant
        if ticket.backend is None:
            heapq.heappush(band.flows.setdefault(tenant, []), (rank, sequence, ticket))
        else:  # pinned: waits apart, for its backend's slot (gateway/queues/memory/pins.py)
            band.pinned.append(ticket)
            band.pinned_count += 1
        band.count += 1
        band.work += ticket.cost
        band.queued[tenant] = band.queued.get(tenant, 0.0) + ticket.cost
        if ticket.backend is None:  # a pinned one waits on its backend, not on the pool's pace
            band.arrivals.setdefault(tenant, {})[ticket] = None
        self.live.add(ticket)
        if self.weight_of is not None:
            band.weights[tenant] = self.weight_of(tenant)  # an adopted ticket joins here
            band.follow_head(tenant, self.live)

    def remove(self, ticket: Ticket) -> bool:
        """Take a queued ticket out (withdrawn, expired, displaced); False when it was not queued.
        Its flow's next request becomes the head, tagged as it does."""
        if not self._forget(ticket):
            return False
        band, tenant = self.bands[ticket.band], ticket.flow.tenant
        if self.weight_of is not None and (head := band.heads.get(tenant)) is not None and head[0] is ticket:
            band.follow_head(tenant, self.live)
        return True

    def _forget(self, ticket: Ticket) -> bool:
        if ticket not in self.live:
            return False
        self.live.discard(ticket)
        band = self.bands[ticket.band]
        band.count -= 1
        if ticket.backend is not None:
            band.pinned_count -= 1
        band.work = band.work - ticket.cost if band.count else 0.0  # no float residue when empty
        tenant = ticket.flow.tenant
        left = band.queued.pop(tenant, 0.0) - ticket.cost
        if left > 1e-9 * max(1.0, ticket.cost) and band.count:
            band.queued[tenant] = left
        arrivals = band.arrivals.get(tenant)
        if arrivals is not None:
            arrivals.pop(ticket, None)
            if not arrivals:
                del band.arrivals[tenant]
        if not self.live:
            self.backlogged_handover_at = None
        heap = band.flows.get(ticket.flow.tenant)
        if heap is not None and len(heap) > 64 and len(heap) > 4 * band.count:
            heap[:] = [entry for entry in heap if entry[2] in self.live]
            heapq.heapify(heap)
        return True

    def pop_next(self) -> list[Ticket]:
        """The next tickets to get a slot, removed from the queue: the head policies.dispatch picks
        (most urgent band, lowest head score, quotas and reservations), and the batch it leads; or
        a request of a sequence whose backend has a slot free (policies.sequences)."""
        found = next_flow(
            [band.count for band in self.bands],
            self.heads,
            self.usable if self.reserved else None,
            self.quota_state(),
        )
        pinned = next_pinned(self.bands, self.live, self.capacity, self.usable, self.may_start)
        if pinned is not None and pinned_goes_first(pinned[0], found):
            self.bands[pinned[0]].pinned.remove(pinned[1])
            self._forget(pinned[1])
            return [pinned[1]]
        if found is None:
            return []
        index, head = found
        band = self.bands[index]
        heap = band.flows[head.tenant]
        _, _, leader = heapq.heappop(heap)
        self._forget(leader)
        taken = [leader]
        if leader.batching is not None:
            for follower in batch_behind(heap, self.live, leader.batching, leader.cost):
                self._forget(follower)
                taken.append(follower)
        if self.weight_of is not None:
            band.handed(head.tenant, taken)
            band.follow_head(head.tenant, self.live)
        elif not heap:
            del band.flows[head.tenant]
        return taken


def _batch_max(ticket: Ticket) -> float | None:
    return ticket.batching.max_cost if ticket.batching is not None else None
