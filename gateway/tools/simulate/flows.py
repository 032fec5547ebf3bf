"""The simulator's queued flows: one heap per (band, tenant) in arrival order, its head tagged as it
becomes the head (policies.fairness), as in the memory store, and the heads policies.dispatch picks
among."""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.tools.simulate.tally import FlowTally
from policies.dispatch import Head
from policies.fairness import head_start

# A queued request: (0, arrival number, arrived at, cost, service_s, its flow, measured).
# A plain tuple: the heap orders it by its first two fields, which never tie (the first is the
# memory store's ordering score, which fair queuing leaves at 0).
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
    admitted: bool = False
    """Whether a request of it was ever admitted: its weight counts in the others' turns."""
    head: int = -1
    """Its live head's arrival number, -1 before it ever queued."""
    head_start: float = 0.0
    """Its live head's start tag."""
    queued: float = 0.0
    """Its live queued work (expired requests still in the heap do not count)."""
    heap: list[Entry] = field(default_factory=list)
    live: dict[int, float] = field(default_factory=dict)
    """Its queued requests that can leave before their turn (expire, or be displaced): arrival
    number -> leave-by time, in arrival order (the newest are where displacement looks)."""
    siblings: dict[str, Flow] = field(default_factory=dict)
    """Its band's flows, itself included (tenant -> flow)."""


def new_flow(flows: dict[str, Flow], band: int, tenant: str, weights: Mapping[str, float]) -> Flow:
    flow = flows[tenant] = Flow(band, tenant, weights.get(tenant, 1.0), FlowTally(), siblings=flows)
    return flow


def follow_head(flow: Flow, gone: set[int], virtual_time: float) -> None:
    """Drop the requests that left `flow` off its heap's top (lazy deletion), and tag its live head
    if it has just become the head, in a band whose virtual time is `virtual_time`."""
    heap = flow.heap
    while heap and heap[0][1] in gone:
        gone.discard(heapq.heappop(heap)[1])
    if heap and heap[0][1] != flow.head:
        flow.head = heap[0][1]
        flow.head_start = head_start(virtual_time, flow.finish)


def band_heads(active: list[dict[str, Flow]], vtime: list[float], gone: set[int], band: int) -> list[Head]:
    """The live head of each of the band's flows, as policies.dispatch reads them; flows left empty
    are taken off the band's active ones. (On every hand-over: one pass, no copy of the band's
    flows unless one empties.)"""
    band_flows = active[band]
    heads: list[Head] = []
    emptied: list[str] = []
    for tenant, flow in band_flows.items():
        follow_head(flow, gone, vtime[band])
        if flow.heap:
            heads.append(Head(flow.head_start, flow.head, tenant, flow.heap[0][3]))
        else:
            emptied.append(tenant)
    for tenant in emptied:
        del band_flows[tenant]
    return heads


def every_head(active: list[dict[str, Flow]], vtime: list[float], gone: set[int]) -> list[Head]:
    """The live head of every queued flow."""
    return [head for band in range(len(active)) for head in band_heads(active, vtime, gone, band)]
