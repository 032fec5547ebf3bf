"""Which queued request gets a slot that frees? One decision, read by the memory store
(gateway/queues/memory/model_queue.py) and the simulator (gateway/tools/simulate/engine.py) alike.

- Strict priority between bands: the most urgent band with work waiting. A request never waits
  behind a less urgent one.
- A reservation (policies.reservations) that leaves the band no usable slot keeps the slot from it,
  and so from every less urgent band: nothing is handed over.
- Within the band, fair queuing: the flow whose live head has the lowest (score, arrival number).
  The score is its start tag (policies.fairness), or its deadline under EDF.
- With quotas (policies.quotas), the lowest head whose tenant may start now; while an owner under
  its quota waits (its head in any band), no new borrowing starts. A band whose every head is held
  back by quotas lets a less urgent band take the slot.
- A request of a sequence (policies.sequences) waits apart for its backend's slot: when that
  backend has one free, it goes first if its band is at least as urgent as the head above would
  be (strict priority kept; within its band a sequence's next request does not wait its turn).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from policies.quotas import Quota, may_start, owner_waiting


class Head(NamedTuple):
    """A flow's live head, as dispatch reads it. Heads compare by (score, sequence): arrival
    numbers are unique, so the tenant and cost never decide an order."""

    score: float
    sequence: int
    tenant: str
    cost: float


@dataclass(frozen=True, slots=True)
class QuotaState:
    """What quotas read: the quotas, each tenant's work in flight, the pool's slots and the work a
    slot takes (policies.quotas.work_capacity)."""

    quotas: Mapping[str, Quota]
    inflight: Mapping[str, float]
    slots: int
    work_per_slot: float = 1.0

    def allows(self, tenant: str, cost: float, waiting_heads: Iterable[Head]) -> bool:
        """Whether a request of `tenant` and `cost` may start now, with `waiting_heads` the live
        heads of every queued flow (an owner among them under its quota stops new borrowing)."""
        waiting = owner_waiting(((h.tenant, h.cost) for h in waiting_heads), self.inflight, self.quotas)
        return self.starts(tenant, cost, waiting)

    def starts(self, tenant: str, cost: float, owner_waits: bool) -> bool:
        """policies.quotas.may_start, with whether an owner waits already known."""
        inflight, per_slot = self.inflight, self.work_per_slot
        return may_start(tenant, cost, inflight, self.quotas, self.slots, per_slot, owner_waits)


def next_flow(
    queued_by_band: Sequence[int],
    heads: Callable[[int], Iterable[Head]],
    usable: Callable[[int], int] | None = None,
    quotas: QuotaState | None = None,
) -> tuple[int, Head] | None:
    """The band and the flow head a free slot goes to; None when nothing may take it.

    `queued_by_band` is the live count of each band, most urgent first; `heads(band)` the live
    head of each of the band's flows; `usable(band)` the free slots the band may take after the
    more urgent classes' reservations (None: no reservations); `quotas` None when none are set.
    """
    by_band: list[list[Head]] = []
    waiting = False
    if quotas is not None:
        by_band = [list(heads(band)) if depth else [] for band, depth in enumerate(queued_by_band)]
        waiting = owner_waiting(
            ((h.tenant, h.cost) for band in by_band for h in band), quotas.inflight, quotas.quotas
        )
    for band, depth in enumerate(queued_by_band):
        if not depth:
            continue
        if usable is not None and usable(band) <= 0:
            return None  # kept for a more urgent class, and so from every less urgent one
        if quotas is None:
            head = min(heads(band), default=None)
            if head is not None:
                return band, head
            continue
        for head in sorted(by_band[band]):
            if quotas.starts(head.tenant, head.cost, waiting):
                return band, head
    return None


def pinned_goes_first(pinned_band: int, found: tuple[int, Head] | None) -> bool:
    """Whether a sequence's request, of `pinned_band`, whose backend has a slot free, takes it
    before the head `next_flow` found (None: none may take a slot)."""
    return found is None or pinned_band <= found[0]
