"""The Redis store's sequence pins over time, which the stores-agree machine cannot reach (its clock
moves seconds, a pin lives PIN_IDLE_S): a pin holds PIN_IDLE_S past its request's leave-by, then
lapses and its sequence is pinned anew to the least loaded backend; an end forgets it at once.
The memory store's own are in tests/unit/test_sequences.py."""

from __future__ import annotations

import pytest

from gateway.queues.base import Flow, Granted, Queued, Slot
from gateway.upstream.backends import BackendState, ModelPool
from policies.outcomes import Outcome
from policies.sequences import PIN_IDLE_S, SequenceRef
from tests.contract.conftest import MODEL
from tests.contract.redis_cluster import UPSTREAM_TIMEOUT_S
from tests.eventually import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.redis]
ALLOWED_S = 30.0


def two_backends() -> ModelPool:
    backends = [
        BackendState(MODEL, f"http://127.0.0.1:{port}", 1, "/v2/health/ready", ready=True)
        for port in (9000, 9001)
    ]
    return ModelPool(MODEL, backends, expected_service_s=0.04, upstream_timeout_s=UPSTREAM_TIMEOUT_S)


async def offer(store, now: float, sequence: SequenceRef | None):
    return await store.offer(Flow(MODEL, 0, ""), 1.0, ALLOWED_S, 10.0**9, now, sequence=sequence)


async def on(answer, port: int) -> Slot:
    """The slot `answer` got on the backend at `port`: at once, or by the dispatch its own offer ran
    (a request of no sequence queued behind a pinned one is handed the free slot right away)."""
    if isinstance(answer, Queued):
        await eventually(lambda: answer.ticket.wakeup.done())
        slot = answer.ticket.wakeup.result()
    else:
        assert isinstance(answer, Granted), answer
        slot = answer.slot
    assert slot.backend.url.endswith(f":{port}"), slot.backend.url
    return slot


async def test_a_pin_holds_its_idle_time_past_its_last_requests_leave_by_then_lapses(cluster):
    store = await cluster.start("r1", model=two_backends())
    start = cluster.now
    s = SequenceRef("s")
    first = await on(await offer(store, cluster.now, s), 9000)  # both free: the first listed
    waits = await offer(store, cluster.now, s)
    assert isinstance(waits, Queued)  # its backend is full; the other's slot is not for it
    other = await on(await offer(store, cluster.now, None), 9001)
    await store.release(first, cluster.now)
    await eventually(lambda: waits.ticket.wakeup.done())
    second = waits.ticket.wakeup.result()
    assert second.backend.url.endswith(":9000")  # pinned until its leave-by + PIN_IDLE_S
    for slot in (second, other):
        await store.release(slot, cluster.now)
    await store.settle()

    await cluster.advance_to(start + ALLOWED_S + PIN_IDLE_S - 1, beating=store)
    plain = await on(await offer(store, cluster.now, None), 9000)
    still = await offer(store, cluster.now, s)
    assert isinstance(still, Queued)  # still pinned to the busy one
    await store.withdraw(still.ticket, Outcome.CLIENT_DISCONNECTED)

    await cluster.advance_to(start + ALLOWED_S + PIN_IDLE_S + 1, beating=store)
    moved = await on(await offer(store, cluster.now, s), 9001)  # lapsed: pinned anew, to the least loaded
    await store.release(plain, cluster.now)
    await store.settle()
    follows = await offer(store, cluster.now, SequenceRef("s", end=True))
    assert isinstance(follows, Queued)  # its new backend is busy, the free one is not its own
    await store.release(moved, cluster.now)
    await eventually(lambda: follows.ticket.wakeup.done())
    ended = follows.ticket.wakeup.result()
    assert ended.backend.url.endswith(":9001")
    # Its end forgot the pin: the next request of `s` goes where dispatch sends any.
    assert await cluster.client.hget(f"{cluster.tag}:pins", "s") is None
    await on(await offer(store, cluster.now, s), 9000)


async def test_many_live_pins_are_swept_now_and_then_not_on_every_request(cluster):
    store = await cluster.start("r1", model=two_backends())
    pins = f"{cluster.tag}:pins"
    now = cluster.now
    # 4095 pins, 100 of them past their time: the next request's pin makes 4096, and a sweep.
    live = {f"s-{i}": f"{now + 100:.6f}|http://127.0.0.1:9000" for i in range(3995)}
    past = {f"old-{i}": f"{now - 1:.6f}|http://127.0.0.1:9000" for i in range(100)}
    await cluster.client.hset(pins, mapping=live | past)
    await on(await offer(store, now, SequenceRef("new")), 9000)
    assert await cluster.client.hlen(pins) == 3996
    assert float(await cluster.client.hget(f"{cluster.tag}:stats", "pin_sweep_at")) == 2 * 3996
    # Past 4096 again but below twice what it left, a new pin sweeps nothing: one past its time stays.
    more = {f"more-{i}": f"{now + 100:.6f}|http://127.0.0.1:9000" for i in range(100)}
    await cluster.client.hset(pins, mapping=more | {"old-again": f"{now - 1:.6f}|http://127.0.0.1:9000"})
    await on(await offer(store, now, SequenceRef("fresh")), 9001)  # the least loaded
    assert await cluster.client.hlen(pins) == 4098 and await cluster.client.hexists(pins, "old-again")
