"""A Redis batch grant read before some of its tickets' offers replied: the slot counts the
members not told yet (Slot.awaiting), and says once when every one is settled, so that a batch
never starts without a member that holds the same slot (gateway.queues.redis.grants)."""

from __future__ import annotations

import pytest

from gateway.queues.base import Batching, Flow
from gateway.queues.estimates import PoolEstimates
from gateway.queues.redis.codec import Grant
from gateway.queues.redis.grants import UNCLAIMED_AFTER_S, ModelState
from gateway.settings import Estimation
from gateway.upstream.backends import BackendState, ModelPool

pytestmark = pytest.mark.anyio
FLOW = Flow("m", 0)
BATCHING = Batching("k", 8.0)


def model_state() -> ModelState:
    pool = ModelPool("m", [BackendState("m", "http://127.0.0.1:9", 1, "/", ready=True)], 0.05)
    return ModelState(pool, "{t:m}", PoolEstimates(1, 0.05, Estimation()), 1, 0.0)


async def test_a_batch_is_settled_once_every_granted_ticket_is_claimed_or_withdrawn():
    state = model_state()
    head = state.queued(FLOW, 1.0, "a", BATCHING, 10.0)
    settled: list[int] = []
    assert state.deliver(Grant(("a", "b", "c"), "lease-1", "http://127.0.0.1:9", 3.0, 0), now=0.0) is None
    slot = head.wakeup.result()
    assert slot.batch == (head,)
    assert slot.awaiting == 2  # b's and c's offers have not replied yet
    slot.on_settled = lambda: settled.append(slot.awaiting)

    second = state.queued(FLOW, 1.0, "b", BATCHING, 10.0)  # b's offer replies: it takes the slot
    assert second.wakeup.result() is slot
    assert slot.batch == (head, second)
    assert slot.awaiting == 1 and settled == []

    assert state.granted_before_withdrawal("c", now=0.1) is None  # c left before its reply came
    assert settled == [0]
    second_time = slot.on_settled
    assert second_time is None  # said once


async def test_a_member_whose_reply_never_comes_is_settled_by_the_sweep():
    state = model_state()
    state.queued(FLOW, 1.0, "a", BATCHING, 10.0)
    state.deliver(Grant(("a", "lost"), "lease-1", "http://127.0.0.1:9", 2.0, 0), now=0.0)
    (slot,) = state.held.values()
    settled: list[bool] = []
    slot.on_settled = lambda: settled.append(True)
    assert state.sweep(UNCLAIMED_AFTER_S / 2) == [] and settled == []
    assert state.sweep(UNCLAIMED_AFTER_S + 1) == []  # the slot is the head's: nothing to give back
    assert settled == [True] and slot.awaiting == 0
