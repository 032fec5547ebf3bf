"""The RequestQueue contract, run against every store (in memory, and Redis)."""

import asyncio
import time

import pytest

from gateway.queues.base import Flow, Full, Granted, Queued, Slot
from policies.outcomes import Outcome
from policies.quotas import Quota
from tests.contract.conftest import MODEL
from tests.eventually import eventually

pytestmark = pytest.mark.anyio
UNLIMITED = 10**9
ALLOWED_S = 30.0


async def offer(sut, band, max_work=UNLIMITED, cost=1.0, tenant=""):
    """Offer a request of `cost`; `max_work` is the most work it may wait to be drained."""
    return await sut.store.offer(Flow(MODEL, band, tenant), cost, ALLOWED_S, max_work, now=time.monotonic())


def counts(sut) -> tuple[tuple[int, ...], int]:
    """Requests queued per band, and free slots."""
    stats = sut.store.stats(MODEL)
    return stats.queued_by_band, stats.free_slots


async def fill(sut, n, band=1):
    return [await offer(sut, band) for _ in range(n)]


async def release(sut, slot):
    await sut.store.release(slot, now=time.monotonic())
    await sut.settle()


async def test_offer_grants_free_slots_then_queues(make_store):
    sut = await make_store(slots=(2,))
    first, second, third = await fill(sut, 3)
    assert isinstance(first, Granted) and isinstance(second, Granted)
    assert isinstance(third, Queued)
    assert counts(sut) == ((0, 1), 0)


async def test_release_hands_the_slot_to_the_oldest_waiter(make_store):
    sut = await make_store(slots=(1,))
    (held,) = await fill(sut, 1)
    waiting = [o.ticket for o in await fill(sut, 3)]
    slot, served = held.slot, []
    for _ in waiting:
        await release(sut, slot)
        granted = [t for t in waiting if t.wakeup.done() and t not in served]
        assert len(granted) == 1
        served += granted
        slot = granted[0].wakeup.result()
    assert served == waiting


async def test_strict_priority_serves_urgent_band_before_earlier_low(make_store):
    sut = await make_store(slots=(1,))
    (held,) = await fill(sut, 1)
    low = (await offer(sut, 1)).ticket
    high = (await offer(sut, 0)).ticket
    await release(sut, held.slot)
    assert high.wakeup.done() and not low.wakeup.done()


async def test_offer_refuses_beyond_the_work_limit(make_store):
    sut = await make_store(slots=(1,))
    await fill(sut, 1)  # the slot is taken
    assert isinstance(await offer(sut, 1, max_work=1), Queued)  # its own hand-over: ok
    refused = await offer(sut, 1, max_work=1)  # one request ahead, then its own: 2 > 1
    assert isinstance(refused, Full)
    assert refused.stats.queued_by_band == (0, 1)


async def test_a_negative_limit_refuses_even_with_free_slots(make_store):
    sut = await make_store(slots=(4,))
    assert isinstance(await offer(sut, 0, max_work=-1), Full)
    assert sut.store.stats(MODEL).free_slots == 4


async def test_concurrent_offers_never_exceed_the_limit(make_store):
    sut = await make_store(slots=(2,))
    offers = await asyncio.gather(*(offer(sut, 1, max_work=5) for _ in range(50)))
    granted = sum(isinstance(o, Granted) for o in offers)
    queued = sum(isinstance(o, Queued) for o in offers)
    assert granted == 2
    assert queued == 5  # 1..5 hand-overs fit; the 6th waiter would wait for 6
    await sut.settle()
    assert sut.store.stats(MODEL).queued_by_band == (0, 5)


async def test_withdraw_is_idempotent_and_updates_stats(make_store):
    sut = await make_store(slots=(1,))
    await fill(sut, 1)
    ticket = (await offer(sut, 1)).ticket
    await sut.store.withdraw(ticket, Outcome.CLIENT_DISCONNECTED)
    await sut.store.withdraw(ticket, Outcome.CLIENT_DISCONNECTED)
    assert sut.store.stats(MODEL).queued_by_band == (0, 0)
    assert ticket.wakeup.result() is Outcome.CLIENT_DISCONNECTED


