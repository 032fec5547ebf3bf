"""A backend named by host (`discover: dns`) is served through the addresses the name resolves to."""

import aiohttp
import pytest

from tests.integration.servers import gateway_config

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}


async def test_a_dns_discovered_backend_serves(start_sim, start_gateway):
    sim = start_sim(slots=2, base_ms=5)
    config = gateway_config([(sim.url, 2)], signals={"endpoints_interval_ms": 200})
    config["models"][0]["backends"][0]["discover"] = "dns"
    gateway = start_gateway(config)
    async with (
        aiohttp.ClientSession() as http,
        http.post(gateway.url + "/v2/models/sim/infer", json=INFER) as reply,
    ):
        assert reply.status == 200
    # The sim's URL names 127.0.0.1, which resolves to itself: one backend, found by resolution.
    assert gateway.metric("gateway_backend_ready", backend=sim.url) == 1
    assert gateway.metric("gateway_backend_slots", backend=sim.url) == 2
