"""The Redis store makes the same decisions as the memory store, for the same operations on the
same clock: a hypothesis state machine drives both with offers of several flows and costs (batches
among them), releases, withdrawals and expiries, and time passing. The memory store is the oracle:
after every step both must have made the same grants (the same tickets, batched alike, on the same
backends) and must report the same queue statistics and the same raw counters, from which one
PoolEstimates computes the rates for either store.

Replica loss is Redis's alone (there is no second memory replica to lose) and has its own tests in
test_redis_replicas.py and tests/integration/test_shared_queue.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from redis.asyncio import Redis

from gateway.queues.base import Batching, Flow, Full, Granted, Offer, Queued, Slot
from gateway.queues.memory.store import MemoryQueue
from gateway.queues.redis.store import RedisQueue
from gateway.settings import Estimation
from gateway.upstream.backends import BackendState, ModelPool
from policies.ordering import Ordering
from policies.outcomes import Outcome
from policies.quotas import Quota
from policies.sequences import SequenceRef
from tests.redis_server import redis_url_or_skip, unique_prefix

pytestmark = pytest.mark.redis
MODEL = "m"
BANDS = 2
T = TypeVar("T")
# The mean work per hand-over stays 1 in both stores: their estimators observe the same totals at
# different moments, and admission decisions must not hang on that.
ESTIMATION = Estimation(handover_cost_weight=0.0)
UNLIMITED = 10.0**9
# What the other flows may send within an offer's allowance (policies.admission.offer_reach): the
# stores count what of it goes ahead of the offer's turn, each from its own state.
REACH = st.sampled_from([{}, {}, {"a": 2.0}, {"b": 4.5, "": 1.0}, {"a": 1.0, "b": 3.0, "": 0.5}])
# Requests of sequences (policies.sequences), pinned to their sequence's backend; most are of none.
S1, S2 = SequenceRef("s1"), SequenceRef("s2")
SEQUENCES = st.sampled_from(
    [None, None, None, S1, S1, S2, SequenceRef("s1", start=True), SequenceRef("s1", end=True)]
)


def pool(slots: tuple[int, ...]) -> ModelPool:
    backends = [
        BackendState(MODEL, f"http://127.0.0.1:{9000 + i}", n, "/v2/health/ready", ready=True)
        for i, n in enumerate(slots)
    ]
    return ModelPool(MODEL, backends, expected_service_s=0.04)


WEIGHTS = {"a": 3.0, "b": 0.5}
POLICIES: dict[str, tuple[Callable[[str], float], tuple[int, ...], dict[str, Quota] | None]] = {
    "plain": (lambda tenant: 1.0, (), None),
    "weighted": (lambda tenant: WEIGHTS.get(tenant, 1.0), (), None),
    "reserved": (lambda tenant: 1.0, (1, 0), None),
    "quotas": (
        lambda tenant: 1.0,
        (),
        {"a": Quota(1.0, borrowing_limit=1.0), "b": Quota(2.0, lending_limit=1.0)},
    ),
    "all": (
        lambda tenant: WEIGHTS.get(tenant, 1.0),
        (1, 0),
        {"a": Quota(2.0, borrowing_limit=0.0), "b": Quota(1.0)},
    ),
}
"""The policies the two stores must apply alike: weighted fair queuing within a band, a slot kept
for the urgent band, quotas that lend and reclaim (with their "no new borrowing while an owner
waits" rule), and all of them at once."""


@dataclass(eq=False)
class Pair:
    """One operation's results in the two stores."""

    memory: Any
    redis: Any


class StoresAgree(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.now = 1_000_000.0
        self.url = redis_url_or_skip()
        self.prefix = unique_prefix()
        self.client: Redis | None = None
        self.memory: MemoryQueue | None = None
        self.redis: RedisQueue | None = None
        self.waiting: list[Pair] = []
        """Tickets queued in both stores, oldest first."""
        self.held: list[Pair] = []
        self.quotas: dict[str, Quota] | None = None
        """Slots granted in both stores."""

    def run(self, work: Awaitable[T]) -> T:
        return self.loop.run_until_complete(work)

    @precondition(lambda self: self.memory is None)
    @rule(
        slots=st.sampled_from([(1,), (2,), (1, 2), (2, 1)]),
        ordering=st.sampled_from([Ordering.FIFO, Ordering.EDF]),
        policy=st.sampled_from(sorted(POLICIES)),
    )
    def start(self, slots: tuple[int, ...], ordering: Ordering, policy: str = "plain") -> None:
        weights, reserved, quotas = POLICIES[policy]
        self.quotas = quotas

        async def started() -> None:
            self.client = Redis.from_url(self.url)
            listener = Redis.from_url(self.url)
            self.memory = MemoryQueue(
                [pool(slots)],
                BANDS,
                ESTIMATION,
                ordering=ordering,
                weights=weights,
                reserved=reserved,
                quotas=quotas,
            )
            self.redis = RedisQueue(
                self.client,
                listener,
                [pool(slots)],
                BANDS,
                ESTIMATION,
                key_prefix=self.prefix,
                replica_id="r1",
                lease_ttl_s=10_000.0,  # no lease expires while the clock stands still
                ordering=ordering,
                weights=weights,
                reserved=reserved,
                quotas=quotas,
                redis_clock=lambda: self.now,
                close_clients=True,
            )
            await self.redis.start()

        self.run(started())

    @precondition(lambda self: self.memory is not None)
    @rule(
        band=st.integers(0, BANDS - 1),
        tenant=st.sampled_from(["", "a", "b"]),
        cost=st.sampled_from([1.0, 2.0, 3.5]),
        max_work=st.sampled_from([UNLIMITED, UNLIMITED, -1.0, 0.0, 1.0, 2.5, 4.0, 9.0]),
        allowed_s=st.sampled_from([0.5, 2.0, 10.0]),
        batch_key=st.sampled_from([None, None, "k", "j"]),
        hold=st.booleans(),
        reach=REACH,
        sequence=SEQUENCES,
    )
    def offer(
        self,
        band: int,
        tenant: str,
        cost: float,
        max_work: float,
        allowed_s: float,
        batch_key: str | None,
        hold: bool,
        reach: dict[str, float],
        sequence: SequenceRef | None = None,
    ) -> None:
        self.offer_to_both(band, tenant, cost, max_work, allowed_s, batch_key, hold, reach, sequence)

    def offer_to_both(
        self,
        band: int,
        tenant: str,
        cost: float,
        max_work: float,
        allowed_s: float,
        batch_key: str | None,
        hold: bool,
        reach: dict[str, float],
        sequence: SequenceRef | None = None,
    ) -> Offer:
        """Offer alike to both stores, check they answered alike; the memory store's answer."""
        assert self.memory is not None and self.redis is not None
        flow = Flow(MODEL, band, tenant)
        # A held batch queues though a slot is free; a later offer that is not held lets it go.
        batching = None if batch_key is None else Batching(batch_key, 4.0, hold=hold)

        async def offers() -> tuple[Offer, Offer]:
            assert self.memory is not None and self.redis is not None
            return (
                self.memory.offer_nowait(
                    flow, cost, allowed_s, max_work, self.now, batching, reach=reach, sequence=sequence
                ),
                await self.redis.offer(
                    flow, cost, allowed_s, max_work, self.now, batching, reach=reach, sequence=sequence
                ),
            )

        in_memory, in_redis = self.run(offers())
        assert type(in_memory) is type(in_redis), (in_memory, in_redis)
        if isinstance(in_memory, Granted):
            assert isinstance(in_redis, Granted)
            self.hold(Pair(in_memory.slot, in_redis.slot))
        elif isinstance(in_memory, Queued):
            assert isinstance(in_redis, Queued)
            self.waiting.append(Pair(in_memory.ticket, in_redis.ticket))
        else:
            assert isinstance(in_memory, Full) and isinstance(in_redis, Full)
        self.collect_grants()  # an offer that is not held hands free slots to held work
        return in_memory

    @precondition(lambda self: self.memory is not None)
    @rule(
        band=st.integers(0, BANDS - 1),
        tenant=st.sampled_from(["", "a", "b"]),
        cost=st.sampled_from([1.0, 2.0]),
        side=st.sampled_from([-1e-3, 1e-3]),
        reach=REACH,
    )
    def offer_at_the_edge(
        self, band: int, tenant: str, cost: float, side: float, reach: dict[str, float]
    ) -> None:
        """An offer whose limit is just below or just above the work the memory store counts ahead
        of it: both stores must count that work alike, not only roughly (fair turns, quotas and
        reservations included), or one admits at the edge what the other refuses."""
        assert self.memory is not None
        queue = self.memory._models[MODEL]
        queue.estimates.observe(queue.counters, self.now)  # the offer's own first step: the work a
        # hand-over takes may move with it, and with it the room the request takes
        stats, handover = self.memory.stats(MODEL), queue.estimates.handover_cost
        ahead = stats.work_before_grant(band, tenant, handover, cost, reach)
        answer = self.offer_to_both(band, tenant, cost, ahead + side, 10.0, None, False, reach)
        if not self.quotas:  # the edge is where it was read (with quotas, work a quota holds back
            # while a slot is free counts in the stores' check beyond what the stats tell: the two
            # stores still agree; in the states found the stats read low, the safe side for a replica)
            assert isinstance(answer, Full) == (side < 0), (ahead, answer)

    @precondition(lambda self: self.memory is not None)
    @rule(
        band=st.integers(0, BANDS - 1),
        cost=st.sampled_from([1.0, 2.0]),
        count=st.integers(3, 8),
        sequenced=st.booleans(),
    )
    def burst(self, band: int, cost: float, count: int, sequenced: bool = False) -> None:
        """Tenants a, b and "" queue several requests at once, so that fair shares, quotas and
        reserved slots order a deep queue (single offers rarely build one); `sequenced`: every
        other one of a sequence, so that pinned requests wait beside the flows."""
        tenants = ("a", "b", "")
        for i in range(count):
            sequence = SequenceRef(f"s{i % 3}") if sequenced and i % 2 else None
            self.offer_to_both(band, tenants[i % 3], cost, UNLIMITED, 10.0, None, False, {}, sequence)

    @precondition(lambda self: self.waiting)
    @rule()
    def held_batches_leave(self) -> None:
        assert self.memory is not None and self.redis is not None
        self.memory.dispatch_held(MODEL)

        async def dispatched() -> None:
            assert self.redis is not None
            self.redis.dispatch_held(MODEL)

        self.run(dispatched())
        self.collect_grants()

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 20))
    def release(self, index: int) -> None:
        assert self.memory is not None and self.redis is not None
        pair = self.held.pop(index % len(self.held))
        self.memory.release_nowait(pair.memory, self.now)
        self.run(self.redis.release(pair.redis, self.now))
        self.collect_grants()

    @precondition(lambda self: self.waiting)
    @rule(
        index=st.integers(0, 20),
        outcome=st.sampled_from([Outcome.DEADLINE_EXPIRED_IN_QUEUE, Outcome.CLIENT_DISCONNECTED]),
    )
    def leave(self, index: int, outcome: Outcome) -> None:
        """A waiter leaves: its wait expired, or its client went away."""
        assert self.memory is not None and self.redis is not None
        pair = self.waiting.pop(index % len(self.waiting))
        self.memory.withdraw_nowait(pair.memory, outcome)
        self.run(self.redis.withdraw(pair.redis, outcome))
        self.collect_grants()

    @precondition(lambda self: self.memory is not None)
    @rule(seconds=st.sampled_from([0.001, 0.03, 0.2, 1.5]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    def hold(self, pair: Pair) -> None:
        assert pair.memory.backend.url == pair.redis.backend.url, "dispatched to different backends"
        assert pair.memory.cost == pair.redis.cost
        self.held.append(pair)

    def collect_grants(self) -> None:
        """Move what both stores granted from `waiting` to `held`, checking they granted (or told to
        leave) alike."""
        self.run(self.redis_settled())
        done = [p for p in self.waiting if p.memory.wakeup.done()]
        for pair in self.waiting:
            assert pair.memory.wakeup.done() == pair.redis.wakeup.done(), "one store granted, the other not"
        slots: dict[int, Pair] = {}
        for pair in done:
            in_memory, in_redis = pair.memory.wakeup.result(), pair.redis.wakeup.result()
            if not isinstance(in_memory, Slot):  # told to leave: displaced as overdue
                assert in_redis == in_memory
                continue
            assert isinstance(in_redis, Slot)
            partners = {id(p.redis) for p in done if p.memory in in_memory.batch}
            assert partners == {id(t) for t in in_redis.batch}, "batched differently"
            slots.setdefault(id(in_memory), Pair(in_memory, in_redis))
        for slot_pair in slots.values():
            self.hold(slot_pair)
        self.waiting = [p for p in self.waiting if not p.memory.wakeup.done()]

    async def redis_settled(self) -> None:
        assert self.redis is not None
        await self.redis.settle()

    @invariant()
    def statistics_and_counters_agree(self) -> None:
        if self.memory is None or self.redis is None:
            return
        state = self.redis._models[MODEL]
        self.run(self.redis._refresh(state))
        in_memory, in_redis = self.memory.stats(MODEL), self.redis.stats(MODEL)
        assert in_redis.queued_by_band == in_memory.queued_by_band
        assert in_redis.pinned_by_band == in_memory.pinned_by_band
        assert in_redis.free_slots == in_memory.free_slots
        assert in_redis.queued_work_by_band == pytest.approx(in_memory.queued_work_by_band)
        # What admission reads of each band's fair queuing (the arrivals in turn ahead of a request)
        # and of the tenants' work in flight (quotas): the replica's view, not only the script's own.
        unfair = (None,) * BANDS  # a store may say "no fair queuing" (EDF) either way
        seen_all, counted_all = in_redis.fair_turns or unfair, in_memory.fair_turns or unfair
        for seen_turns, counted_turns in zip(seen_all, counted_all, strict=True):
            assert (seen_turns is None) == (counted_turns is None)
            if seen_turns is not None and counted_turns is not None:
                assert seen_turns.virtual_time == pytest.approx(counted_turns.virtual_time)
                assert seen_turns.finish == pytest.approx(counted_turns.finish)
                assert seen_turns.queued == pytest.approx(counted_turns.queued)
                assert seen_turns.weights == pytest.approx(counted_turns.weights)
        if self.quotas:  # read only where quotas are (policies.quotas)
            assert dict(in_redis.inflight_by_tenant) == pytest.approx(dict(in_memory.inflight_by_tenant))
        counted, seen = self.memory._models[MODEL].counters, state.view.counters
        assert seen.offered_work == pytest.approx(counted.offered_work)
        assert seen.admitted_work == pytest.approx(counted.admitted_work)
        assert (seen.handovers, seen.handed_work) == (counted.handovers, pytest.approx(counted.handed_work))
        assert seen.granted_by_flow == pytest.approx(counted.granted_by_flow)
        assert seen.admitted_by_flow == pytest.approx(counted.admitted_by_flow)
        assert (seen.drained_work, seen.drained_s) == (
            pytest.approx(counted.drained_work),
            pytest.approx(counted.drained_s, abs=1e-5),
        )

    def teardown(self) -> None:
        async def stopped() -> None:
            if self.redis is not None:
                await self.redis.stop()
            cleaner = Redis.from_url(self.url)
            keys = [key async for key in cleaner.scan_iter(match=f"{{{self.prefix}*")]
            if keys:
                await cleaner.delete(*keys)
            await cleaner.aclose()

        try:
            self.run(stopped())
        finally:
            self.loop.close()


StoresAgree.TestCase.settings = settings(
    max_examples=int(os.environ.get("STORES_AGREE_EXAMPLES", "20")),
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoresAgree = StoresAgree.TestCase


def replay(slots: tuple[int, ...], steps: list[tuple[str, dict[str, Any]]]) -> None:
    """Run `steps` (rule name, arguments) on a fresh machine, checking the invariant after each:
    sequences the state machine once found, kept so that every run tries them."""
    machine = StoresAgree()
    try:
        machine.start(slots=slots, ordering=Ordering.FIFO)
        for name, arguments in steps:
            getattr(machine, name)(**arguments)
            machine.statistics_and_counters_agree()
    finally:
        machine.teardown()


def offered(band: int = 0, tenant: str = "", cost: float = 1.0, allowed_s: float = 0.5, **more: Any):
    arguments = {"max_work": UNLIMITED, "batch_key": None, "hold": False, "reach": {}} | more
    return ("offer", {"band": band, "tenant": tenant, "cost": cost, "allowed_s": allowed_s} | arguments)


def test_a_dispatch_that_hands_two_slots_over_samples_the_drain_once():
    # Two batches held on a free slot; the release hands both slots over in one dispatch.
    held = {"batch_key": "k", "hold": True}
    replay((2,), [offered(), offered(**held), offered(tenant="a", **held), ("release", {"index": 0})])


def test_work_displaced_as_overdue_is_told_alike():
    replay(
        (1, 2),
        [
            offered(),
            offered(hold=True),
            offered(tenant="a", batch_key="k", hold=True),
            ("release", {"index": 0}),
            offered(band=1, tenant="a", allowed_s=2.0, hold=True),
            offered(allowed_s=2.0),
            ("release", {"index": 9}),
            offered(band=1, tenant="b", cost=3.5, batch_key="k"),
            ("time_passes", {"seconds": 1.5}),
            offered(tenant="a", cost=2.0, allowed_s=2.0, batch_key="k", max_work=9.0),
        ],
    )


def test_a_sequences_requests_wait_for_their_backend_apart_from_the_flows_alike():
    # s1 is pinned to the least loaded backend (the first, of one slot); its second request waits
    # for that slot while an unsequenced one takes the second backend's; the release hands the
    # first backend's slot to s1's request, which goes before the flow waiting ahead of it.
    s1 = SequenceRef("s1")
    replay(
        (1, 2),
        [
            offered(sequence=s1, allowed_s=10.0),
            offered(sequence=s1, allowed_s=10.0),
            offered(tenant="a", allowed_s=10.0),
            offered(tenant="a", allowed_s=10.0),
            offered(tenant="b", allowed_s=10.0),
            ("release", {"index": 0}),
            offered(sequence=SequenceRef("s1", end=True), allowed_s=10.0),
            ("release", {"index": 0}),
            ("release", {"index": 0}),
        ],
    )


def test_requests_pinned_to_a_full_backend_hold_back_no_request_a_free_slot_can_take():
    machine = StoresAgree()
    try:
        machine.start(slots=(1, 2), ordering=Ordering.FIFO)
        for _ in range(2):  # the first takes A's slot, the second waits for it
            machine.offer_to_both(0, "", 1.0, UNLIMITED, 10.0, None, False, {}, S1)
        # No room to wait (max_work 0): granted at once on B all the same, in both stores.
        answer = machine.offer_to_both(1, "", 1.0, 0.0, 10.0, None, False, {})
        assert isinstance(answer, Granted) and answer.slot.backend.url.endswith(":9001")
        machine.statistics_and_counters_agree()
    finally:
        machine.teardown()
