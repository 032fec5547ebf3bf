"""The admitted call over the memory store and the real controller, with a scripted upstream work
and ingress: whatever the ingress or the work does, the slot is released exactly once, only when
the work says the backend is done (or at once when no work was started), and the outcome is
counted exactly once."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from gateway.flow.admitted import Admission, AdmittedCall, RequestMeta
from gateway.flow.controller import AdmissionController, Lease, Refusal
from gateway.flow.drain import Drain
from gateway.queues.base import STORE_PROBE_INTERVAL_S, Slot
from gateway.queues.memory.store import MemoryQueue
from gateway.settings import Estimation, PriorityClass
from gateway.telemetry.metrics import GatewayMetrics
from gateway.upstream.backends import BackendState, ModelPool
from policies.outcomes import Outcome
from tests.eventually import eventually

pytestmark = pytest.mark.anyio
META = RequestMeta(priority="low", band=0, tenant=None, budget_s=None)


class Work:
    """An upstream exchange that the test ends: `started` once granted, `finish` when the backend is done."""

    def __init__(self, *, starts: bool = True, prepares: bool = True) -> None:
        self.on_done: Callable[[float | None], None] | None = None
        self.starts = starts
        self.prepares = prepares
        self.started = False
        self.prepared_before_start = False
        self.prepared = 0
        self.closed = 0

    def prepare(self) -> None:
        if not self.prepares:
            raise RuntimeError("the request could not be serialized")
        self.prepared += 1
        self.prepared_before_start = not self.started

    def start_at_grant(self, slot: Slot) -> None:
        self.started = self.starts

    def close(self) -> bool:
        self.closed += 1
        return self.started

    def finish(self) -> None:
        """The backend is done: reported to whoever still listens (the call stops after the first)."""
        if self.on_done is not None:
            self.on_done(0.04)


class Ingress:
    def __init__(self, answer: Callable[[], Outcome]) -> None:
        self._answer = answer
        self.refused: list[Refusal] = []
        self.gone = asyncio.Event()

    async def until_disconnect(self) -> None:
        await self.gone.wait()

    async def answer(self, lease: Lease) -> Outcome:
        return self._answer()

    async def refuse(self, refusal: Refusal) -> None:
        self.refused.append(refusal)


class Rig:
    def __init__(self, slots: int = 1, max_wait_ms: int = 5000, metrics_class: type = GatewayMetrics) -> None:
        self.pool = ModelPool("m", [BackendState("m", "http://127.0.0.1:9", slots, "/", ready=True)], 0.04)
        self.store = MemoryQueue([self.pool], 1, Estimation())
        self.registry = CollectorRegistry()
        self.metrics = metrics = metrics_class(self.registry)
        controller = AdmissionController(
            self.store, [PriorityClass(name="low", max_wait_ms=max_wait_ms)], metrics
        )
        self.admission = Admission(controller, metrics, Drain(), no_backend_retry_s=1.0)

    def call(self, work: Work, ingress: Ingress, meta: RequestMeta = META) -> AdmittedCall:
        return AdmittedCall(self.admission, self.pool, meta, work, ingress)

    @property
    def free(self) -> int:
        return self.store.stats("m").free_slots

    def counted(self, outcome: Outcome) -> float:
        labels = {"model": "m", "priority": "low", "outcome": outcome.value}
        return self.registry.get_sample_value("gateway_requests_total", labels) or 0.0


def answers(outcome: Outcome) -> Callable[[], Outcome]:
    return lambda: outcome


def fails() -> Outcome:
    raise ConnectionResetError("the client's socket broke while answering")


async def test_the_slot_is_released_when_the_work_is_done_not_when_the_answer_is():
    rig = Rig()
    work = Work()
    await rig.call(work, Ingress(answers(Outcome.CLIENT_DISCONNECTED))).run()
    assert (rig.free, work.closed) == (0, 1)  # the backend still works on it
    work.finish()
    work.finish()  # a second report changes nothing
    assert rig.free == 1
    assert rig.counted(Outcome.CLIENT_DISCONNECTED) == 1


async def test_an_ingress_that_raises_still_counts_once_and_leaks_nothing():
    rig = Rig()
    work = Work()
    with pytest.raises(ConnectionResetError):
        await rig.call(work, Ingress(fails)).run()
    work.finish()
    assert rig.free == 1
    assert rig.counted(Outcome.CLIENT_DISCONNECTED) == 1


class RaisingWork(Work):
    def start_at_grant(self, slot: Slot) -> None:
        raise RuntimeError("the hook failed (a metrics call, a serialization)")


class BrokenMetrics(GatewayMetrics):
    """Metrics whose `broken` call raises: a bug in them must cost no slot."""

    broken = ""

    def observe_queue_wait(self, *args: object) -> None:
        self._maybe_break("observe_queue_wait")
        super().observe_queue_wait(*args)  # type: ignore[arg-type]

    def count_admitted_into_queue(self, *args: object) -> None:
        self._maybe_break("count_admitted_into_queue")
        super().count_admitted_into_queue(*args)  # type: ignore[arg-type]

    def _maybe_break(self, name: str) -> None:
        if self.broken == name:
            raise RuntimeError(f"{name} broke")


async def test_a_hook_that_raises_at_a_grant_at_the_offer_costs_no_slot():
    rig = Rig()
    with pytest.raises(RuntimeError):
        await rig.call(RaisingWork(), Ingress(answers(Outcome.OK))).run()
    assert (rig.free, rig.pool.backends[0].inflight) == (1, 0)
    assert rig.counted(Outcome.CLIENT_DISCONNECTED) == 1


async def test_metrics_that_raise_after_a_grant_at_the_offer_cost_no_slot():
    rig = Rig(metrics_class=BrokenMetrics)
    rig.metrics.broken = "observe_queue_wait"
    work = Work()
    with pytest.raises(RuntimeError):
        await rig.call(work, Ingress(answers(Outcome.OK))).run()
    work.finish()  # it was started: its slot comes back when the backend is done
    assert (rig.free, rig.pool.backends[0].inflight) == (1, 0)


async def test_metrics_that_raise_once_queued_leave_no_ticket_for_nobody():
    rig = Rig(metrics_class=BrokenMetrics)
    first = Work()
    await rig.call(first, Ingress(answers(Outcome.OK))).run()  # holds the only slot
    rig.metrics.broken = "count_admitted_into_queue"
    orphan = Work(starts=False)
    with pytest.raises(RuntimeError):
        await rig.call(orphan, Ingress(answers(Outcome.OK))).run()
    rig.metrics.broken = ""
    assert rig.store.stats("m").queued_by_band == (0,)
    first.finish()  # the slot would go to the ticket of a call that is gone, and stay there
    assert (rig.free, rig.pool.backends[0].inflight) == (1, 0)


async def test_a_slot_no_work_was_started_on_goes_back_at_once():
    rig = Rig()
    await rig.call(Work(starts=False), Ingress(answers(Outcome.UPSTREAM_ERROR))).run()
    assert rig.free == 1
    assert rig.counted(Outcome.UPSTREAM_ERROR) == 1


async def test_a_call_cancelled_while_queued_leaves_nothing_behind():
    rig = Rig()
    first = Work()
    await rig.call(first, Ingress(answers(Outcome.OK))).run()  # holds the only slot
    queued_work = Work()
    queued = asyncio.ensure_future(rig.call(queued_work, Ingress(answers(Outcome.OK))).run())
    await eventually(lambda: rig.store.stats("m").queued_by_band == (1,))
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert rig.store.stats("m").queued_by_band == (0,)
    first.finish()
    assert rig.free == 1 and not queued_work.started
    assert (rig.counted(Outcome.OK), rig.counted(Outcome.CLIENT_DISCONNECTED)) == (1, 1)


async def test_a_wait_the_store_ends_as_unavailable_is_told_when_to_come_back():
    rig = Rig()
    first = Work()
    await rig.call(first, Ingress(answers(Outcome.OK))).run()  # holds the only slot
    ingress = Ingress(answers(Outcome.OK))
    queued = asyncio.ensure_future(rig.call(Work(), ingress).run())
    await eventually(lambda: rig.store.stats("m").queued_by_band == (1,))
    rig.store.refuse_waiting("m", Outcome.STORE_UNAVAILABLE)  # as the failover does when Redis goes
    await queued
    assert [r.outcome for r in ingress.refused] == [Outcome.STORE_UNAVAILABLE]
    assert ingress.refused[0].retry_after_s == STORE_PROBE_INTERVAL_S  # a 503 with its Retry-After
    first.finish()
    assert rig.free == 1


async def test_a_refusal_is_counted_once_and_told_to_the_client():
    rig = Rig()
    rig.admission.drain.draining = True
    ingress = Ingress(answers(Outcome.OK))
    await rig.call(Work(), ingress).run()
    assert [r.outcome for r in ingress.refused] == [Outcome.DRAINING]
    assert rig.counted(Outcome.DRAINING) == 1
    assert rig.free == 1


async def test_a_refusal_cut_by_the_drain_while_it_is_written_is_counted_once_and_not_answered_again():
    """A client slow to read its 429 when the drain's time runs out: the cut ends the write, and
    the request is neither counted again nor answered a second time (as a 503 draining)."""
    rig = Rig()
    rig.admission.drain.draining = True
    ingress = Ingress(answers(Outcome.OK))
    writing = asyncio.Event()

    async def refuse_slowly(refusal: Refusal) -> None:
        ingress.refused.append(refusal)
        writing.set()
        await asyncio.Event().wait()  # the client's socket buffer is full

    ingress.refuse = refuse_slowly  # type: ignore[method-assign]
    drain = rig.admission.drain
    endpoint_errors: list[BaseException] = []

    async def request() -> None:  # as gateway.http.intake.AdmittedEndpoint runs it
        drain.started()
        try:
            await rig.call(Work(), ingress).run()
        except asyncio.CancelledError as error:
            endpoint_errors.append(error)  # the endpoint would count and answer it again
            raise
        finally:
            drain.finished()

    task = asyncio.ensure_future(request())
    await writing.wait()
    assert drain.cut() == 1
    await task
    assert endpoint_errors == []
    assert [r.outcome for r in ingress.refused] == [Outcome.DRAINING]
    assert rig.counted(Outcome.DRAINING) == 1


async def test_a_call_cut_between_its_grant_and_its_turn_holds_the_slot_until_its_backend_is_done():
    """The grant's hook has sent the request; the drain's cut lands before the call's task runs.
    The slot must stay held while the backend computes, not be given back as unused."""
    rig = Rig()
    first, second = Work(), Work()
    await rig.call(first, Ingress(answers(Outcome.OK))).run()  # holds the only slot until `finish`
    drain = rig.admission.drain

    async def request() -> None:
        drain.started()
        try:
            await rig.call(second, Ingress(answers(Outcome.OK))).run()
        finally:
            drain.finished()

    task = asyncio.ensure_future(request())
    await eventually(lambda: rig.store.stats("m").queued_by_band == (1,), what="the second to queue")
    first.finish()  # its slot goes to the second, whose hook starts its exchange
    assert second.started
    drain.cut()  # in the same turn of the loop, before the second's task resumes
    await task
    assert rig.free == 0  # the backend still computes the second request
    second.finish()
    assert rig.free == 1


async def test_work_is_prepared_while_queued_and_never_for_a_request_refused_or_granted_at_once():
    rig = Rig()
    first = Work()
    await rig.call(first, Ingress(answers(Outcome.OK))).run()  # granted at once: holds the only slot
    queued_work = Work()
    queued = asyncio.ensure_future(rig.call(queued_work, Ingress(answers(Outcome.OK))).run())
    await eventually(lambda: rig.store.stats("m").queued_by_band == (1,))
    assert queued_work.prepared == 1 and not queued_work.started
    refused, refusal = Work(), Ingress(answers(Outcome.OK))
    hopeless = RequestMeta(priority="low", band=0, tenant=None, budget_s=0.001)  # below one service
    await rig.call(refused, refusal, hopeless).run()
    assert [r.outcome for r in refusal.refused] == [Outcome.BUDGET_TOO_SMALL]
    first.finish()
    await queued
    assert (first.prepared, refused.prepared) == (0, 0)
    assert queued_work.started and queued_work.prepared_before_start


async def test_a_request_the_store_finds_no_room_for_is_refused_unprepared():
    rig = Rig(max_wait_ms=1)  # behind a busy slot, no wait fits
    first = Work()
    await rig.call(first, Ingress(answers(Outcome.OK))).run()
    refused, refusal = Work(), Ingress(answers(Outcome.OK))
    await rig.call(refused, refusal).run()
    assert [r.outcome for r in refusal.refused] == [Outcome.QUEUE_FULL]
    assert refused.prepared == 0 and not refused.started
    first.finish()
    assert rig.free == 1


async def test_a_work_that_fails_to_get_ready_leaves_no_ticket_in_the_queue():
    rig = Rig()
    first = Work()
    await rig.call(first, Ingress(answers(Outcome.OK))).run()  # holds the only slot
    with pytest.raises(RuntimeError):
        await rig.call(Work(prepares=False), Ingress(answers(Outcome.OK))).run()
    assert rig.store.stats("m").queued_by_band == (0,)
    first.finish()
    assert rig.free == 1  # not handed to the ticket of a call that is gone


async def test_finished_calls_are_freed_without_the_cycle_collector():
    """A call and its work must not hold each other once done: under load every request's objects
    would wait for the cycle collector, whose pauses stall the event loop for milliseconds."""
    rig = Rig()
    served, left, refused = Work(), Work(), Work()
    gone = [weakref.ref(w) for w in (served, left, refused)]
    gc.disable()
    try:
        await rig.call(served, Ingress(answers(Outcome.OK))).run()
        served.finish()
        await rig.call(left, Ingress(answers(Outcome.CLIENT_DISCONNECTED))).run()
        left.finish()  # the backend ends after its client left
        rig.admission.drain.draining = True
        await rig.call(refused, Ingress(answers(Outcome.OK))).run()
        del served, left, refused
        assert [ref() for ref in gone] == [None, None, None]
    finally:
        gc.enable()
