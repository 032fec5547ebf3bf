"""Admission's margin is calibrated against what happened: requests that queued and were served in
time loosen it, one that expired in the queue tightens it; both the prediction and the outcome
are exported side by side."""

import asyncio
import json

import aiohttp
import pytest

from tests.eventually import eventually
from tests.integration.servers import gateway_config, http_post

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
STARTING = 0.97725  # the normal quantile of safety_sigmas 2


async def infer(http, gateway, priority="low"):
    async with http.post(
        gateway.url + "/v2/models/sim/infer", json=INFER, headers={"X-Priority": priority}
    ) as reply:
        await reply.read()
        return reply.status


async def test_requests_served_in_time_from_the_queue_loosen_the_margin(start_sim, start_gateway):
    sim = start_sim(slots=1, base_ms=30)
    gateway = start_gateway(gateway_config([(sim.url, 1)], expected_service_ms=30))
    async with aiohttp.ClientSession() as http:
        for _ in range(10):  # three at once on one slot: two of them queue, and are served in time
            assert await asyncio.gather(*(infer(http, gateway) for _ in range(3))) == [200] * 3
    queued = gateway.metric("gateway_admission_queued_total", model="sim", priority="low")
    assert queued >= 10
    # The prediction is sampled (at most one a second per class): some, never more than queued.
    assert 0 < gateway.metric("gateway_admission_predicted_wait_seconds_count", priority="low") <= queued
    assert gateway.metric("gateway_admission_confidence", model="sim", priority="low") < STARTING
    assert gateway.metric("gateway_queue_wait_seconds_count", priority="low") == 30


async def test_a_request_that_expires_in_the_queue_tightens_the_margin(start_sim, start_gateway):
    sim = start_sim(slots=1, base_ms=30)
    gateway = start_gateway(gateway_config([(sim.url, 1)], expected_service_ms=30))
    assert http_post(sim.url + "/sim/fault", json.dumps({"hang": True}).encode())[0] == 200
    async with aiohttp.ClientSession() as http:
        hung = asyncio.ensure_future(infer(http, gateway))  # holds the slot
        await eventually(lambda: gateway.metric("gateway_inflight_requests", model="sim") == 1)
        # Admitted on the prior (the hung request might end any moment), it waits its 250 ms.
        assert await infer(http, gateway, "high") == 429
        assert http_post(sim.url + "/sim/fault", b"{}")[0] == 200
        assert await hung == 200
    expired = gateway.metric_by("gateway_requests_total", "outcome", model="sim", priority="high")
    assert expired == {"deadline_expired_in_queue": 1.0}
    assert gateway.metric("gateway_admission_queued_total", model="sim", priority="high") == 1
    assert gateway.metric("gateway_admission_confidence", model="sim", priority="high") > STARTING
