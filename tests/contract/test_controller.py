"""The admission controller over every store: leaving the queue, by any door, leaks nothing."""

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from gateway.flow.controller import AdmissionController, Lease, Refusal
from gateway.queues.base import Batching, Flow
from gateway.settings import PriorityClass
from gateway.telemetry.metrics import GatewayMetrics
from policies.admission import AdmissionConfig
from policies.outcomes import Outcome
from policies.retry_after import RetryAfterConfig
from policies.return_schedule import OVERLOAD_RETURN_SHARE
from policies.shedding import BacklogLimits, ClusterBacklog
from tests.contract.conftest import MODEL
from tests.eventually import eventually

pytestmark = pytest.mark.anyio
CLASSES = [PriorityClass(name="high", max_wait_ms=100), PriorityClass(name="low", max_wait_ms=1000)]


def controller_for(sut) -> AdmissionController:
    return AdmissionController(
        sut.store,
        CLASSES,
        GatewayMetrics(CollectorRegistry()),
        admission=AdmissionConfig(safety_sigmas=0.0, retry=RetryAfterConfig(jitter=0.0)),
    )


async def never() -> None:
    await asyncio.Event().wait()


def queued(sut) -> tuple[int, ...]:
    return sut.store.stats(MODEL).queued_by_band


async def test_granted_at_once_when_a_slot_is_free(make_store):
    sut = await make_store(slots=(1,))
    lease = await controller_for(sut).acquire(Flow(MODEL, 1), 1.0, None, never)
    assert isinstance(lease, Lease) and lease.queue_wait_s == 0.0


async def test_queued_request_leaves_when_its_wait_limit_passes(make_store):
    sut = await make_store(slots=(1,))
    controller = controller_for(sut)
    held = await controller.acquire(Flow(MODEL, 0), 1.0, None, never)
    # Budget 0.12 s less the 0.04 s expected service: it may wait 0.08 s, and the slot never frees.
    refusal = await controller.acquire(Flow(MODEL, 0), 1.0, 0.12, never)
    assert isinstance(refusal, Refusal)
    assert refusal.outcome is Outcome.DEADLINE_EXPIRED_IN_QUEUE
    assert refusal.rule == "X-Request-Timeout-Ms"  # 0.08 s of it, within the class's 0.1 s
    assert refusal.retry_after_s is not None and refusal.retry_after_s > 0
    assert sut.store.stats(MODEL).queued_by_band == (0, 0)
    await controller.release(held)
    assert sut.store.stats(MODEL).free_slots == 1


async def test_disconnect_while_queued_leaves_the_queue_and_takes_no_slot(make_store):
    sut = await make_store(slots=(1,))
    controller = controller_for(sut)
    held = await controller.acquire(Flow(MODEL, 1), 1.0, None, never)
    gone = asyncio.Event()
    waiting = asyncio.ensure_future(controller.acquire(Flow(MODEL, 1), 1.0, None, gone.wait))
    await eventually(lambda: queued(sut) == (0, 1))
    gone.set()
    assert await waiting == Refusal(Outcome.CLIENT_DISCONNECTED)
    assert sut.store.stats(MODEL).queued_by_band == (0, 0)
    await controller.release(held)
    assert sut.backend().inflight == 0


async def test_cancelled_waiter_leaks_no_slot_even_when_granted_meanwhile(make_store):
    sut = await make_store(slots=(1,))
    controller = controller_for(sut)
    held = await controller.acquire(Flow(MODEL, 1), 1.0, None, never)
    waiting = asyncio.ensure_future(controller.acquire(Flow(MODEL, 1), 1.0, None, never))
    await eventually(lambda: queued(sut) == (0, 1))
    await sut.store.release(held.slot, now=1.0)  # the slot goes to the waiter...
    waiting.cancel()  # ...which is cancelled, before it runs again or just after
    try:
        lease = await waiting
    except asyncio.CancelledError:
        pass
    else:  # it ran first: it holds the slot and gives it back like any request
        await controller.release(lease)
    await sut.settle()
    assert sut.backend().inflight == 0
    assert sut.store.stats(MODEL).free_slots == 1


