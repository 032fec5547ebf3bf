"""One band's waiting tickets in the memory store: a heap per flow (tenant) by score, the live
count and work, and the band's fair-queuing clock (policies.fairness)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gateway.queues.base import Ticket
from policies.fairness import FairTurns, tags, work_ahead_in_turn, work_arriving_in_turn

HeapEntry = tuple[float, int, Ticket]


@dataclass(slots=True, eq=False)
class BandQueue:
    """One band's waiting tickets: a heap per flow (by tenant), and the live count and work; and
    its fair-queuing clock (policies.fairness): the virtual time and each flow's finish tag."""

    flows: dict[str, list[HeapEntry]] = field(default_factory=dict)
    count: int = 0
    work: float = 0.0
    queued: dict[str, float] = field(default_factory=dict)
    """Each backlogged flow's live work."""
    arrivals: dict[str, dict[Ticket, None]] = field(default_factory=dict)
    """Each backlogged flow's live tickets in the order they were queued (policies.displacement)."""
    virtual_time: float = 0.0
    finish: dict[str, float] = field(default_factory=dict)

    def fair_start(self, tenant: str, cost: float, weight: float) -> float:
        """The start tag of a request of `cost` joining `tenant`'s flow, which moves its finish tag."""
        tagged = tags(self.virtual_time, self.finish.get(tenant, 0.0), cost, weight)
        self.finish[tenant] = tagged.finish
        return tagged.start

    def work_ahead(self, tenant: str, weight_of: Callable[[str], float], slack: float) -> float:
        """policies.fairness.work_ahead_in_turn for a request of `tenant` joining now."""
        if not self.queued:
            return 0.0
        others = ((work, weight_of(name)) for name, work in self.queued.items() if name != tenant)
        own_finish = self.finish.get(tenant, self.virtual_time)
        return work_ahead_in_turn(self.virtual_time, own_finish, self.queued.get(tenant, 0.0), others, slack)

    def arriving_ahead(
        self, tenant: str, weight_of: Callable[[str], float], slack: float, reach: Mapping[str, float]
    ) -> float:
        """policies.fairness.arrivals_in_turn for a request of `tenant` joining now, as `turns`
        tells the band (a flow that has not queued weighs 1)."""
        if not self.queued:
            return 0.0
        finish = self.finish
        others = (
            (self.queued.get(name, 0.0), weight_of(name) if name in finish else 1.0, most)
            for name, most in reach.items()
            if name != tenant
        )
        return work_arriving_in_turn(self.virtual_time, finish.get(tenant, self.virtual_time), others, slack)

    def turns(self, weight_of: Callable[[str], float]) -> FairTurns | None:
        """The band's fair queuing as admission reads it (QueueStats.fair_turns); None while
        nothing waits."""
        if not self.queued:
            return None
        # Every flow that has queued, backlogged or not (policies.fairness.arrivals_in_turn).
        weights = {name: weight_of(name) for name in self.finish}
        return FairTurns(self.virtual_time, dict(self.finish), dict(self.queued), weights)
