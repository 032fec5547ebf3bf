"""A found concurrency limit shared by replicas on one Redis (RequestQueue.share_limit): one leads
and its limit stands, the others take it; the lead passes once the leader stops asking."""

from __future__ import annotations

import pytest

from gateway.queues.memory.store import MemoryQueue
from gateway.settings import Estimation
from tests.contract.conftest import MODEL, make_pool

pytestmark = [pytest.mark.anyio, pytest.mark.redis]
URL = "http://127.0.0.1:9000"


async def test_one_replica_leads_and_the_others_take_its_limit(cluster):
    first, second = await cluster.start("r1"), await cluster.start("r2")
    assert await first.share_limit(MODEL, URL, 8, 3.0) == (True, 8)
    assert await second.share_limit(MODEL, URL, 2, 3.0) == (False, 8)  # its own proposal is not used
    assert await first.share_limit(MODEL, URL, 9, 3.0) == (True, 9)
    assert await second.share_limit(MODEL, URL, 2, 3.0) == (False, 9)


async def test_the_lead_passes_when_the_leader_stops_asking(cluster):
    first, second = await cluster.start("r1"), await cluster.start("r2")
    await first.share_limit(MODEL, URL, 8, 3.0)
    cluster.now += 2.9
    assert await second.share_limit(MODEL, URL, 5, 3.0) == (False, 8)
    cluster.now += 0.2  # the leader's last ask is 3.1 s old
    assert await second.share_limit(MODEL, URL, 5, 3.0) == (True, 5)
    assert await first.share_limit(MODEL, URL, 8, 3.0) == (False, 5)


async def test_a_store_of_one_replica_always_leads():
    store = MemoryQueue([make_pool((4,))], 1, Estimation())
    assert await store.share_limit(MODEL, URL, 7, 3.0) == (True, 7)
