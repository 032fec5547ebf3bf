"""Batches held for companions on this replica, while a slot is free (policies.batching).

Per flow and merge key it keeps the batch being formed: when its oldest member arrived, the items
queued in it, and the time by which its most urgent member must be granted. An arrival asks
`decide` whether its batch waits (its offer is then held: queued though a slot is free) or leaves
now (its offer is not held, and the store's dispatch hands the slot to the batch, this arrival
included). A held batch is let go by a timer when its wait is up (`RequestQueue.dispatch_held`);
anything else that dispatches (a release, an offer of another flow) may take it earlier.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from gateway.queues.base import Batching, Flow, Granted, Offer, Queued, RequestQueue, Ticket
from policies.batching import BatchLimits, FormingBatch, hold_s


@dataclass(slots=True)
class _Forming:
    head: Ticket
    since: float
    items: float
    leave_by: float
    release_at: float
    timer: asyncio.TimerHandle


class BatchHolds:
    def __init__(self, store: RequestQueue, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock
        self._forming: dict[tuple[Flow, str], _Forming] = {}
        self._let_go_by_offer: set[tuple[Flow, str]] = set()
        """Batches let go for an arrival's offer to take: one it refuses dispatches nothing."""

    def decide(
        self, flow: Flow, batching: Batching, cost: float, leave_by: float, free_slots: int
    ) -> Batching:
        """`batching` as the request should be offered: held while its batch waits for companions."""
        if batching.max_delay_s <= 0 or free_slots == 0:
            return batching  # no wait configured, or a queue that batches by itself
        forming = self._current(flow, batching.key)
        now = self._clock()
        batch = FormingBatch(
            items=cost + (forming.items if forming else 0.0),
            head_age_s=now - forming.since if forming else 0.0,
            free_slots=free_slots,
            slack_s=min(leave_by, forming.leave_by if forming else leave_by) - now,
        )
        limits = BatchLimits(int(batching.max_cost), batching.max_delay_s, batching.preferred_sizes)
        wait_s = hold_s(limits, batch)
        if wait_s <= 0:
            if forming is not None:
                self._let_go(flow, batching.key)  # this offer's dispatch takes it (see `offering`)
                self._let_go_by_offer.add((flow, batching.key))
            return batching
        return replace(batching, hold=True)

    async def offering(self, flow: Flow, batching: Batching, offer: Awaitable[Offer]) -> Offer:
        """Make the offer of an arrival `decide` was asked about. If `decide` let a held batch go
        for it and it dispatches nothing (refused, or failed), the batch's timer is cancelled: it is
        dispatched now."""
        let_go = (flow, batching.key) in self._let_go_by_offer
        self._let_go_by_offer.discard((flow, batching.key))
        dispatched = False
        try:
            made = await offer
            dispatched = isinstance(made, Granted | Queued)
            return made
        finally:
            if let_go and not dispatched:
                self._store.dispatch_held(flow.model)

    def held(self, ticket: Ticket, batching: Batching, leave_by: float) -> None:
        """`ticket` was queued held: it joins its batch (or starts one), which leaves by its wait's end."""
        key = (ticket.flow, batching.key)
        now = self._clock()
        forming = self._current(ticket.flow, batching.key)
        if forming is None:
            release_at = now + min(batching.max_delay_s, max(0.0, leave_by - now))
            timer = self._timer(key, release_at)
            self._forming[key] = _Forming(ticket, now, ticket.cost, leave_by, release_at, timer)
            return
        forming.items += ticket.cost
        if leave_by < forming.leave_by:
            forming.leave_by = leave_by
            if leave_by < forming.release_at:  # its most urgent member is more urgent now
                forming.timer.cancel()
                forming.release_at = max(now, leave_by)
                forming.timer = self._timer(key, forming.release_at)

    def _current(self, flow: Flow, key: str) -> _Forming | None:
        forming = self._forming.get((flow, key))
        if forming is not None and forming.head.wakeup.done():
            # Its head left (granted, or gone): a new batch forms. The timer stays, for whatever
            # of the old one may still be held.
            del self._forming[(flow, key)]
            return None
        return forming

    def _timer(self, key: tuple[Flow, str], at: float) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(max(0.0, at - self._clock()), self._expired, key)

    def _expired(self, key: tuple[Flow, str]) -> None:
        self._forming.pop(key, None)
        self._store.dispatch_held(key[0].model)

    def _let_go(self, flow: Flow, key: str) -> None:
        forming = self._forming.pop((flow, key), None)
        if forming is not None:
            forming.timer.cancel()
