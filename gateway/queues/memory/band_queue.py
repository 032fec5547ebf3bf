"""One band's waiting tickets in the memory store: a heap per flow (tenant) by score, the live
count and work, and the band's fair-queuing clock (policies.fairness): the flows' heads' start
tags, taken as each becomes its flow's head."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gateway.queues.base import Batching, Ticket
from policies.fairness import (
    FairTurns,
    finish_after,
    head_start,
    joining_start,
    virtual_time_after,
    work_ahead_in_turn,
    work_arriving_in_turn,
)

HeapEntry = tuple[float, int, Ticket]


@dataclass(slots=True, eq=False)
class BandQueue:
    """One band's waiting tickets: a heap per flow (by tenant), and the live count and work; and
    its fair-queuing clock (policies.fairness): the virtual time, each flow's finish tag and its
    live head's start tag. Under EDF the heaps order by deadline and the clock stands still."""

    flows: dict[str, list[HeapEntry]] = field(default_factory=dict)
    count: int = 0
    work: float = 0.0
    queued: dict[str, float] = field(default_factory=dict)
    """Each backlogged flow's live work."""
    arrivals: dict[str, dict[Ticket, None]] = field(default_factory=dict)
    """Each backlogged flow's live tickets in the order they were queued (policies.displacement),
    pinned ones aside: they wait for one backend, not at the pool's pace, and are neither
    displaced as overdue nor counted in an owner's requests ahead (their leave-by still holds)."""
    virtual_time: float = 0.0
    finish: dict[str, float] = field(default_factory=dict)
    """Each flow's finish tag: moved only by work handed a slot."""
    heads: dict[str, tuple[Ticket, float]] = field(default_factory=dict)
    """Each backlogged flow's live head and its start tag."""
    weights: dict[str, float] = field(default_factory=dict)
    """The weight of each flow admitted, queued or granted at once (as the Redis store keeps them)."""
    pinned_count: int = 0
    """The live tickets of `pinned`."""
    pinned: list[Ticket] = field(default_factory=list)
    """Requests of sequences, each waiting for its backend's slot, in arrival order (withdrawn ones
    dropped as they are met). Counted in the band's count, work and flows' queued work, not in
    the flows' heaps: a request pinned to a busy backend holds back no request behind it."""

    def follow_head(self, tenant: str, live: set[Ticket]) -> None:
        """Drop withdrawn tickets off the top of `tenant`'s heap (lazy deletion) and tag its live
        head if it has just become the head; forget the flow once it is empty."""
        heap = self.flows.get(tenant)
        while heap and heap[0][2] not in live:
            heapq.heappop(heap)
        if not heap:
            self.flows.pop(tenant, None)
            self.heads.pop(tenant, None)
            return
        ticket = heap[0][2]
        known = self.heads.get(tenant)
        if known is None or known[0] is not ticket:
            self.heads[tenant] = (ticket, head_start(self.virtual_time, self.finish.get(tenant, 0.0)))

    def handed(self, tenant: str, tickets: list[Ticket]) -> None:
        """`tenant`'s head, and the batch it leads, were handed a slot: the clock moves on."""
        start = self.heads[tenant][1]
        self.virtual_time = virtual_time_after(self.virtual_time, start)
        finish, weight = start, self.weights[tenant]
        for ticket in tickets:
            finish = finish_after(finish, ticket.cost, weight)
        self.finish[tenant] = finish

    def joining_start(self, tenant: str) -> float:
        """policies.fairness.joining_start for `tenant`'s flow."""
        head = self.heads.get(tenant)
        return joining_start(
            self.virtual_time,
            self.finish.get(tenant, 0.0),
            head[1] if head is not None else None,
            self.queued.get(tenant, 0.0),
            self.weights.get(tenant, 1.0),
        )

    def work_ahead(self, tenant: str, weight_of: Callable[[str], float], slack: float) -> float:
        """policies.fairness.work_ahead_in_turn for a request of `tenant` joining now."""
        if not self.queued:
            return 0.0
        others = ((work, weight_of(name)) for name, work in self.queued.items() if name != tenant)
        own_queued = self.queued.get(tenant, 0.0)
        return work_ahead_in_turn(self.virtual_time, self.joining_start(tenant), own_queued, others, slack)

    def arriving_ahead(
        self, tenant: str, weight_of: Callable[[str], float], slack: float, reach: Mapping[str, float]
    ) -> float:
        """policies.fairness.arrivals_in_turn for a request of `tenant` joining now, as `turns`
        tells the band (a flow never admitted weighs 1)."""
        if not self.queued:
            return 0.0
        others = (
            (self.queued.get(name, 0.0), weight_of(name) if name in self.weights else 1.0, most)
            for name, most in reach.items()
            if name != tenant
        )
        return work_arriving_in_turn(self.virtual_time, self.joining_start(tenant), others, slack)

    def turns(self, weight_of: Callable[[str], float]) -> FairTurns | None:
        """The band's fair queuing as admission reads it (QueueStats.fair_turns); None while
        nothing waits."""
        if not self.queued:
            return None
        # Every flow admitted, backlogged or not (policies.fairness.arrivals_in_turn).
        weights = {name: weight_of(name) for name in self.weights}
        finish = {name: self.joining_start(name) for name in self.weights}
        return FairTurns(self.virtual_time, finish, dict(self.queued), weights)


def clean_head(heap: list[HeapEntry], live: set[Ticket]) -> bool:
    """Drop withdrawn tickets off the heap's top; True when a live one is left."""
    while heap and heap[0][2] not in live:
        heapq.heappop(heap)
    return bool(heap)


def batch_behind(heap: list[HeapEntry], live: set[Ticket], batching: Batching, cost: float) -> list[Ticket]:
    """The tickets behind a batch's leader of `cost` that join its batch, popped off `heap`."""
    followers: list[Ticket] = []
    while clean_head(heap, live):
        ticket = heap[0][2]
        if ticket.batching is None or ticket.batching.key != batching.key:
            break
        if cost + ticket.cost > batching.max_cost:
            break
        heapq.heappop(heap)
        followers.append(ticket)
        cost += ticket.cost
    return followers
