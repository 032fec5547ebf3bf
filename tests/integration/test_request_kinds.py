"""Service times per kind of request, through real gateways on both stores: a model that serves
short inferences and long streams predicts each from its own times, so an urgent request is admitted
when the short inferences that hold every slot end within its allowance."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.eventually import eventually
from tests.integration.servers import gateway_config

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
# 250 ms for the first token, then 40 ms each: 16 tokens make an 850 ms stream.
STREAM = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": True}
WARM_UP = 10  # of each kind, past policies.request_kinds.KIND_TRUSTED_SAMPLES


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_an_urgent_request_is_admitted_when_short_inferences_hold_the_slots(
    start_sim, start_gateway, store_section
):
    # Two slots; inferences take 250 ms and streams 850 ms. Both slots hold inferences that have just
    # started, three streams wait behind them, and a high request may wait 400 ms: the first slot
    # frees within 250 ms, and strict priority hands it to the high one. Read as the blend of both
    # kinds, each inference might run 850 ms, and the gateway refused it (429). With Redis the
    # inferences and streams run from the other replicas: the kinds travel with their leases.
    # (With inferences of 150 ms the high request was once refused on Redis, the machine running
    # slowly: the steps before it can outlast a short inference, leaving streams on both slots.)
    sim = start_sim(slots=2, base_ms=250, token_ms=40)
    classes = [{"name": "high", "max_wait_ms": 400}, {"name": "low", "max_wait_ms": 10_000}]
    config = gateway_config([(sim.url, 2)], priorities=classes, expected_service_ms=500)
    if store_section is not None:
        config["store"] = {**store_section, "replicas": 3}
    replicas = [start_gateway(config) for _ in range(1 if store_section is None else 3)]
    asked, others = replicas[-1], replicas[:-1] or replicas

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def infer(gateway, priority="low"):
            url = gateway.url + "/v2/models/sim/infer"
            async with http.post(url, json=INFER, headers={"X-Priority": priority}) as reply:
                return reply.status, (await reply.json()).get("reason")

        async def stream(gateway):
            async with http.post(gateway.url + "/v1/chat/completions", json=STREAM) as reply:
                await reply.read()
                return reply.status

        served = await asyncio.gather(
            *[infer(asked) for _ in range(WARM_UP)], *[stream(asked) for _ in range(WARM_UP)]
        )
        assert [s if isinstance(s, int) else s[0] for s in served] == [200] * (2 * WARM_UP)
        running = [asyncio.ensure_future(infer(others[i % len(others)])) for i in range(2)]
        await eventually(lambda: sim.stats()["inflight"] == 2, what="both slots held by inferences")
        waiting = [asyncio.ensure_future(stream(others[0])) for _ in range(3)]
        await eventually(lambda: others[0].metric("gateway_queue_depth", model="sim", priority="low") == 3)
        urgent = await infer(asked, "high")
        assert urgent == (200, None)
        assert [r[0] for r in await asyncio.gather(*running)] == [200, 200]
        assert await asyncio.gather(*waiting) == [200] * 3
    assert sim.stats()["peak_inflight"] <= 2
