"""The simulator's queued flows: one heap per (band, tenant) on (start tag, arrival number), as in
the memory store, and how a free slot picks among them."""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.simulate.quota_book import QuotaBook
from gateway.simulate.tally import FlowTally
from policies.reservations import usable_free_slots

# A queued request: (start tag, arrival number, arrived at, cost, service_s, its flow, measured).
# A plain tuple: the heap orders it by its first two fields, which never tie.
Entry = tuple[float, int, float, float, float, "Flow", bool]


@dataclass(slots=True, eq=False)
class Flow:
    """One (band, tenant) flow's queue and fair-queuing state."""

    band: int
    tenant: str
    weight: float
    tally: FlowTally
    finish: float = 0.0
    """Its finish tag (policies.fairness)."""
    queued: float = 0.0
    """Its live queued work (expired requests still in the heap do not count)."""
    heap: list[Entry] = field(default_factory=list)
    siblings: dict[str, Flow] = field(default_factory=dict)
    """Its band's flows, itself included (tenant -> flow)."""


def new_flow(flows: dict[str, Flow], band: int, tenant: str, weights: Mapping[str, float]) -> Flow:
    flow = flows[tenant] = Flow(band, tenant, weights.get(tenant, 1.0), FlowTally(), siblings=flows)
    return flow


def lowest_head(band_flows: dict[str, Flow], gone: set[int]) -> Flow:
    """The flow whose live head has the lowest (start tag, arrival number)."""
    return min(live_flows(band_flows, gone), key=lambda flow: flow.heap[0][:2])


def live_flows(band_flows: dict[str, Flow], gone: set[int]) -> list[Flow]:
    """The band's flows with a live head; expired heads are dropped on the way, and flows left
    empty taken off the band's active ones."""
    live = []
    for tenant, flow in list(band_flows.items()):
        heap = flow.heap
        while heap and heap[0][1] in gone:
            gone.discard(heapq.heappop(heap)[1])
        if heap:
            live.append(flow)
        else:
            del band_flows[tenant]
    return live


def queued_heads(active: list[dict[str, Flow]], gone: set[int]) -> list[tuple[str, float]]:
    """(tenant, cost) of every queued flow's live head."""
    return [(flow.tenant, flow.heap[0][3]) for band_flows in active for flow in live_flows(band_flows, gone)]


def startable_head(
    active: list[dict[str, Flow]],
    depth: list[int],
    gone: set[int],
    book: QuotaBook,
    free: int,
    held: list[int],
    reserved: list[int],
) -> tuple[int, Flow] | None:
    """The band and flow a free slot goes to under quotas: in the most urgent band with a flow
    whose head may start now, the lowest such head; None when quotas hold back every head or a
    more urgent class's reservation keeps the slot."""
    heads = queued_heads(active, gone)
    for band, band_flows in enumerate(active):
        if not depth[band]:
            continue
        if reserved and usable_free_slots(band, free, held, reserved) <= 0:
            return None  # kept for a more urgent class, and so from every less urgent one
        for flow in sorted(live_flows(band_flows, gone), key=lambda flow: flow.heap[0][:2]):
            if book.may_start(flow.tenant, flow.heap[0][3], heads):
                return band, flow
    return None