async def test_the_widest_margin_the_settings_allow_still_admits_queues_and_settles(make_store):
    sut = await make_store(slots=(1,))
    metrics = GatewayMetrics(CollectorRegistry())
    widest = AdmissionConfig(safety_sigmas=10.0, retry=RetryAfterConfig(jitter=0.0))
    controller = AdmissionController(sut.store, CLASSES, metrics, admission=widest)
    held = await controller.acquire(Flow(MODEL, 1), 1.0, None, never)
    assert isinstance(held, Lease)
    waiting = asyncio.ensure_future(controller.acquire(Flow(MODEL, 1), 1.0, None, never))
    await eventually(lambda: queued(sut) == (0, 1))
    await controller.release(held)
    lease = await waiting
    assert isinstance(lease, Lease)
    await controller.release(lease)
    assert sut.store.stats(MODEL).free_slots == 1


class Backlog:
    """The cluster's backlog as a test sets it (a gateway.flow.signal_view.SignalView)."""

    def __init__(self) -> None:
        self.now: ClusterBacklog | None = None

    def external_waiting(self, model: str) -> float:
        return 0.0

    def backlog(self) -> ClusterBacklog | None:
        return self.now


async def test_a_shed_request_is_booked_to_return_when_it_is_told_not_before(make_store):
    sut = await make_store(slots=(1,))
    cluster = Backlog()
    controller = AdmissionController(
        sut.store,
        CLASSES,
        GatewayMetrics(CollectorRegistry()),
        admission=AdmissionConfig(safety_sigmas=0.0, retry=RetryAfterConfig(jitter=0.0)),
        signals=cluster,
        backlog_limits=BacklogLimits(pending_workloads=10, admission_wait_p95_s=1.0),
    )
    held = await controller.acquire(Flow(MODEL, 0), 1.0, None, never)
    cluster.now = ClusterBacklog(pending_workloads=100, admission_wait_p95_s=20.0)
    for _ in range(40):
        shed = await controller.acquire(Flow(MODEL, 1), 1.0, None, never)
        assert isinstance(shed, Refusal) and shed.outcome is Outcome.CLUSTER_BACKLOGGED
        assert shed.retry_after_s is not None and shed.retry_after_s >= 20.0
    cluster.now = None
    # Their returns are due 20 s on: the next seconds' room is still free for this refusal's.
    refusal = await controller.acquire(Flow(MODEL, 1), 1.0, 0.05, never)
    assert isinstance(refusal, Refusal) and refusal.outcome is Outcome.DEADLINE_UNMEETABLE
    assert refusal.retry_after_s is not None and refusal.retry_after_s < 0.5
    await controller.release(held)


async def test_release_counts_once(make_store):
    sut = await make_store(slots=(2,))
    controller = controller_for(sut)
    lease = await controller.acquire(Flow(MODEL, 1), 1.0, None, never)
    await controller.acquire(Flow(MODEL, 1), 1.0, None, never)
    await controller.release(lease, service_s=0.05)
    await controller.release(lease, service_s=0.05)
    assert sut.store.stats(MODEL).free_slots == 1


async def test_overload_is_refused_at_arrival_with_a_computed_retry_after(make_store):
    sut = await make_store(slots=(1,))
    controller = controller_for(sut)
    await controller.acquire(Flow(MODEL, 0), 1.0, None, never)
    # One slot at 0.04 s drains 25/s; high may wait 0.1 s: 2 positions. The third waiter is refused.
    waiters = [asyncio.ensure_future(controller.acquire(Flow(MODEL, 0), 1.0, None, never)) for _ in range(2)]
    await eventually(lambda: queued(sut) == (2, 0))
    refusal = await controller.acquire(Flow(MODEL, 0), 1.0, None, never)
    assert isinstance(refusal, Refusal) and refusal.outcome is Outcome.QUEUE_FULL
    assert refusal.rule == "priorities[high].max_wait_ms"
    # It would wait 3/25 s, 0.02 s too long; advice is never below one slot turnover, 1/25 s, and
    # falls within the return's own slot of the band's schedule: its cost over the spare drain
    # rate, at least a fifth of the drain (policies.return_schedule).
    assert 1 / 25 <= refusal.retry_after_s <= 1 / 25 + 1 / (OVERLOAD_RETURN_SHARE * 25)
    for waiter in waiters:
        waiter.cancel()


