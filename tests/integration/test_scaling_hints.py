"""gateway_desired_replicas follows the load up and back down, without flapping."""

from __future__ import annotations

import asyncio
import itertools
import time

import aiohttp
import pytest

from tests.integration.servers import gateway_config

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}


async def test_desired_replicas_rise_with_load_and_fall_back_once_it_stops(start_sim, start_gateway):
    sim = start_sim(slots=2, base_ms=50)
    config = gateway_config(
        [(sim.url, 2)],
        expected_service_ms=50,
        autoscaling={
            "target_wait_ms": 20,
            "window_s": 0.5,
            "scale_down_window_s": 1.5,
            "interval_ms": 100,
        },
    )
    config["priorities"] = [{"name": "high", "max_wait_ms": 5000}, {"name": "low", "max_wait_ms": 5000}]
    gateway = start_gateway(config)
    samples: list[float] = []
    load_until = time.monotonic() + 3.0
    stop_at = load_until + 4.0

    async def watch() -> None:
        while time.monotonic() < stop_at:
            samples.append(await asyncio.to_thread(gateway.metric, "gateway_desired_replicas", model="sim"))
            await asyncio.sleep(0.1)  # the sampling period: the hint is read over time, not awaited

    async def load(http: aiohttp.ClientSession) -> None:
        # 60 requests per second of 50 ms work: 3 slots busy on average, so beyond one replica of 2.
        pending = []
        while time.monotonic() < load_until:
            pending.append(asyncio.ensure_future(http.post(gateway.url + "/v2/models/sim/infer", json=INFER)))
            await asyncio.sleep(1 / 60)  # the open-loop arrival rate under test, 60 per second
        for reply in await asyncio.gather(*pending):
            reply.release()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(watch(), load(http))

    assert samples[0] == 1
    peak = max(samples)
    assert peak >= 2
    assert samples[-1] == 1
    # One way up, one way down: the hint never turns back on its way (no flapping).
    turns = [b - a for a, b in itertools.pairwise(samples) if b != a]
    directions = [1 if step > 0 else -1 for step in turns]
    assert directions == sorted(directions, reverse=True), samples
