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
import tritonclient.http.aio as triton_aio
from prometheus_client.parser import text_string_to_metric_families

from tests.eventually import eventually
from tests.integration.servers import gateway_config, http_get
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


# -- gateway-side batching in front of a Triton model without its own dynamic batcher ---------------


@pytest.fixture(scope="module")
def unbatched_triton(tmp_path_factory):
    server = TritonServer(
        tmp_path_factory.mktemp("triton-unbatched"), sleep_ms=150, max_batch_size=8, dynamic_batching=False
    )
    yield server
    server.stop()


def triton_counter(server: TritonServer, name: str) -> float:
    """One of Triton's own counters for the model (see ../shared/reference/metric-formats.md)."""
    for family in text_string_to_metric_families(http_get(server.metrics_url)[1].decode()):
        for sample in family.samples:  # the parser names a counter's samples <name>_total
            if family.name == name and sample.labels.get("model") == "sleep_ms":
                return sample.value
    raise AssertionError(f"Triton exports no {name} for sleep_ms")


def infer_request(array: np.ndarray, request_id: str) -> dict:
    item = triton_aio.InferInput("INPUT0", list(array.shape), "FP32")
    item.set_data_from_numpy(array, binary_data=True)
    wanted = [triton_aio.InferRequestedOutput("OUTPUT0", binary_data=True)]
    return {"inputs": [item], "outputs": wanted, "request_id": request_id}


async def test_the_gateway_batches_for_a_triton_model_without_a_dynamic_batcher(
    unbatched_triton, start_gateway
):
    config = triton_config(unbatched_triton)
    config["models"][0]["batching"] = {"max_delay_ms": 0}  # max_batch_size: the model's own, 8
    gateway = start_gateway(config)
    assert gateway.metric("gateway_backend_slots") == 1  # one instance, one batch at a time
    arrays = [
        np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 100 * i for i, n in enumerate([1, 2, 3, 1, 1])
    ]
    direct = triton_aio.InferenceServerClient(unbatched_triton.url.removeprefix("http://"))
    client = triton_aio.InferenceServerClient(gateway.url.removeprefix("http://"))
    try:
        alone = [await direct.infer("sleep_ms", **infer_request(a, f"r{i}")) for i, a in enumerate(arrays)]
        requests_before = triton_counter(unbatched_triton, "nv_inference_request_success")
        items_before = triton_counter(unbatched_triton, "nv_inference_count")
        # The blocker is held inside Triton until the five have queued behind it, however slow
        # the machine: its 150 ms alone could be over before they arrive.
        unbatched_triton.hold()
        blocker = asyncio.ensure_future(client.infer("sim", **infer_request(arrays[0], "blocker")))
        await eventually(lambda: gateway.metric("gateway_inflight_requests", model="sim") == 1)
        sends = [
            asyncio.ensure_future(client.infer("sim", **infer_request(a, f"r{i}")))
            for i, a in enumerate(arrays)
        ]
        await eventually(lambda: gateway.metric("gateway_queue_depth", model="sim", priority="low") == 5)
        unbatched_triton.let_go()
        batched = await asyncio.gather(*sends)
        await blocker
    finally:
        unbatched_triton.let_go()
        await client.close()
        await direct.close()
    for got, want in zip(batched, alone, strict=True):
        assert got.get_response()["id"] == want.get_response()["id"]
        assert got.get_response()["outputs"] == want.get_response()["outputs"]
        assert got.as_numpy("OUTPUT0").tobytes() == want.as_numpy("OUTPUT0").tobytes()
    # Triton's own count: the blocker and one request of all five, eight items.
    assert triton_counter(unbatched_triton, "nv_inference_request_success") - requests_before == 2
    assert triton_counter(unbatched_triton, "nv_inference_count") - items_before == 1 + 8


def test_a_triton_model_with_its_own_dynamic_batcher_is_left_to_it(tritonserver, start_gateway):
    config = triton_config(tritonserver)
    config["models"][0]["batching"] = {}
    gateway = start_gateway(config)
    data = np.array([[0.5, 1.5]], dtype=np.float32)
    client = triton.InferenceServerClient(gateway.url.removeprefix("http://"))
    inputs = [triton.InferInput("INPUT0", list(data.shape), "FP32")]
    inputs[0].set_data_from_numpy(data, binary_data=True)
    assert np.array_equal(client.infer("sim", inputs).as_numpy("OUTPUT0"), data)
    client.close()
    assert 'gateway_batch_size_count{model="sim"}' not in gateway.metrics()
    assert gateway.metric("gateway_requests_total", model="sim", priority="low", outcome="ok") == 1
