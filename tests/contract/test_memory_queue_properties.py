"""Stateful property test of the in-memory store: any sequence of offers, releases and withdrawals
keeps slot counts exact, never grants past a more urgent or an older waiter, leaves no slot idle
while someone waits, and displaces only less urgent work than the arrival that pushed it back."""

import asyncio
import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gateway.queues.base import Flow, Granted, Queued, Slot
from gateway.queues.memory.store import MemoryQueue
from gateway.settings import Estimation
from policies.outcomes import Outcome
from tests.contract.conftest import MODEL, make_pool

BANDS = 3


class MemoryQueueMachine(RuleBasedStateMachine):
    @initialize(slots=st.lists(st.integers(1, 3), min_size=1, max_size=3))
    def start(self, slots):
        self.loop = asyncio.new_event_loop()
        self.pool = make_pool(tuple(slots))
        self.store = MemoryQueue([self.pool], BANDS, Estimation(), loop_factory=lambda: self.loop)
        self.held: list[Slot] = []
        self.waiting: list = []  # (band, arrival, ticket) not yet granted or withdrawn
        self.clock = itertools.count()

    def teardown(self):
        if hasattr(self, "loop"):
            self.loop.close()

    def _collect_grants(self, before: list) -> None:
        """Move newly granted tickets to `held`, checking each was next in line."""
        granted = [w for w in before if w[2].wakeup.done() and isinstance(w[2].wakeup.result(), Slot)]
        still = [w for w in before if not w[2].wakeup.done()]
        for entry in granted:
            for other in still:
                assert other[:2] > entry[:2], "priority or FIFO inverted"
            self.held.append(entry[2].wakeup.result())
        self.waiting = still

    @rule(band=st.integers(0, BANDS - 1))
    def offer(self, band):
        arrival = float(next(self.clock))
        offer = self.store.offer_nowait(Flow(MODEL, band), 1.0, 30.0, 10**9, now=arrival)
        if isinstance(offer, Granted):
            assert not any(w[0] <= band for w in self.waiting), "granted past a waiting request"
            self.held.append(offer.slot)
        else:
            assert isinstance(offer, Queued)
            # Its arrival may push less urgent work past its allowance: displaced at once, and
            # never work as urgent as it (policies.displacement).
            told = [w for w in self.waiting if w[2].wakeup.done()]
            for entry in told:
                assert entry[2].wakeup.result() is Outcome.DISPLACED and entry[2].overdue
                assert entry[0] > band, "displaced work as urgent as the arrival"
            self.waiting = [w for w in self.waiting if w not in told]
            self.waiting.append((band, arrival, offer.ticket))

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 100))
    def release(self, index):
        slot = self.held.pop(index % len(self.held))
        before = list(self.waiting)
        self.store.release_nowait(slot, now=float(next(self.clock)))
        self.store.release_nowait(slot, now=float(next(self.clock)))  # idempotent
        self._collect_grants(before)

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 100))
    def withdraw(self, index):
        ticket = self.waiting.pop(index % len(self.waiting))[2]
        self.store.withdraw_nowait(ticket, Outcome.CLIENT_DISCONNECTED)
        assert ticket.wakeup.result() is Outcome.CLIENT_DISCONNECTED

    @invariant()
    def slot_counts_are_exact(self):
        if not hasattr(self, "store"):
            return
        for backend in self.pool.backends:
            assert 0 <= backend.inflight <= backend.max_concurrency
        assert sum(b.inflight for b in self.pool.backends) == len(self.held)

    @invariant()
    def queue_depth_matches_waiters(self):
        if not hasattr(self, "store"):
            return
        stats = self.store.stats(MODEL)
        assert stats.queued_by_band == tuple(sum(w[0] == b for w in self.waiting) for b in range(BANDS))
        if self.waiting:
            assert stats.free_slots == 0, "a slot idles while a request waits"


MemoryQueueMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestMemoryQueue = MemoryQueueMachine.TestCase
