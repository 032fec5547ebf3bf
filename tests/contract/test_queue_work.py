"""The RequestQueue contract for what the second wave builds on, against every store: work in cost
units, flows within a band, batch grants (one slot, several tickets of one flow), EDF ordering."""

import asyncio
import math
import time

import pytest

from gateway.queues.base import Batching, Flow, Full, Granted, Queued, Slot
from gateway.queues.redis.store import RedisQueue
from policies.ordering import Ordering
from policies.outcomes import Outcome
from policies.quotas import Quota
from tests.contract.conftest import MODEL
from tests.eventually import eventually

pytestmark = pytest.mark.anyio
UNLIMITED = 10**9


async def offer(sut, *, band=1, cost=1.0, tenant="", max_work=UNLIMITED, allowed_s=30.0, batching=None):
    flow = Flow(MODEL, band, tenant)
    return await sut.store.offer(flow, cost, allowed_s, max_work, time.monotonic(), batching)


async def release(sut, slot):
    await sut.store.release(slot, now=time.monotonic())
    await sut.settle()


async def take_the_slot(sut):
    held = await offer(sut)
    assert isinstance(held, Granted)
    return held.slot


async def granted_in_order(sut, slot, tickets):
    """Release `slot` again and again, returning the tickets in the order they were granted."""
    order: list = []

    def newly_granted() -> list:
        return [t for t in tickets if t.wakeup.done() and t not in order]

    while len(order) < len(tickets):
        await release(sut, slot)
        await eventually(newly_granted)
        granted = newly_granted()
        assert len(granted) == 1, "one slot, one grant"
        order.extend(granted)
        slot = granted[0].wakeup.result()
    return order


async def test_queue_statistics_count_work_as_well_as_requests(make_store):
    sut = await make_store(slots=(1,))
    await take_the_slot(sut)
    await offer(sut, cost=3.0)
    await offer(sut, cost=2.5, tenant="team-a")
    await offer(sut, band=0, cost=4.0)
    stats = sut.store.stats(MODEL)
    assert stats.queued_by_band == (1, 2)
    assert stats.queued_work_by_band == pytest.approx((4.0, 5.5))


async def test_the_admission_limit_is_in_work(make_store):
    sut = await make_store(slots=(1,))
    await take_the_slot(sut)
    # The work to drain: what is queued ahead, then one hand-over (1 unit until costs are seen).
    assert isinstance(await offer(sut, cost=4.0, max_work=1.0), Queued)  # nothing ahead yet
    refused = await offer(sut, cost=1.0, max_work=4.9)  # 4 units ahead, then its own
    assert isinstance(refused, Full)
    assert refused.stats.queued_work_by_band == pytest.approx((0.0, 4.0))
    assert isinstance(await offer(sut, cost=1.0, max_work=5.0), Queued)
    # More urgent work counts ahead of a band; less urgent work does not.
    assert isinstance(await offer(sut, band=0, cost=1.0, max_work=1.0), Queued)
    assert isinstance(await offer(sut, band=1, cost=1.0, max_work=6.5), Full)  # 1 + 5 + 1


async def test_behind_queued_work_a_request_takes_the_room_of_its_whole_cost(make_store):
    sut = await make_store(slots=(1,))
    await take_the_slot(sut)
    assert isinstance(await offer(sut, cost=8.0, max_work=1.0), Queued)  # no queue to crowd: one hand-over
    # 8 units queued: a long request needs room for its 6, a short one for a hand-over (1 unit).
    assert isinstance(await offer(sut, cost=6.0, max_work=13.9), Full)
    assert isinstance(await offer(sut, cost=0.5, max_work=9.0), Queued)
    assert isinstance(await offer(sut, cost=6.0, max_work=14.5), Queued)  # 8.5 + 6


async def test_a_free_slot_is_granted_under_any_limit_but_a_negative_one(make_store):
    sut = await make_store(slots=(2,))
    assert isinstance(await offer(sut, max_work=0.0), Granted)  # no time to wait, none needed
    assert isinstance(await offer(sut, max_work=-1.0), Full)  # cannot be served in time at all


