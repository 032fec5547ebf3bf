"""Admission reads the pool: how long each request in flight has run, against the service times
it has measured, decides whether a queued request can be served in time, on every store."""

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from gateway.flow.controller import AdmissionController, Lease, Refusal
from gateway.queues.base import Flow
from gateway.settings import PriorityClass
from gateway.telemetry.metrics import GatewayMetrics
from policies.admission import AdmissionConfig
from policies.outcomes import Outcome
from tests.contract.conftest import MODEL
from tests.eventually import eventually

pytestmark = pytest.mark.anyio
SERVICE_S = 0.4
CLASSES = [PriorityClass(name="high", max_wait_ms=300), PriorityClass(name="low", max_wait_ms=10_000)]


async def never() -> None:
    await asyncio.Event().wait()


async def learned_controller(sut) -> AdmissionController:
    """A controller over `sut` whose store has seen every call take SERVICE_S."""
    for _ in range(300):
        sut.store.record_service(MODEL, SERVICE_S)
    metrics = GatewayMetrics(CollectorRegistry())
    return AdmissionController(sut.store, CLASSES, metrics, admission=AdmissionConfig(safety_sigmas=2.0))


async def test_a_slot_about_to_free_admits_an_urgent_request_that_can_wait_for_it(make_store):
    """The one slot's request has run 0.25 s of its 0.4 s: it frees within the 0.3 s the urgent
    request may wait. The drain rate alone (2.5 per second, 0.75 of a hand-over in 0.3 s) refused."""
    sut = await make_store(slots=(1,))
    controller = await learned_controller(sut)
    held = await controller.acquire(Flow(MODEL, 1), 1.0, None, never)
    await asyncio.sleep(0.25)  # the request in flight ages: the input of this test, not a wait for state
    waiting = asyncio.ensure_future(controller.acquire(Flow(MODEL, 0), 1.0, None, never))
    await eventually(lambda: waiting.done() or sut.store.stats(MODEL).queued_by_band == (1, 0))
    assert not waiting.done(), waiting.result()
    assert isinstance(held, Lease)
    await controller.release(held, SERVICE_S)
    assert isinstance(await waiting, Lease)


async def test_a_slot_that_just_started_refuses_an_urgent_request_it_cannot_serve_in_time(make_store):
    """The slot's request has just started: nothing frees within 0.3 s, so the request is refused
    at once rather than queued to expire."""
    sut = await make_store(slots=(1,))
    controller = await learned_controller(sut)
    held = await controller.acquire(Flow(MODEL, 1), 1.0, None, never)
    refusal = await controller.acquire(Flow(MODEL, 0), 1.0, None, never)
    assert isinstance(refusal, Refusal) and refusal.outcome is Outcome.QUEUE_FULL
    assert isinstance(held, Lease)
    await controller.release(held, SERVICE_S)
