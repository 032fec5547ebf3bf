"""Against a real tritonserver (nvidia-pytriton's, on the CPU): discovery, pass-through, and its own
queue making the gateway admit less."""

from __future__ import annotations

import asyncio
import http.client
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import pytest
import tritonclient.http as triton

from tests.eventually import eventually
from tests.integration.servers import gateway_config
from tests.integration.triton import TritonServer

pytestmark = [pytest.mark.anyio, pytest.mark.triton]
BATCH = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}


@pytest.fixture(scope="module")
def tritonserver(tmp_path_factory):
    server = TritonServer(tmp_path_factory.mktemp("triton"), sleep_ms=100, max_batch_size=4)
    yield server
    server.stop()


def triton_config(server: TritonServer, served_model: str = "sleep_ms"):
    config = gateway_config(
        [(server.url, 1)],
        expected_service_ms=100,
        signals={"scrape_interval_ms": 100, "scrape_timeout_ms": 500, "discovery_interval_ms": 1000},
        priorities=[{"name": "high", "max_wait_ms": 5000}, {"name": "low", "max_wait_ms": 5000}],
    )
    backend = config["models"][0]["backends"][0]
    del backend["max_concurrency"]  # discovered from the model config
    backend.update(kind="triton", served_model=served_model, metrics_url=server.metrics_url)
    return config


def test_slots_are_discovered_from_the_model_config(tritonserver, start_gateway):
    gateway = start_gateway(triton_config(tritonserver))
    # One instance, dynamic batching up to 4: four requests execute at once.
    assert gateway.metric("gateway_backend_slots") == 4
    assert gateway.metric("gateway_backend_ready") == 1


def test_tritonclient_through_the_gateway_reaches_the_real_server(tritonserver, start_gateway):
    gateway = start_gateway(triton_config(tritonserver))
    client = triton.InferenceServerClient(gateway.url.removeprefix("http://"))
    # Clients say "sim", the gateway's name; Triton serves it as "sleep_ms" (served_model).
    assert client.is_model_ready("sim")
    data = np.array([[0.5, 1.5, 2.5]], dtype=np.float32)
    inputs = [triton.InferInput("INPUT0", list(data.shape), "FP32")]
    inputs[0].set_data_from_numpy(data, binary_data=True)
    outputs = [triton.InferRequestedOutput("OUTPUT0", binary_data=True)]
    result = client.infer("sim", inputs, outputs=outputs)
    assert np.array_equal(result.as_numpy("OUTPUT0"), data)
    assert client.get_model_config("sim")["max_batch_size"] == 4
    client.close()


def test_an_unready_model_answers_503_with_retry_after(tritonserver, start_gateway):
    gateway = start_gateway(triton_config(tritonserver, served_model="not_loaded"), wait_ready=False)
    status, headers = _post(gateway.url + "/v2/models/sim/infer")
    assert status == 503 and int(headers["Retry-After"]) >= 1


async def test_requests_straight_to_triton_make_the_gateway_admit_less(tritonserver, start_gateway):
    gateway = start_gateway(triton_config(tritonserver))
    await eventually(
        lambda: gateway.assert_metric("gateway_signal_up", 1, source=tritonserver.metrics_url), timeout_s=15
    )
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        budget = {"X-Request-Timeout-Ms": "1000"}
        url = gateway.url + "/v2/models/sim/infer"
        async with http.post(url, json=BATCH, headers=budget) as reply:
            first = reply.status  # an idle server: admitted
        direct = tritonserver.url + "/v2/models/sleep_ms/infer"
        bypass = [asyncio.ensure_future(http.post(direct, json=BATCH)) for _ in range(80)]
        await eventually(
            lambda: gateway.metric("gateway_backend_queue") >= 40, timeout_s=15, what="Triton's own queue"
        )
        async with http.post(url, json=BATCH, headers=budget) as reply:
            second, reason = reply.status, (await reply.json())["reason"]
        for done in await asyncio.gather(*bypass):
            done.release()
    assert first != 429
    # Tens of requests ahead inside Triton at 40 per second: a 1 s budget cannot be met.
    assert (second, reason) == (429, "deadline_unmeetable")


def _post(url: str):
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    connection.request(
        "POST", parts.path, body=b'{"inputs": []}', headers={"Content-Type": "application/json"}
    )
    reply = connection.getresponse()
    reply.read()
    connection.close()
    return reply.status, reply.headers  # case-insensitive