async def test_withdrawn_ticket_never_takes_a_slot(make_store):
    sut = await make_store(slots=(1,))
    (held,) = await fill(sut, 1)
    gone = (await offer(sut, 1)).ticket
    kept = (await offer(sut, 1)).ticket
    await sut.store.withdraw(gone, Outcome.DEADLINE_EXPIRED_IN_QUEUE)
    await release(sut, held.slot)
    assert isinstance(await asyncio.wait_for(kept.wakeup, 2), Slot)
    assert gone.wakeup.result() is Outcome.DEADLINE_EXPIRED_IN_QUEUE


async def test_withdraw_after_a_grant_gives_the_slot_back(make_store):
    sut = await make_store(slots=(1,))
    (held,) = await fill(sut, 1)
    ticket = (await offer(sut, 1)).ticket
    await release(sut, held.slot)
    assert isinstance(ticket.wakeup.result(), Slot)  # granted, but its waiter left at that instant
    await sut.store.withdraw(ticket, Outcome.CLIENT_DISCONNECTED)
    await sut.settle()
    assert sut.store.stats(MODEL).free_slots == 1
    assert sut.backend().inflight == 0


async def test_a_grant_its_hook_claimed_stays_held_when_the_wait_is_withdrawn(make_store):
    """The hook started the request on the slot (the proxy wrote it upstream), then its waiter was
    cancelled before it ran: the slot is the caller's to release once the backend is done."""
    sut = await make_store(slots=(1,))
    (held,) = await fill(sut, 1)
    ticket = (await offer(sut, 1)).ticket
    claimed: list[Slot] = []
    ticket.on_grant = claimed.append
    await release(sut, held.slot)
    assert [ticket.wakeup.result()] == claimed
    await sut.store.withdraw(ticket, Outcome.CLIENT_DISCONNECTED)
    await sut.settle()
    assert (sut.store.stats(MODEL).free_slots, sut.backend().inflight) == (0, 1)
    await release(sut, claimed[0])
    assert (sut.store.stats(MODEL).free_slots, sut.backend().inflight) == (1, 0)


async def test_a_grant_racing_a_withdrawal_goes_back_to_the_pool(make_store):
    sut = await make_store(slots=(1,))
    (held,) = await fill(sut, 1)
    ticket = (await offer(sut, 1)).ticket
    # Release and withdraw at once: whichever wins, the slot ends up free exactly once.
    await asyncio.gather(
        sut.store.release(held.slot, now=time.monotonic()),
        sut.store.withdraw(ticket, Outcome.CLIENT_DISCONNECTED),
    )
    await sut.settle()
    assert counts(sut) == ((0, 0), 1)
    assert sut.backend().inflight == 0


async def test_release_is_idempotent(make_store):
    sut = await make_store(slots=(2,))
    first, _ = await fill(sut, 2)
    await release(sut, first.slot)
    await release(sut, first.slot)
    assert sut.store.stats(MODEL).free_slots == 1


async def test_a_cancelled_waiter_leaks_nothing(make_store):
    sut = await make_store(slots=(1,))
    (held,) = await fill(sut, 1)
    ticket = (await offer(sut, 1)).ticket
    ticket.wakeup.cancel()  # what cancelling the task that awaits it does to the wakeup
    await sut.store.withdraw(ticket, Outcome.CLIENT_DISCONNECTED)
    await release(sut, held.slot)
    assert counts(sut) == ((0, 0), 1)


async def test_no_ready_backend_fails_every_waiter(make_store):
    sut = await make_store(slots=(1,))
    await fill(sut, 1)
    waiting = [o.ticket for o in await fill(sut, 3)]
    sut.backend().ready = False
    sut.store.backends_changed(MODEL)
    await sut.settle()
    assert [t.wakeup.result() for t in waiting] == [Outcome.NO_BACKEND] * 3
    assert sut.store.stats(MODEL).queued_by_band == (0, 0)