async def test_withdrawn_work_leaves_the_statistics(make_store):
    sut = await make_store(slots=(1,))
    await take_the_slot(sut)
    ticket = (await offer(sut, cost=2.5)).ticket
    await offer(sut, cost=1.5)
    await sut.store.withdraw(ticket, Outcome.CLIENT_DISCONNECTED)
    await sut.store.withdraw(ticket, Outcome.CLIENT_DISCONNECTED)  # idempotent
    stats = sut.store.stats(MODEL)
    assert (stats.queued_by_band, stats.queued_work_by_band) == ((0, 1), pytest.approx((0.0, 1.5)))


async def test_flows_of_a_band_take_turns_and_ties_go_in_arrival_order(make_store):
    sut = await make_store(slots=(1,))
    slot = await take_the_slot(sut)
    tickets = [(await offer(sut, tenant=tenant)).ticket for tenant in ("a", "b", "a", "", "b")]
    a1, b1, a2, unnamed, b2 = tickets
    assert await granted_in_order(sut, slot, tickets) == [a1, b1, unnamed, a2, b2]


async def test_backlogged_flows_of_a_band_are_handed_work_by_weight(make_store):
    sut = await make_store(slots=(1,), weights={"a": 3.0, "b": 1.0})
    slot = await take_the_slot(sut)
    tickets = [(await offer(sut, tenant="a")).ticket for _ in range(9)]
    tickets += [(await offer(sut, tenant="b", cost=2.0)).ticket for _ in range(3)]
    order = [t.flow.tenant for t in await granted_in_order(sut, slot, tickets)]
    # Start tags: a's 0, 1/3, 2/3, ..., 8/3; b's (cost 2) 0, 2, 4; ties go in arrival order.
    assert order == ["a", "b", "a", "a", "a", "a", "a", "a", "b", "a", "a", "b"]


async def test_a_costly_claim_does_not_leave_fair_queuing_first_come_first_served(make_store):
    sut = await make_store(slots=(1,))
    slot = await take_the_slot(sut)
    # A client claims a batch of 1e20 items (its backend will refuse it), then sends one more.
    claims = [(await offer(sut, tenant="c", cost=cost, max_work=math.inf)).ticket for cost in (1e20, 1.0)]
    slot = (await granted_in_order(sut, slot, claims))[-1].wakeup.result()
    flood = [(await offer(sut, tenant="a")).ticket for _ in range(10)]
    single = (await offer(sut, tenant="b")).ticket
    order = await granted_in_order(sut, slot, [*flood, single])
    assert order.index(single) <= 1, "b's one request is served within the fair-queuing bound"


async def test_a_flow_back_from_idleness_starts_at_the_bands_virtual_time(make_store):
    sut = await make_store(slots=(1,))
    slot = await take_the_slot(sut)
    busy = [(await offer(sut, tenant="busy")).ticket for _ in range(6)]
    slot = (await granted_in_order(sut, slot, busy[:4]))[-1].wakeup.result()
    # The band's clock stands at busy's fourth start (3); busy's next ones start at 4 and 5. The
    # flow that was idle starts at 3, not at 0: it shares from now on, it does not catch up.
    back = [(await offer(sut, tenant="back")).ticket for _ in range(2)]
    later = await granted_in_order(sut, slot, busy[4:] + back)
    assert [t.flow.tenant for t in later] == ["back", "busy", "back", "busy"]


async def test_a_request_that_leaves_unserved_costs_its_flow_no_turn(make_store):
    sut = await make_store(slots=(1,))
    slot = await take_the_slot(sut)
    a1, a2, b1, b2 = [(await offer(sut, tenant=tenant)).ticket for tenant in ("a", "a", "b", "b")]
    # Its allowance ran out (or its client left) before its turn. Tagged on arrival, a2 would
    # start at a1's finish (1), behind b1 (0); tagged as it becomes a's head, it starts at 0 and
    # goes first, its tie with b1 settled by arrival.
    await sut.store.withdraw(a1, Outcome.DEADLINE_EXPIRED_IN_QUEUE)
    assert sut.store.stats(MODEL).work_ahead(1, "a", 1.0) == pytest.approx(1 + 1 + 1)
    assert await granted_in_order(sut, slot, [a2, b1, b2]) == [a2, b1, b2]


