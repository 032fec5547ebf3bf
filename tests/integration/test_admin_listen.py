"""`admin_listen`: /metrics, /healthz and /readyz on a port of their own, and not on the client's."""

import aiohttp
import pytest

from tests.integration.servers import gateway_config

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
OPS = ["/metrics", "/healthz", "/readyz"]


@pytest.fixture
def gateway(start_sim, start_gateway):
    sim = start_sim(slots=2, base_ms=5)
    return start_gateway(gateway_config([(sim.url, 2)], admin_listen={"host": "127.0.0.1", "port": 0}))


async def test_operator_routes_answer_on_the_admin_port_only(gateway):
    assert gateway.admin_url != gateway.url
    async with aiohttp.ClientSession() as http:
        for path in OPS:
            async with http.get(gateway.admin_url + path) as reply:
                assert reply.status == 200, path
            async with http.get(gateway.url + path) as reply:
                assert reply.status == 404, path
        async with http.get(gateway.admin_url + "/metrics") as reply:
            assert "gateway_requests_total" in await reply.text()


async def test_clients_are_served_on_the_client_port_only(gateway):
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway.url + "/v2/models/sim/infer", json=INFER) as reply:
            assert reply.status == 200
        async with http.post(gateway.admin_url + "/v2/models/sim/infer", json=INFER) as reply:
            assert reply.status == 404
        async with http.get(gateway.admin_url + "/v2/models/sim") as reply:
            assert reply.status == 404
    assert gateway.metric_by("gateway_requests_total", "outcome", model="sim") == {"ok": 1.0}