@pytest.mark.parametrize(
    "held_back", [{"reserved": (1, 0)}, {"quotas": {"a": Quota(nominal=1)}}], ids=["reservations", "quotas"]
)
async def test_no_ready_backend_fails_every_waiter_whatever_holds_its_band_back(make_store, held_back):
    sut = await make_store(slots=(1,), **held_back)
    await offer(sut, 0, tenant="a")
    waiting = [(await offer(sut, band, tenant="a")).ticket for band in (0, 1)]
    sut.backend().ready = False
    sut.store.backends_changed(MODEL)
    await sut.settle()
    assert [t.wakeup.result() for t in waiting] == [Outcome.NO_BACKEND] * 2  # not left to expire
    assert sut.store.stats(MODEL).queued_by_band == (0, 0)


async def test_quotas_in_cost_units_let_a_costly_request_start_on_an_idle_pool(make_store):
    # 8 batch items on a pool of 4 slots, with a quota of 1 item for another tenant.
    sut = await make_store(slots=(4,), quotas={"a": Quota(nominal=1)})
    assert isinstance(await offer(sut, 0, cost=8.0, tenant="b"), Granted)
    assert isinstance(await offer(sut, 0, cost=8.0, tenant="a"), Granted)


async def test_a_backend_turning_ready_takes_waiters(make_store):
    sut = await make_store(slots=(1, 2))
    sut.backend(1).ready = False
    sut.store.backends_changed(MODEL)
    await sut.settle()
    await fill(sut, 1)
    waiting = [o.ticket for o in await fill(sut, 3)]
    sut.backend(1).ready = True
    sut.store.backends_changed(MODEL)
    await sut.settle()
    await eventually(lambda: [t.wakeup.done() for t in waiting] == [True, True, False])


async def test_slots_spread_to_the_least_loaded_backend(make_store):
    sut = await make_store(slots=(4, 4))
    offers = await fill(sut, 4)
    assert sorted(o.slot.backend.url for o in offers).count(sut.backend(0).url) == 2


async def test_drain_rate_is_measured_from_hand_overs_under_backlog(make_store):
    sut = await make_store(slots=(1,))
    (held,) = await fill(sut, 1)
    waiting = [o.ticket for o in await fill(sut, 8)]
    slot = held.slot
    for ticket in waiting:
        await asyncio.sleep(0.05)  # the behaviour under test: one hand-over every 50 ms
        await sut.store.release(slot, now=time.monotonic())
        slot = await asyncio.wait_for(ticket.wakeup, 2)
    drain = sut.store.throughput(MODEL, now=time.monotonic()).drain_rate_per_s
    assert 12 < drain < 22  # 20 per second, give or take the machine's timing


async def test_a_step_up_in_admissions_is_believed_within_one_counting_interval(make_store):
    sut = await make_store(slots=(64,))
    for _ in range(13):  # a burst, where nothing came before
        await offer(sut, 0)
    await asyncio.sleep(0.06)  # the behaviour under test: the counting interval (50 ms) ends
    await offer(sut, 0)  # the next admission closes it
    rate = sut.store.throughput(MODEL, now=time.monotonic()).admitted_rate_by_band[0]
    # 13 admissions in about 60 ms: about 200 per second. Averaging over the estimators' windows
    # alone would still say about 25 per second, and admit a lower band as if they never came.
    assert rate > 100


async def test_stats_say_when_each_slot_in_use_was_handed_over(make_store):
    sut = await make_store(slots=(3,))
    before = time.monotonic()
    first, second = await fill(sut, 2)
    after = time.monotonic()
    started = sut.store.stats(MODEL).started_at
    # On the local clock (the Redis store converts from Redis's), within a round trip.
    assert len(started) == 2 and all(before - 0.05 <= t <= after + 0.05 for t in started)
    await release(sut, first.slot)
    assert len(sut.store.stats(MODEL).started_at) == 1
    await release(sut, second.slot)
    assert sut.store.stats(MODEL).started_at == ()