async def test_a_flow_granted_at_once_is_weighed_by_its_weight_in_the_turns_of_the_others(make_store):
    sut = await make_store(slots=(1,), weights={"heavy": 8.0})
    # The heavy flow is admitted, and granted at once: it never queued.
    assert isinstance(await offer(sut, tenant="heavy"), Granted)
    for _ in range(2):
        assert isinstance(await offer(sut, tenant="light"), Queued)
    # A third light request starts two turns on (its flow's two ahead, weight 1): within them the
    # heavy flow may send 2 x 8 of what it will, and one request of slack, not 2 x 1 (+1), as a
    # flow never seen queued read.
    stats = sut.store.stats(MODEL)
    assert stats.arriving_ahead(1, "light", 1.0, {"heavy": 100.0}) == pytest.approx(17.0)


async def test_a_light_flow_is_admitted_on_its_turn_not_on_the_backlog_of_a_heavy_one(make_store):
    sut = await make_store(slots=(1,), weights={"heavy": 1.0, "light": 3.0})
    await take_the_slot(sut)
    for _ in range(40):
        assert isinstance(await offer(sut, tenant="heavy"), Queued)
    # The heavy flow's next request waits behind its 40; the light one's goes next in the band
    # (one request of slack for the heavy head that may tie with it), so a limit that refuses the
    # first admits the second.
    assert isinstance(await offer(sut, tenant="heavy", max_work=10.0), Full)
    light = [await offer(sut, tenant="light", max_work=10.0) for _ in range(3)]
    assert all(isinstance(o, Queued) for o in light)
    # With weight 3 its fourth request is a turn (1/3 of a heavy request per light one) further on:
    # 3 of its own ahead, 1 of the heavy flow, 1 of slack, and its own hand-over.
    assert isinstance(await offer(sut, tenant="light", max_work=5.9), Full)
    assert isinstance(await offer(sut, tenant="light", max_work=6.0), Queued)
    # The statistics tell the same turn (what admission's predictions read).
    stats = sut.store.stats(MODEL)
    assert stats.work_ahead(1, "light", 1.0) == pytest.approx(4 + 4 / 3 + 1)
    assert stats.work_ahead(1, "heavy", 1.0) == pytest.approx(44)
    assert stats.work_ahead(1) == pytest.approx(44)


async def test_under_edf_the_whole_band_is_ahead_of_every_tenant(make_store):
    sut = await make_store(slots=(1,), ordering=Ordering.EDF)
    await take_the_slot(sut)
    for _ in range(20):
        await offer(sut, tenant="heavy")
    assert isinstance(await offer(sut, tenant="light", max_work=10.0), Full)


async def test_a_more_urgent_flow_of_any_tenant_goes_first(make_store):
    sut = await make_store(slots=(1,))
    slot = await take_the_slot(sut)
    low = (await offer(sut, band=1, tenant="a")).ticket
    high = (await offer(sut, band=0, tenant="b")).ticket
    assert await granted_in_order(sut, slot, [low, high]) == [high, low]


async def test_edf_grants_the_earliest_leave_by_time_first(make_store):
    sut = await make_store(slots=(1,), ordering=Ordering.EDF)
    slot = await take_the_slot(sut)
    patient = (await offer(sut, allowed_s=10.0)).ticket
    urgent = (await offer(sut, allowed_s=1.0, tenant="b")).ticket
    middle = (await offer(sut, allowed_s=5.0)).ticket
    assert await granted_in_order(sut, slot, [patient, urgent, middle]) == [urgent, middle, patient]