async def test_a_contended_queue_keeps_its_room_for_the_cheaper_requests(make_store):
    sut = await make_store(slots=(1,))
    controller = controller_for(sut)
    await controller.acquire(Flow(MODEL, 1), 1.0, None, never)
    # Low may wait 1 s, in which the slot drains about 25 units: a queue of 14 leaves room for 11.
    waiters = [asyncio.ensure_future(controller.acquire(Flow(MODEL, 1), 1.0, None, never)) for _ in range(14)]
    await eventually(lambda: queued(sut) == (0, 14))
    # Costlier than every request before it, it may fill half the room beyond its hand-over (12
    # units): its 10 would take the queue to 24.
    refusal = await controller.acquire(Flow(MODEL, 1), 10.0, None, never)
    assert isinstance(refusal, Refusal) and refusal.outcome is Outcome.QUEUE_FULL
    assert refusal.retry_after_s is not None and refusal.retry_after_s > 0
    waiters.append(asyncio.ensure_future(controller.acquire(Flow(MODEL, 1), 1.0, None, never)))
    await eventually(lambda: queued(sut) == (0, 15))  # a cheap one still fits
    for waiter in waiters:
        waiter.cancel()
    await eventually(lambda: queued(sut) == (0, 0))
    # With nothing queued ahead, the costliest request is queued for the next hand-over.
    costly = asyncio.ensure_future(controller.acquire(Flow(MODEL, 1), 50.0, None, never))
    await eventually(lambda: queued(sut) == (0, 1))
    costly.cancel()


async def test_grant_hook_runs_with_the_slot_inside_the_release(make_store):
    sut = await make_store(slots=(1,))
    controller = controller_for(sut)
    held = await controller.acquire(Flow(MODEL, 1), 1.0, None, never)
    hooked: list[tuple[object, bool]] = []

    def hook(slot: object) -> None:
        hooked.append((slot, waiting.done()))

    waiting = asyncio.ensure_future(controller.acquire(Flow(MODEL, 1), 1.0, None, never, on_grant=hook))
    await eventually(lambda: queued(sut) == (0, 1))
    assert hooked == []
    await controller.release(held)
    lease = await waiting
    assert isinstance(lease, Lease)
    # The hook ran once, with the slot the waiter got, before the waiter's task went on.
    assert [(slot, done) for slot, done in hooked] == [(lease.slot, False)]
    await controller.release(lease)
    assert sut.backend().inflight == 0


async def test_a_failing_grant_hook_neither_breaks_dispatch_nor_loses_the_slot(make_store):
    sut = await make_store(slots=(1,))
    controller = controller_for(sut)
    held = await controller.acquire(Flow(MODEL, 1), 1.0, None, never)

    def broken(slot: object) -> None:
        raise RuntimeError("hook failed")

    waiting = asyncio.ensure_future(controller.acquire(Flow(MODEL, 1), 1.0, None, never, on_grant=broken))
    await eventually(lambda: queued(sut) == (0, 1))
    await controller.release(held)
    lease = await waiting
    assert isinstance(lease, Lease)
    await controller.release(lease)
    assert sut.backend().inflight == 0
    assert sut.store.stats(MODEL).free_slots == 1


async def test_a_held_batch_let_go_for_an_arrival_that_is_refused_still_gets_the_free_slot(make_store):
    sut = await make_store(slots=(1,), bands=1, cap=2.0)
    controller = AdmissionController(
        sut.store,
        [PriorityClass(name="low", max_wait_ms=2000)],
        GatewayMetrics(CollectorRegistry()),
        admission=AdmissionConfig(safety_sigmas=0.0, retry=RetryAfterConfig(jitter=0.0)),
    )
    flow = Flow(MODEL, 0)
    # At most 3 items a batch, held up to 50 ms for companions while the slot is free.
    first = asyncio.ensure_future(controller.acquire(flow, 1.0, None, never, None, Batching("k", 3.0, 0.05)))
    await eventually(lambda: queued(sut) == (1,), what="the first request held for companions")
    # Two more items fill the batch: it leaves now, with this arrival... which the queue's cap refuses.
    refused = await controller.acquire(flow, 2.0, None, never, None, Batching("k", 3.0, 0.05))
    assert isinstance(refused, Refusal) and refused.outcome is Outcome.QUEUE_FULL
    # The held request is not left beside the free slot until its deadline (2 s).
    lease = await asyncio.wait_for(first, 1.0)
    assert isinstance(lease, Lease)
    await controller.release(lease)
