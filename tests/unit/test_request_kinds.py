"""Service times per kind of request: a model that serves short inferences and long streams reads
each request in flight, and each budget, from its own kind's service times, not from their blend."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from gateway.flow.controller import AdmissionController
from gateway.flow.verdicts import Lease, Refusal
from gateway.queues.base import Flow
from gateway.queues.estimates import PoolEstimates
from gateway.queues.memory.store import MemoryQueue
from gateway.settings import Estimation, PriorityClass
from gateway.telemetry.metrics import GatewayMetrics
from gateway.upstream.backends import BackendState, ModelPool
from policies.admission import AdmissionConfig, AdmissionRequest, allowed_wait_s, work_limit
from policies.request_kinds import KIND_TRUSTED_SAMPLES, MAX_KINDS, request_kind, service_of_kind
from policies.wait import QueueStats
from tests.eventually import eventually

pytestmark = pytest.mark.anyio

SHORT, LONG = "infer:1", "chat/completions+stream:16"
SHORT_S, LONG_S = 0.15, 0.30
NOW = 100.0
CONFIDENCE = 0.977


def test_a_kind_names_the_route_the_stream_and_the_power_of_two_at_or_above_the_cost():
    assert request_kind("infer", False, 1.0) == "infer:1"
    assert request_kind("infer", False, 0.25) == "infer:1"
    assert request_kind("infer", False, 8.0) == "infer:8"
    assert request_kind("infer", False, 9.0) == "infer:16"
    assert request_kind("chat/completions", True, 200.0) == "chat/completions+stream:256"
    assert request_kind("completions", False, float("inf")) == f"completions:{2**60}"


def mixed_estimates(samples: int = 20) -> PoolEstimates:
    """A pool that served as many short inferences (0.15 s) as long streams (0.3 s)."""
    estimates = PoolEstimates(2, 0.2, Estimation())
    for _ in range(samples):
        estimates.record_service(SHORT_S, SHORT)
        estimates.record_service(LONG_S, LONG)
    return estimates


def test_a_kind_is_read_from_its_own_times_once_it_has_enough_of_them():
    estimates = PoolEstimates(1, 0.2, Estimation())
    for _ in range(KIND_TRUSTED_SAMPLES - 1):
        estimates.record_service(SHORT_S, SHORT)
    assert service_of_kind(estimates.service_times_by_kind, SHORT) is None  # the model's, until then
    estimates.record_service(SHORT_S, SHORT)
    own = service_of_kind(estimates.service_times_by_kind, SHORT)
    assert own is not None and own.mean_s == pytest.approx(SHORT_S, rel=0.01)
    assert service_of_kind(estimates.service_times_by_kind, "") is None  # a batch's: the model's
    for i in range(2 * MAX_KINDS):
        estimates.record_service(0.01, f"infer:{2**i}")
    assert len(estimates.service_times_by_kind) == MAX_KINDS  # a bounded count of kinds


def test_two_busy_short_inferences_hand_over_in_time_read_as_their_kind_not_as_the_blend():
    # Both slots hold short inferences that have run 50 ms: each ends in 100 ms. Read as the blend of
    # short and long services, each might run 250 ms more, and a 200 ms allowance looks unsafe.
    throughput = mixed_estimates().throughput(2, NOW)
    urgent = AdmissionRequest(band=0, max_queue_wait_s=0.2)
    started = (NOW - 0.05, NOW - 0.05)
    known = QueueStats((0, 3), 0, (0.0, 3.0), started_at=started, started_kinds=(SHORT, SHORT))
    blurred = QueueStats((0, 3), 0, (0.0, 3.0), started_at=started)
    assert work_limit(urgent, known, throughput, NOW, CONFIDENCE, AdmissionConfig()) >= 1.0
    assert work_limit(urgent, blurred, throughput, NOW, CONFIDENCE, AdmissionConfig()) < 1.0
    # Two long streams of the same age hold the slots for 250 ms more: refused either way.
    longs = QueueStats((0, 3), 0, (0.0, 3.0), started_at=started, started_kinds=(LONG, LONG))
    assert work_limit(urgent, longs, throughput, NOW, CONFIDENCE, AdmissionConfig()) < 1.0


def test_a_budget_sets_aside_its_own_kinds_service_time():
    throughput = mixed_estimates().throughput(2, NOW)
    short = AdmissionRequest(band=0, max_queue_wait_s=5.0, budget_s=0.4, kind=SHORT)
    blend = AdmissionRequest(band=0, max_queue_wait_s=5.0, budget_s=0.4)
    assert allowed_wait_s(short, throughput) == pytest.approx(0.4 - SHORT_S, abs=0.01)
    assert allowed_wait_s(blend, throughput) == pytest.approx(0.4 - throughput.service_time_s)
    assert allowed_wait_s(blend, throughput) < allowed_wait_s(short, throughput) - 0.03


async def never() -> None:
    await asyncio.Event().wait()


async def test_the_memory_store_admits_an_urgent_request_that_a_short_inference_frees_a_slot_for():
    clock = [NOW]
    pool = ModelPool("m", [BackendState("m", "http://127.0.0.1:9", 2, "/", ready=True)], 0.2)
    store = MemoryQueue([pool], 2, Estimation(), clock=lambda: clock[0])
    classes = [PriorityClass(name="high", max_wait_ms=200), PriorityClass(name="low", max_wait_ms=5000)]
    controller = AdmissionController(
        store, classes, GatewayMetrics(CollectorRegistry()), clock=lambda: clock[0], jitter=lambda: 0.5
    )
    low, high = Flow("m", 1), Flow("m", 0)
    for _ in range(KIND_TRUSTED_SAMPLES + 2):  # served one at a time: each measured as its kind
        for kind, service_s in ((SHORT, SHORT_S), (LONG, LONG_S)):
            lease = await controller.acquire(low, 1.0, None, never, kind=kind)
            assert isinstance(lease, Lease)
            clock[0] += service_s
            await controller.release(lease, service_s)
    running = [await controller.acquire(low, 1.0, None, never, kind=SHORT) for _ in range(2)]
    assert all(isinstance(lease, Lease) for lease in running)
    assert store.stats("m").started_kinds == (SHORT, SHORT)
    queued = [asyncio.ensure_future(controller.acquire(low, 1.0, None, never, kind=LONG)) for _ in range(3)]
    await eventually(lambda: store.stats("m").queued_by_band == (0, 3))
    clock[0] += 0.05
    urgent = asyncio.ensure_future(controller.acquire(high, 1.0, None, never, kind=SHORT))
    await eventually(lambda: urgent.done() or store.stats("m").queued_by_band == (1, 3))
    assert not urgent.done(), f"refused: {urgent.result()}"  # queued for the slot that frees first
    first = running[0]
    assert isinstance(first, Lease)
    clock[0] += 0.1
    await controller.release(first, SHORT_S)
    granted = await urgent
    assert isinstance(granted, Lease) and not isinstance(granted, Refusal)
    for waiting in queued:
        waiting.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