async def test_fifo_grants_in_arrival_order_whatever_the_leave_by_times(make_store):
    sut = await make_store(slots=(1,), ordering=Ordering.FIFO)
    slot = await take_the_slot(sut)
    tickets = [(await offer(sut, allowed_s=allowed)).ticket for allowed in (10.0, 1.0, 5.0)]
    assert await granted_in_order(sut, slot, tickets) == tickets


def batch(cost: float = 3.0, key: str = "k") -> Batching:
    return Batching(key, cost)


async def test_a_grant_hands_one_slot_to_a_batch_of_one_flow(make_store):
    sut = await make_store(slots=(1,))
    slot = await take_the_slot(sut)
    tickets = [(await offer(sut, batching=batch(3.0))).ticket for _ in range(4)]
    await release(sut, slot)
    await eventually(lambda: all(t.wakeup.done() for t in tickets[:3]))
    shared = tickets[0].wakeup.result()
    assert isinstance(shared, Slot)
    assert all(t.wakeup.result() is shared for t in tickets[:3])
    assert shared.cost == 3.0 and set(shared.batch) == set(tickets[:3])
    assert not tickets[3].wakeup.done()  # over the batch's cost: it waits for the next slot
    stats = sut.store.stats(MODEL)
    assert (stats.queued_by_band, stats.free_slots) == ((0, 1), 0)
    await release(sut, shared)  # one release for the whole batch
    await eventually(lambda: tickets[3].wakeup.done())
    assert tickets[3].wakeup.result().batch == ()  # alone: a plain slot


async def test_a_batch_takes_only_the_tickets_right_behind_with_its_key(make_store):
    sut = await make_store(slots=(1,))
    slot = await take_the_slot(sut)
    first = (await offer(sut, batching=batch(10.0))).ticket
    same = (await offer(sut, batching=batch(10.0))).ticket
    other_key = (await offer(sut, batching=batch(10.0, key="j"))).ticket
    after = (await offer(sut, batching=batch(10.0))).ticket
    await release(sut, slot)
    await eventually(lambda: same.wakeup.done())
    shared = first.wakeup.result()
    assert same.wakeup.result() is shared and shared.cost == 2.0
    assert not other_key.wakeup.done() and not after.wakeup.done()


async def test_a_batch_never_takes_another_flows_tickets(make_store):
    sut = await make_store(slots=(1,))
    slot = await take_the_slot(sut)
    a1 = (await offer(sut, tenant="a", batching=batch(10.0))).ticket
    b1 = (await offer(sut, tenant="b", batching=batch(10.0))).ticket
    a2 = (await offer(sut, tenant="a", batching=batch(10.0))).ticket
    await release(sut, slot)
    await eventually(lambda: a2.wakeup.done())
    shared = a1.wakeup.result()
    assert a2.wakeup.result() is shared and shared.cost == 2.0
    assert not b1.wakeup.done()


async def test_requests_without_batching_are_never_batched(make_store):
    sut = await make_store(slots=(1,))
    slot = await take_the_slot(sut)
    leader = (await offer(sut, batching=batch(10.0))).ticket
    plain = (await offer(sut)).ticket
    await release(sut, slot)
    await eventually(lambda: leader.wakeup.done())
    assert leader.wakeup.result().cost == 1.0 and not plain.wakeup.done()


async def test_the_drain_rate_is_measured_in_work(make_store):
    sut = await make_store(slots=(1,))
    slot = await take_the_slot(sut)
    tickets = [(await offer(sut, cost=4.0)).ticket for _ in range(8)]
    started = time.monotonic()
    for ticket in tickets:
        await asyncio.sleep(0.05)  # the behaviour under test: one hand-over every 50 ms or so
        await sut.store.release(slot, now=time.monotonic())
        slot = await asyncio.wait_for(ticket.wakeup, 2)
    # 4 units per hand-over, at the pace the hand-overs really had (a loaded machine stretches
    # the sleeps): 80 per second when they keep to 50 ms.
    paced = 4.0 * len(tickets) / (time.monotonic() - started)
    throughput = sut.store.throughput(MODEL, now=time.monotonic())
    assert 0.6 * paced < throughput.drain_rate_per_s < 1.1 * paced
    assert throughput.handover_cost > 2.5  # on its way from 1 to 4


