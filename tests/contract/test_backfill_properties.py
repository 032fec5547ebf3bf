"""Backfill, as a stateful property of the in-memory store with quotas.

In a pool of slots a request never needs more capacity than one free slot, so the only head that
cannot start while slots are free is one its tenant's quota holds back (at its quota and unable to
borrow, or a borrower while an owner waits). Then the requests behind it, of other flows and less
urgent bands, start on the free slots (backfill). The guarantee: the head is never delayed by
them. A held head can become startable only when work in flight ends (its own, or an owner's whose
unused quota it may then borrow), and that ending frees a slot; the dispatch on that release goes
to the head first. So after any release, the head in dispatch order either has the slot or may
still not start; and no slot is idle while a flow's head that may start waits.
"""

from __future__ import annotations

import asyncio
import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gateway.queues.base import Flow, Granted, Queued, Slot, Ticket
from gateway.queues.memory.model_queue import ModelQueue
from gateway.queues.memory.store import MemoryQueue
from gateway.settings import Estimation
from policies.outcomes import Outcome
from policies.quotas import Quota, may_start, under_quota
from tests.contract.conftest import MODEL, make_pool

BANDS = 2
# a: a hard quota of 2 (a request of cost 2 waits for all of its own to end); b: a quota of 1
# that may borrow; c: no quota, it runs only on what is lent.
QUOTAS = {"a": Quota(2.0, borrowing_limit=0.0), "b": Quota(1.0)}


class BackfillMachine(RuleBasedStateMachine):
    @initialize(slots=st.lists(st.integers(1, 3), min_size=1, max_size=2))
    def start(self, slots):
        self.loop = asyncio.new_event_loop()
        self.store = MemoryQueue(
            [make_pool(tuple(slots))], BANDS, Estimation(), quotas=QUOTAS, loop_factory=lambda: self.loop
        )
        self.held: list[Slot] = []
        self.waiting: list[Ticket] = []
        self.clock = itertools.count()

    def teardown(self):
        if hasattr(self, "loop"):
            self.loop.close()

    @property
    def queue(self) -> ModelQueue:
        return self.store._models[MODEL]

    def heads(self) -> list[tuple[int, tuple[float, int], Ticket]]:
        """Each flow's live head: (band, its key in dispatch order, the ticket)."""
        found = []
        for index, band in enumerate(self.queue.bands):
            for head in self.queue.heads(index):
                ticket = band.flows[head.tenant][0][2]
                assert ticket in self.queue.live
                found.append((index, (head.score, head.sequence), ticket))
        return found

    def first_in_line(self) -> Ticket | None:
        heads = self.heads()
        return min(heads, key=lambda head: head[:2])[2] if heads else None

    def collect(self) -> None:
        for ticket in [t for t in self.waiting if t.wakeup.done()]:
            self.waiting.remove(ticket)
            if isinstance(slot := ticket.wakeup.result(), Slot):
                self.held.append(slot)

    @rule(band=st.integers(0, BANDS - 1), tenant=st.sampled_from("abc"), cost=st.sampled_from([1.0, 2.0]))
    def offer(self, band, tenant, cost):
        flow, now = Flow(MODEL, band, tenant), float(next(self.clock))
        offer = self.store.offer_nowait(flow, cost, 30.0, 1e9, now=now)
        if isinstance(offer, Granted):
            self.held.append(offer.slot)
        else:
            assert isinstance(offer, Queued)
            self.waiting.append(offer.ticket)
        self.collect()

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 100))
    def release(self, index):
        slot = self.held.pop(index % len(self.held))
        head = self.first_in_line()
        # What the quotas allow on the slot this release frees, before anything takes it.
        inflight = self.queue.inflight_by_tenant()
        inflight[slot.tenant] -= slot.cost
        heads = [ticket for _, _, ticket in self.heads()]
        owner_waiting = any(under_quota(t.flow.tenant, t.cost, inflight, QUOTAS) for t in heads)
        self.store.release_nowait(slot, now=float(next(self.clock)))
        self.collect()
        if head is not None and not head.wakeup.done():
            # Not delayed by what backfilled while it was held: had its quota let it start on the
            # freed slot, it would have had it.
            total, per_slot = self.queue.total_slots, self.queue.estimates.handover_cost
            assert not may_start(
                head.flow.tenant, head.cost, inflight, QUOTAS, total, per_slot, owner_waiting
            )

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 100))
    def withdraw(self, index):
        ticket = self.waiting.pop(index % len(self.waiting))
        self.store.withdraw_nowait(ticket, Outcome.CLIENT_DISCONNECTED)
        self.collect()

    @invariant()
    def no_slot_idles_while_a_head_that_may_start_waits(self):
        if not hasattr(self, "store") or self.queue.free_slots == 0:
            return
        for _, _, ticket in self.heads():
            assert not self.queue.may_start(ticket.flow.tenant, ticket.cost), "a slot idles"

    @invariant()
    def quotas_hold(self):
        if not hasattr(self, "store"):
            return
        running = self.queue.inflight_by_tenant()
        assert running.get("a", 0.0) <= QUOTAS["a"].nominal


BackfillMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestBackfill = BackfillMachine.TestCase
