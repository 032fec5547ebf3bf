"""The simulator's `--service-dist`: fixed service times by default, exponential (mean base-ms) on demand."""

import asyncio
import random
import statistics
import time

import aiohttp
import pytest

from gateway.tools.model_server.engine import ServiceModel

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
SLOTS, BASE_MS, PER_CLIENT = 8, 30, 30


async def service_times_s(url: str) -> list[float]:
    """One closed-loop client per slot, so that no request queues and each latency is a service time."""
    latencies: list[float] = []

    async def client(http: aiohttp.ClientSession) -> None:
        for _ in range(PER_CLIENT):
            started = time.perf_counter()
            async with http.post(url + "/v2/models/sim/infer", json=INFER) as reply:
                assert reply.status == 200
                await reply.read()
            latencies.append(time.perf_counter() - started)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(client(http) for _ in range(SLOTS)))
    return latencies


def cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.mean(values)


async def test_exponential_service_times_have_mean_base_ms_and_cv_near_one(start_sim):
    sim = start_sim(slots=SLOTS, base_ms=BASE_MS, service_dist="exponential", seed=3)
    measured = await service_times_s(sim.url)
    # Generous: 240 draws put the cv within about 0.1 of 1; HTTP adds a millisecond or two to each.
    assert 0.7 * BASE_MS / 1000 < statistics.mean(measured) < 1.4 * BASE_MS / 1000
    assert 0.7 < cv(measured) < 1.4


async def test_service_times_are_fixed_by_default(start_sim):
    sim = start_sim(slots=SLOTS, base_ms=BASE_MS)
    measured = await service_times_s(sim.url)
    # The sim's timers may fire a fraction of a millisecond early (uvloop's resolution): no lower bound.
    assert 0.9 * BASE_MS / 1000 < statistics.mean(measured) < 1.3 * BASE_MS / 1000
    assert cv(measured) < 0.35


def test_seeded_exponential_draws_repeat_and_keep_the_per_item_part_fixed():
    first = ServiceModel(30, per_item_ms=5, distribution="exponential", rng=random.Random(11))
    again = ServiceModel(30, per_item_ms=5, distribution="exponential", rng=random.Random(11))
    draws = [first.batch_s(4) for _ in range(5)]
    assert draws == [again.batch_s(4) for _ in range(5)]
    expected = random.Random(11)
    assert draws == pytest.approx([expected.expovariate(1 / 0.030) + 0.020 for _ in range(5)])


def test_long_tail_draws_have_mean_base_ms_and_a_long_tail():
    model = ServiceModel(40, distribution="long-tail", rng=random.Random(5))
    draws = [model.base_s() for _ in range(20_000)]
    assert statistics.mean(draws) == pytest.approx(0.040, rel=0.05)
    assert cv(draws) == pytest.approx(2.25, rel=0.05)
    assert sorted(set(draws)) == pytest.approx([0.010, 0.310])