async def test_less_urgent_classes_never_hold_the_slots_a_class_reserves(make_store):
    sut = await make_store(slots=(4,), reserved=(2, 0))
    low = [await offer(sut, band=1) for _ in range(3)]
    assert [type(o) for o in low] == [Granted, Granted, Queued]  # two slots stay free for high
    assert sut.store.stats(MODEL).free_by_band == (2, 0)
    high = [await offer(sut, band=0) for _ in range(3)]
    assert [type(o) for o in high] == [Granted, Granted, Queued]  # high may use every slot
    # A high slot that frees goes to the queued high request, a low one to the queued low one.
    await release(sut, high[0].slot)
    await eventually(lambda: high[2].ticket.wakeup.done())
    assert not low[2].ticket.wakeup.done()
    await release(sut, low[0].slot)
    await eventually(lambda: low[2].ticket.wakeup.done())


async def test_reservations_that_change_with_a_window_hold_from_the_next_offer(make_store):
    now = [(0, 0)]  # as a window clock gives them: outside its window high keeps nothing
    sut = await make_store(slots=(3,), reserved=lambda: now[0])
    assert isinstance(await offer(sut, band=1), Granted)
    now[0] = (2, 0)  # the window opens: high keeps two of the three slots
    waiting = await offer(sut, band=1)
    assert isinstance(waiting, Queued)
    assert sut.store.stats(MODEL).free_by_band == (2, 0)
    assert isinstance(await offer(sut, band=0), Granted)
    # It closes: the next offer hands the slot high no longer keeps to the low request waiting.
    now[0] = (0, 0)
    assert isinstance(await offer(sut, band=1), Queued)
    await eventually(lambda: waiting.ticket.wakeup.done(), what="the waiting low request's grant")
    assert isinstance(waiting.ticket.wakeup.result(), Slot)


async def test_a_bands_capacity_leaves_out_the_slots_more_urgent_classes_keep_now(make_store):
    now = [(2, 0)]
    sut = await make_store(slots=(4,), reserved=lambda: now[0])
    for _ in range(200):
        sut.store.record_service(MODEL, 0.1)
    capacity = sut.store.throughput(MODEL, now=time.monotonic()).capacity_by_band
    assert capacity == (pytest.approx(40.0, rel=0.01), pytest.approx(20.0, rel=0.01))
    now[0] = (0, 0)  # the window closes: low may hold every slot again
    capacity = sut.store.throughput(MODEL, now=time.monotonic() + 1).capacity_by_band
    assert capacity == (pytest.approx(40.0, rel=0.01), pytest.approx(40.0, rel=0.01))


async def test_a_shared_store_measures_a_service_as_long_as_it_held_the_slot(make_store):
    # Each slot is held 20 ms by the replica while the backend reports 1 ms of work. In the memory
    # store the slot is handed over where it is freed: the backend's time is the slot's. Redis
    # hands it over a round trip and the replica's turns later: the pool turns over as slowly as
    # the slot is held, and a reading of the backend's time alone would admit work that expires.
    sut = await make_store(slots=(1,))
    for _ in range(40):
        slot = await take_the_slot(sut)
        await asyncio.sleep(0.02)  # the replica holds it: the input of this test, not a wait for state
        sut.store.record_service(MODEL, 0.001, slot)
        await release(sut, slot)
    service_s = sut.store.throughput(MODEL, now=time.monotonic()).service_time_s
    if isinstance(sut.store, RedisQueue):
        assert service_s >= 0.02
    else:
        assert service_s < 0.01


