"""What a replica of the Redis store takes from Redis's order and from its clock.

A queued request's leave-by passes on its replica while the grant Redis made for it is on its way
there: Redis ordered the grant before the withdrawal, so the request takes the slot. Ending the
wait at once, the gateway expired requests Redis had granted in time (on a 3:1 flood, a third of
the lighter tenant's expiries) and gave back the slot it had just been handed. And a slot's
service time is the time Redis held it."""

from __future__ import annotations

import time

import pytest

from gateway.queues.base import Flow, Granted, Queued, Slot
from gateway.queues.redis import grants
from gateway.queues.redis.codec import Displaced, Grant
from gateway.queues.redis.grants import ModelState
from gateway.queues.redis.store import RedisQueue
from policies.outcomes import Outcome
from tests.contract.conftest import MODEL
from tests.contract.redis_cluster import SLOTS, Cluster
from tests.eventually import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.redis]
FLOW = Flow(MODEL, 0, "")


async def holding_every_slot(cluster: Cluster) -> tuple[RedisQueue, list[Slot]]:
    first = await cluster.start("r1")
    offers = [await first.offer(FLOW, 1.0, 30.0, 1e9, time.monotonic()) for _ in range(SLOTS)]
    assert all(isinstance(offer, Granted) for offer in offers)
    return first, [offer.slot for offer in offers if isinstance(offer, Granted)]


async def with_grants_held_back(
    cluster: Cluster,
) -> tuple[RedisQueue, list[tuple[ModelState, Grant | Displaced]]]:
    """A second replica whose grants from its list wait in the returned list until the test
    delivers them (through the replica's own delivery)."""
    second = cluster.replica("r2")
    held_back: list[tuple[ModelState, Grant | Displaced]] = []
    second._deliver = lambda state, grant: held_back.append((state, grant))  # type: ignore[method-assign]
    await second.start()
    cluster.running.append(second)
    return second, held_back


async def test_a_grant_redis_made_before_the_withdrawal_reached_it_serves_the_request(cluster):
    first, slots = await holding_every_slot(cluster)
    second, held_back = await with_grants_held_back(cluster)
    queued = await second.offer(FLOW, 1.0, 30.0, 1e9, time.monotonic())
    assert isinstance(queued, Queued)
    await first.release(slots[0], time.monotonic())  # Redis grants the ticket: the grant is on its way
    await eventually(lambda: held_back)
    second.expire(queued.ticket)  # its leave-by passes before the grant arrives
    await second.settle()  # the withdrawal reached Redis, which had granted the ticket already
    assert not queued.ticket.wakeup.done()
    RedisQueue._deliver(second, *held_back.pop())
    slot = await queued.ticket.wakeup
    assert isinstance(slot, Slot)
    assert await cluster.slots_in_use() == SLOTS
    await second.release(slot, time.monotonic())
    await second.settle()
    assert await cluster.slots_in_use() == SLOTS - 1


async def test_a_grant_that_does_not_come_in_time_is_given_back_when_it_does(cluster, monkeypatch):
    monkeypatch.setattr(grants, "GRANT_ON_ITS_WAY_S", 0.05)
    first, slots = await holding_every_slot(cluster)
    second, held_back = await with_grants_held_back(cluster)
    queued = await second.offer(FLOW, 1.0, 30.0, 1e9, time.monotonic())
    assert isinstance(queued, Queued)
    await first.release(slots[0], time.monotonic())
    await eventually(lambda: held_back)
    second.expire(queued.ticket)
    assert await queued.ticket.wakeup is Outcome.DEADLINE_EXPIRED_IN_QUEUE
    await second.withdraw(queued.ticket, Outcome.DEADLINE_EXPIRED_IN_QUEUE)  # as its waiter does
    RedisQueue._deliver(second, *held_back.pop())  # late: the slot goes back, not to the request
    await second.settle()
    assert await cluster.slots_in_use() == SLOTS - 1


async def test_a_ticket_redis_still_holds_is_withdrawn_when_its_leave_by_passes(cluster):
    await holding_every_slot(cluster)
    second, _ = await with_grants_held_back(cluster)
    queued = await second.offer(FLOW, 1.0, 30.0, 1e9, time.monotonic())
    assert isinstance(queued, Queued)
    second.expire(queued.ticket)
    assert await queued.ticket.wakeup is Outcome.DEADLINE_EXPIRED_IN_QUEUE
    await second.settle()
    assert second.stats(MODEL).queued_by_band == (0,)


async def test_a_leases_service_time_is_the_time_redis_held_it(cluster):
    """The pool reading of admission counts hand-overs by the service times: a slot's comes back
    to Redis a grant's way, a send, the backend's time, an answer and a release's way after Redis
    handed it over. Timed by the backend alone, Redis's hand-overs came later than admission
    counted, and work admitted at the edge of its allowance expired."""
    first, slots = await holding_every_slot(cluster)
    cluster.now += 0.5  # on Redis's clock, the first slot was held half a second
    first.record_service(MODEL, 0.001, slots[0])  # though its backend answered in a millisecond
    await first.release(slots[0], time.monotonic())
    # One sample of half a second takes the estimate up from the pool's expected 40 ms; the
    # backend's millisecond would have taken it down.
    assert first.throughput(MODEL, time.monotonic()).service_time_s > 0.06
    assert not first._models[MODEL].timed  # nothing kept for a lease Redis has freed
