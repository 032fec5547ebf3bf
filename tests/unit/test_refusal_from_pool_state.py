"""A refusal's Retry-After where service times vary more than exponential ones: the requests that
hold the slots now have longer left than the drain rate says, and the advice reads the pool."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry

from gateway.flow.controller import AdmissionController
from gateway.flow.predictions import Predictions
from gateway.flow.verdicts import Lease, Refusal
from gateway.queues.base import Flow
from gateway.queues.memory.store import MemoryQueue
from gateway.settings import Estimation, PriorityClass
from gateway.telemetry.metrics import GatewayMetrics
from gateway.upstream.backends import BackendState, ModelPool
from policies.admission import (
    AdmissionConfig,
    AdmissionRequest,
    PoolWait,
    confident_wait_s,
    refuse,
    work_limit,
)
from policies.service_times import ServiceTimes
from policies.wait import QueueStats, Throughput, work_to_drain
from tests.eventually import eventually
from tests.unit.test_predictions import HeldReadings, learned

pytestmark = pytest.mark.anyio

CONFIG = AdmissionConfig()
REQUEST = AdmissionRequest(band=0, max_queue_wait_s=1.0)
CONFIDENCE = 0.977
NOW = 100.0


def long_tailed() -> Throughput:
    """90% of requests take 0.1 s, 10% take 10 s (a chat pool's long generations)."""
    times = ServiceTimes(prior_mean_s=1.0)
    rng = random.Random(0)
    for _ in range(3000):
        times.record(10.0 if rng.random() < 0.1 else 0.1)
    return Throughput(
        times.mean_s, 4 / times.mean_s, (0.0,), (0.0,), service_cv=times.cv, service_times=times
    )


async def never() -> None:
    await asyncio.Event().wait()


# Four requests have run 2 s: by now they are likely the long ones.
STATS = QueueStats(queued_by_band=(0,), free_slots=0, started_at=(NOW - 2.0,) * 4)


def admitted_at(flow: Throughput, at: float) -> bool:
    return work_limit(REQUEST, STATS, flow, at, CONFIDENCE, CONFIG) >= 1.0


def test_a_refusal_told_from_the_pool_is_admitted_when_it_comes_back():
    flow = long_tailed()
    assert not admitted_at(flow, NOW)
    by_rate = refuse(REQUEST, STATS, flow, 0.5, CONFIG)
    assert not admitted_at(flow, NOW + by_rate.excess_wait_s), "the drain rate alone promises too early"
    read = PoolWait(
        work_to_drain(STATS, 0, flow.handover_cost), confident_wait_s(STATS, flow, 0, NOW, CONFIDENCE)
    )
    by_pool = refuse(REQUEST, STATS, flow, 0.5, CONFIG, pool_wait=read)
    assert admitted_at(flow, NOW + by_pool.excess_wait_s + 0.05)
    assert by_pool.excess_wait_s < 2 * (read.wait_s - REQUEST.max_queue_wait_s) + 0.5  # and not far later


def test_the_pool_wait_is_read_only_where_service_times_vary_more_than_exponential_ones():
    readings = HeldReadings()
    predictions = Predictions(1, CONFIG, run_steps=readings)  # type: ignore[arg-type]
    assert predictions.pool_wait(0, STATS, learned(0.04), NOW, CONFIDENCE) is None
    assert readings.pending == []  # a fixed service time: the drain rate says as much
    flow = long_tailed()
    assert predictions.pool_wait(0, STATS, flow, NOW, CONFIDENCE) is None  # read a step per turn
    assert predictions.pool_wait(0, STATS, flow, NOW, CONFIDENCE) is None
    assert len(readings.pending) == 1, "one reading at a time"
    readings.land()
    held = predictions.pool_wait(0, STATS, flow, NOW + 0.5, CONFIDENCE)
    assert held is not None and held.wait_s > 5.0  # the long ones' residual, not the mean's
    # Another slot count: not served, read again.
    fewer = QueueStats(queued_by_band=(0,), free_slots=1, started_at=(NOW - 2.0,) * 3)
    assert predictions.pool_wait(0, fewer, flow, NOW + 0.6, CONFIDENCE) is None
    assert len(readings.pending) == 1


async def test_the_controller_tells_a_refusal_the_pools_wait_once_it_is_read():
    clock = [NOW - 2.0]
    pool = ModelPool("m", [BackendState("m", "http://127.0.0.1:9", 4, "/", ready=True)], 1.0)
    store = MemoryQueue([pool], 1, Estimation(), clock=lambda: clock[0])
    rng = random.Random(0)
    for _ in range(3000):
        store.record_service("m", 10.0 if rng.random() < 0.1 else 0.1)
    controller = AdmissionController(
        store,
        [PriorityClass(name="low", max_wait_ms=1000)],
        GatewayMetrics(CollectorRegistry()),
        clock=lambda: clock[0],
        jitter=lambda: 0.5,
    )
    for _ in range(4):  # four requests that have run 2 s by now
        assert isinstance(await controller.acquire(Flow("m", 0), 1.0, None, never), Lease)
    clock[0] = NOW
    first = await controller.acquire(Flow("m", 0), 1.0, None, never)
    assert isinstance(first, Refusal) and first.retry_after_s is not None
    await eventually(
        lambda: (
            controller._admission_of("m").predictions.pool_wait(
                0, store.stats("m"), store.throughput("m", NOW), NOW, 0.977
            )
            is not None
        ),
        what="the pool's wait read",
    )
    later = await controller.acquire(Flow("m", 0), 1.0, None, never)
    assert isinstance(later, Refusal) and later.retry_after_s is not None
    assert later.retry_after_s > first.retry_after_s + 3.0  # the long generations' residual, seconds on