async def test_a_freed_slot_kept_for_an_urgent_class_is_not_handed_to_a_less_urgent_one(make_store):
    sut = await make_store(slots=(3,), reserved=(1, 0))
    low = [await offer(sut, band=1) for _ in range(2)]
    high = await offer(sut, band=0)
    queued = await offer(sut, band=1)
    assert isinstance(queued, Queued)
    await release(sut, high.slot)  # one slot frees: the reserved one, with low still holding 2
    assert not queued.ticket.wakeup.done()
    assert sut.store.stats(MODEL).free_by_band == (1, 0)
    await release(sut, low[0].slot)
    await eventually(lambda: queued.ticket.wakeup.done())


async def test_a_tenant_borrows_the_quota_another_leaves_unused_and_gives_it_back_as_it_finishes(make_store):
    sut = await make_store(slots=(4,), quotas={"a": Quota(2), "b": Quota(2)})
    mine = [await offer(sut, tenant="a") for _ in range(6)]
    assert [type(o) for o in mine] == [Granted] * 4 + [Queued] * 2  # b's two are lent while idle
    await sut.settle()
    assert sut.store.stats(MODEL).inflight_by_tenant == {"a": 4.0}
    theirs = [await offer(sut, tenant="b") for _ in range(2)]
    assert all(isinstance(o, Queued) for o in theirs)
    # The owner is back: each slot a frees goes to b until b runs its quota, not to a's queue.
    await release(sut, mine[0].slot)
    await eventually(lambda: theirs[0].ticket.wakeup.done())
    await release(sut, mine[1].slot)
    await eventually(lambda: theirs[1].ticket.wakeup.done())
    assert not mine[4].ticket.wakeup.done()
    # Both at their quotas: a's queue waits for a's own slots.
    await release(sut, mine[2].slot)
    await eventually(lambda: mine[4].ticket.wakeup.done())


async def test_a_withdrawn_head_its_quota_held_back_lets_what_is_behind_it_start(make_store):
    # b (quota 1, hard) may not borrow the 1 more its first request needs; its second, of 1, fits
    # its own quota but waits behind it. When the first leaves, the second starts on the idle slot.
    quotas = {"a": Quota(2, borrowing_limit=0), "b": Quota(1, borrowing_limit=0)}
    sut = await make_store(slots=(2,), quotas=quotas)
    assert isinstance(await offer(sut, tenant="a", cost=2.0), Granted)
    held = (await offer(sut, tenant="b", cost=2.0)).ticket
    behind = (await offer(sut, tenant="b", cost=1.0)).ticket
    await sut.settle()
    assert not behind.wakeup.done()
    await sut.store.withdraw(held, Outcome.CLIENT_DISCONNECTED)
    await eventually(lambda: behind.wakeup.done(), what="the request behind the withdrawn head to start")
    assert isinstance(behind.wakeup.result(), Slot)


async def test_an_owner_reclaiming_its_quota_displaces_borrowers_it_pushes_past_their_allowance(make_store):
    # b owns nothing and runs on a's unused quota; c has a quota of 0 (it may only borrow).
    sut = await make_store(slots=(2,), quotas={"a": Quota(100), "c": Quota(0)})
    for _ in range(2):
        assert isinstance(await offer(sut, tenant="b"), Granted)
    borrowing = (await offer(sut, tenant="b", allowed_s=0.5)).ticket
    over_quota = (await offer(sut, tenant="c", allowed_s=0.5)).ticket
    # While a waits no borrowing starts, so a's queued work is ahead of b's request: 50 hand-overs
    # a second (2 slots, 40 ms) make about 25 in its 0.5 s, and 40 at the most.
    for _ in range(45):
        await offer(sut, tenant="a")
    await eventually(lambda: borrowing.wakeup.done())
    assert borrowing.wakeup.result() is Outcome.DISPLACED
    # c runs within its quota again as its own requests finish: it waits for no owner, and stays.
    assert not over_quota.wakeup.done()
    assert sut.store.stats(MODEL).queued_by_band == (0, 46)


async def test_a_hard_quota_keeps_a_tenant_to_its_own_share_though_slots_are_free(make_store):
    sut = await make_store(slots=(4,), quotas={"a": Quota(1, borrowing_limit=0)})
    first, second = [await offer(sut, tenant="a") for _ in range(2)]
    assert isinstance(first, Granted) and isinstance(second, Queued)
    # No quota: b runs on what no quota covers, at once though a's request is queued ahead of it.
    other = await offer(sut, tenant="b")
    await eventually(lambda: isinstance(other, Granted) or other.ticket.wakeup.done())
    await release(sut, first.slot)
    await eventually(lambda: second.ticket.wakeup.done())


async def test_a_lending_limit_caps_what_others_borrow_of_a_quota(make_store):
    sut = await make_store(slots=(4,), quotas={"a": Quota(1), "b": Quota(3, lending_limit=1)})
    offers = [await offer(sut, tenant="a") for _ in range(3)]
    assert [type(o) for o in offers] == [Granted, Granted, Queued]  # its own 1, and 1 of b's 3


async def test_at_its_cap_the_queue_displaces_the_newest_least_urgent_work_for_more_urgent(make_store):
    sut = await make_store(slots=(1,), bands=3, cap=3.0)
    await take_the_slot(sut)
    middle = (await offer(sut, band=1)).ticket
    lows = [(await offer(sut, band=2)).ticket for _ in range(2)]
    urgent = await offer(sut, band=0)
    assert isinstance(urgent, Queued)
    # The newest low request left at once, told so; the older one and the middle one stay.
    await eventually(lambda: lows[1].wakeup.done())
    assert lows[1].wakeup.result() is Outcome.DISPLACED
    assert not lows[0].wakeup.done() and not middle.wakeup.done()
    assert sut.store.stats(MODEL).queued_by_band == (1, 1, 1)


async def test_at_its_cap_the_queue_displaces_borrowed_work_before_owned_work(make_store):
    # a owns a quota of 1, b none (what b runs is borrowed). The older low request is b's, the
    # newer a's: an urgent arrival at the cap takes the place of b's, not of the newest.
    sut = await make_store(slots=(1,), bands=2, cap=2.0, quotas={"a": Quota(1)})
    held = await offer(sut, tenant="a")
    assert isinstance(held, Granted)
    borrowed = (await offer(sut, band=1, tenant="b")).ticket
    owned = (await offer(sut, band=1, tenant="a")).ticket
    assert isinstance(await offer(sut, band=0, tenant="b"), Queued)
    await eventually(lambda: borrowed.wakeup.done())
    assert borrowed.wakeup.result() is Outcome.DISPLACED
    assert not owned.wakeup.done()
    assert sut.store.stats(MODEL).queued_by_band == (1, 1)


@pytest.mark.parametrize("ordering", [Ordering.FIFO, Ordering.EDF])
async def test_queued_work_pushed_past_its_allowance_by_urgent_arrivals_is_displaced_at_once(
    make_store, ordering
):
    # One slot of 40 ms hands over 25 times a second: within 1 s, 25 hand-overs, of which
    # admission counts on 16 (n + 2 sqrt(n) <= 25 at the prior cv 1: policies.displacement). Ten
    # urgent requests leave the low ones room; sixty do not.
    sut = await make_store(slots=(1,), ordering=ordering)
    await take_the_slot(sut)
    short = [(await offer(sut, band=1, allowed_s=1.0)).ticket for _ in range(4)]
    patient = (await offer(sut, band=1, allowed_s=30.0)).ticket
    urgent = [(await offer(sut, band=0, allowed_s=30.0)).ticket for _ in range(10)]
    await sut.settle()
    assert not any(t.wakeup.done() for t in [*short, patient])
    urgent += [(await offer(sut, band=0, allowed_s=30.0)).ticket for _ in range(50)]
    await eventually(lambda: all(t.wakeup.done() for t in short), what="the low requests to be told")
    assert [t.wakeup.result() for t in short] == [Outcome.DISPLACED] * 4
    assert all(t.overdue for t in short)
    # Work that can still make it stays, and more urgent work is never displaced.
    assert not patient.wakeup.done() and not any(t.wakeup.done() for t in urgent)
    assert sut.store.stats(MODEL).queued_by_band == (60, 1)


async def test_a_large_queued_request_counts_one_hand_over_however_much_work_it_carries(make_store):
    # Batch jobs of 16 units behind urgent requests of 1, on one slot of 40 ms (25 hand-overs in
    # 1 s, 16 at admission's margin). Ten urgent arrivals put 10 + 2 requests ahead of the newest
    # job: 13 hand-overs with its own, so it stays (counted as work, 10 + 32 units, it would have
    # gone).
    sut = await make_store(slots=(1,))
    await take_the_slot(sut)
    jobs = [(await offer(sut, band=1, cost=16.0, allowed_s=1.0)).ticket for _ in range(3)]
    urgent = [(await offer(sut, band=0, allowed_s=30.0)).ticket for _ in range(10)]
    await sut.settle()
    assert not any(t.wakeup.done() for t in jobs)
    # Thirty more: 40 urgent requests ahead of every job, which no drain beats in 1 s.
    urgent += [(await offer(sut, band=0, allowed_s=30.0)).ticket for _ in range(30)]
    await eventually(lambda: all(t.wakeup.done() for t in jobs), what="the jobs to be told")
    assert [t.wakeup.result() for t in jobs] == [Outcome.DISPLACED] * 3
    assert not any(t.wakeup.done() for t in urgent)


async def test_at_its_cap_a_request_with_nothing_less_urgent_to_displace_is_refused(make_store):
    sut = await make_store(slots=(1,), bands=2, cap=2.0)
    await take_the_slot(sut)
    queued = [(await offer(sut, band=0)).ticket for _ in range(2)]
    refused = await offer(sut, band=1)
    assert isinstance(refused, Full) and refused.at_cap
    assert isinstance(await offer(sut, band=0), Full)  # nothing below high to displace either
    assert not any(t.wakeup.done() for t in queued)


async def test_a_store_tells_the_kind_of_request_each_slot_in_use_serves(make_store):
    # Admission reads each request in flight from its own kind's service times (policies.
    # request_kinds): the store keeps the kind with the slot, granted at once or from the queue, and
    # a batch of several serves no one kind.
    sut = await make_store(slots=(3,))
    flow = Flow(MODEL, 1)
    now = time.monotonic()
    first = await sut.store.offer(flow, 1.0, 30.0, UNLIMITED, now, kind="infer:1")
    second = await sut.store.offer(flow, 1.0, 30.0, UNLIMITED, now, kind="chat/completions+stream:16")
    assert isinstance(first, Granted) and isinstance(second, Granted)
    assert sorted(sut.store.stats(MODEL).started_kinds) == ["chat/completions+stream:16", "infer:1"]
    await take_the_slot(sut)  # a request of no kind told
    queued = await sut.store.offer(flow, 1.0, 30.0, UNLIMITED, now, kind="infer:4")
    assert isinstance(queued, Queued)
    await release(sut, first.slot)
    await eventually(lambda: queued.ticket.wakeup.done())
    assert queued.ticket.wakeup.result().kind == "infer:4"
    assert sorted(sut.store.stats(MODEL).started_kinds) == ["", "chat/completions+stream:16", "infer:4"]
    await release(sut, second.slot)
    batching = Batching("same-shape", 8.0)
    await take_the_slot(sut)  # all three slots busy again
    batch = [
        await sut.store.offer(flow, 1.0, 30.0, UNLIMITED, now, batching, kind="infer:1") for _ in range(2)
    ]
    assert all(isinstance(b, Queued) for b in batch)
    await release(sut, queued.ticket.wakeup.result())
    await eventually(lambda: all(b.ticket.wakeup.done() for b in batch))
    assert batch[0].ticket.wakeup.result().kind == ""
    assert sorted(sut.store.stats(MODEL).started_kinds) == ["", "", ""]
    sut.store.record_service(MODEL, 0.2, first.slot)
    assert "infer:1" in sut.store.throughput(MODEL, now=time.monotonic()).service_times_by_kind
