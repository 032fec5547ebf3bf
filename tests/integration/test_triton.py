"""Against a real tritonserver (nvidia-pytriton's, on the CPU): discovery, pass-through, and its own
queue making the gateway admit less."""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from prometheus_client.parser import text_string_to_metric_families

from tests.adversarial.tcp_proxy import CuttableProxy
from tests.eventually import eventually
from tests.integration.servers import gateway_config, http_get
from tests.integration.test_loadtest import loadtest, read_report
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


def test_loadtest_reads_the_real_server_through_the_gateway_and_alone(tritonserver, start_gateway, tmp_path):
    """The kit against any KServe v2 endpoint: the gateway in front of Triton, and Triton itself over
    HTTP and gRPC, its own metrics scraped as the engine's."""
    gateway = start_gateway(triton_config(tritonserver))
    body = tmp_path / "body.json"
    body.write_text(json.dumps(BATCH))
    runs = {
        "gateway": (gateway.url, "sim", gateway.url + "/metrics", "infer"),
        "triton": (tritonserver.url, "sleep_ms", "none", "infer"),
        "triton-grpc": (f"grpc://127.0.0.1:{tritonserver.grpc_port}", "sleep_ms", "none", "grpc"),
    }
    for name, (target, model, gateway_metrics, kind) in runs.items():
        ran = loadtest(
            "--target", target, "--model", model, "--kind", kind, "--body", str(body), "--rate", "15",
            "--duration", "2", "--engine-metrics", tritonserver.metrics_url, "--gateway-metrics",
            gateway_metrics, "--out", str(tmp_path / name),
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        run = read_report(tmp_path / name)["runs"][0]
        overall = run["overall"]
        assert overall["served"] == overall["sent"] > 15, overall
        assert overall["latency_ms"]["p50"] >= 100  # Triton's model sleeps 100 ms
        engine = [s for s in run["scrapes"] if s["source"] == "engine"]
        assert (
            engine
            and all(s["ok"] for s in engine)
            and "nv_inference_pending_request_count" in engine[-1]["values"]
        )
        if name == "gateway":
            assert overall["upstream_ms"]["p50"] >= 100 and overall["queue_ms"]["p50"] is not None
        else:
            assert overall["upstream_ms"]["p50"] is None  # Triton sends no Server-Timing


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


def triton_counter(server: TritonServer, name: str, model: str = "sleep_ms") -> float:
    """One of Triton's own counters for the model (see ../shared/reference/metric-formats.md)."""
    for family in text_string_to_metric_families(http_get(server.metrics_url)[1].decode()):
        for sample in family.samples:  # the parser names a counter's samples <name>_total
            if family.name == name and sample.labels.get("model") == model:
                return sample.value
    raise AssertionError(f"Triton exports no {name} for {model}")


class TritonCounts:
    """Triton's own counts of a model's successful requests and items from now on. Triton updates
    them a little after it answers, so a count is read when it settles, never right after."""

    def __init__(self, server: TritonServer, model: str) -> None:
        self.server, self.model = server, model
        self.requests = triton_counter(server, "nv_inference_request_success", model)
        self.items = triton_counter(server, "nv_inference_count", model)

    async def grew_by(self, *, requests: int, items: int) -> None:
        def check() -> None:
            grown = (
                triton_counter(self.server, "nv_inference_request_success", self.model) - self.requests,
                triton_counter(self.server, "nv_inference_count", self.model) - self.items,
            )
            assert grown == (requests, items), f"requests and items grew by {grown}"

        await eventually(check, timeout_s=10, what=f"Triton counts {requests} requests of {items} items")


def infer_request(array: np.ndarray, request_id: str) -> dict:
    item = triton_aio.InferInput("INPUT0", list(array.shape), "FP32")
    item.set_data_from_numpy(array, binary_data=True)
    wanted = [triton_aio.InferRequestedOutput("OUTPUT0", binary_data=True)]
    return {"inputs": [item], "outputs": wanted, "request_id": request_id}


def typed_request(rows: int, seed: int, request_id: str, *, binary: bool) -> dict:
    """A request to `typed_echo`: `rows` rows of FP16, INT64, BOOL and BYTES (of varied lengths)."""
    rng = np.random.default_rng(seed)
    arrays = {
        "FP16": rng.standard_normal((rows, 3)).astype(np.float16),
        "INT64": rng.integers(-(2**40), 2**40, (rows, 2), dtype=np.int64),
        "BOOL": rng.random((rows, 4)) < 0.5,
        "BYTES": np.array(
            [
                [bytes(rng.integers(0, 256, int(rng.integers(0, 9)), dtype=np.uint8)) for _ in range(2)]
                for _ in range(rows)
            ],
            dtype=np.object_,
        ),
    }
    inputs, outputs = [], []
    for name, array in arrays.items():
        item = triton_aio.InferInput(f"IN_{name}", list(array.shape), name)
        # Triton takes FP16 only binary, and JSON cannot carry arbitrary bytes: those two go
        # binary whatever the rest does, so a "json" request mixes both encodings.
        as_binary = binary or name in ("FP16", "BYTES")
        item.set_data_from_numpy(array, binary_data=as_binary)
        inputs.append(item)
        outputs.append(triton_aio.InferRequestedOutput(f"OUT_{name}", binary_data=as_binary))
    return {"inputs": inputs, "outputs": outputs, "request_id": request_id}


async def batched_behind_a_blocker(server: TritonServer, gateway, requests: list[dict]) -> list:
    """Send `requests` through the gateway while a first one is held inside Triton, so that all
    of them queue and leave as one batch; their answers, in order."""
    client = triton_aio.InferenceServerClient(gateway.url.removeprefix("http://"))
    try:
        # The blocker is held inside Triton until the rest have queued behind it, however slow
        # the machine: its service time alone could be over before they arrive.
        server.hold()
        blocker = asyncio.ensure_future(client.infer("sim", **{**requests[0], "request_id": "blocker"}))
        await eventually(lambda: gateway.metric("gateway_inflight_requests", model="sim") == 1)
        sends = [asyncio.ensure_future(client.infer("sim", **request)) for request in requests]
        await eventually(
            lambda: gateway.metric("gateway_queue_depth", model="sim", priority="low") == len(requests)
        )
        server.let_go()
        batched = await asyncio.gather(*sends)
        await blocker
    finally:
        server.let_go()
        await client.close()
    return batched


async def unbatched(server: TritonServer, model: str, requests: list[dict]) -> list:
    direct = triton_aio.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        return [await direct.infer(model, **request) for request in requests]
    finally:
        await direct.close()


def assert_same_answers(batched: list, alone: list, outputs: list[str]) -> None:
    for got, want in zip(batched, alone, strict=True):
        assert got.get_response() == want.get_response()  # id, outputs, shapes, datatypes
        for name in outputs:
            assert got.as_numpy(name).tolist() == want.as_numpy(name).tolist(), name
            assert got.as_numpy(name).dtype == want.as_numpy(name).dtype, name


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
    requests = [infer_request(a, f"r{i}") for i, a in enumerate(arrays)]
    calls = TritonCounts(unbatched_triton, "sleep_ms")
    alone = await unbatched(unbatched_triton, "sleep_ms", requests)
    batched = await batched_behind_a_blocker(unbatched_triton, gateway, requests)
    for got, want in zip(batched, alone, strict=True):
        assert got.get_response()["id"] == want.get_response()["id"]
        assert got.get_response()["outputs"] == want.get_response()["outputs"]
        assert got.as_numpy("OUTPUT0").tobytes() == want.as_numpy("OUTPUT0").tobytes()
    # Triton's own count: five alone, then the blocker (one item) and one call of all five (eight).
    await calls.grew_by(requests=5 + 2, items=8 + 1 + 8)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
async def test_batched_fp16_int64_bool_and_bytes_answer_as_triton_answers_each_alone(
    unbatched_triton, start_gateway, binary
):
    config = triton_config(unbatched_triton, served_model="typed_echo")
    config["models"][0]["batching"] = {"max_delay_ms": 0}
    gateway = start_gateway(config)
    requests = [
        typed_request(rows, seed, f"t{seed}", binary=binary) for seed, rows in enumerate([2, 1, 3, 1, 1])
    ]
    calls = TritonCounts(unbatched_triton, "typed_echo")
    alone = await unbatched(unbatched_triton, "typed_echo", requests)
    batched = await batched_behind_a_blocker(unbatched_triton, gateway, requests)
    assert_same_answers(batched, alone, [f"OUT_{name}" for name in ("FP16", "INT64", "BOOL", "BYTES")])
    # Triton's own count: five alone, then the blocker (two rows) and one call of all five.
    await calls.grew_by(requests=5 + 2, items=8 + 2 + 8)
    assert gateway.metric("gateway_batch_size_count", model="sim") == 2
    assert gateway.metric("gateway_batch_size_sum", model="sim") == 2 + 8


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


def test_a_triton_behind_tls_is_read_and_probed_with_the_backends_ca(tritonserver, start_gateway, tls_cert):
    """Triton's HTTP port has no TLS of its own: behind a proxy that ends TLS, its model config is
    read (the slots) and its readiness probed with the CA the backend's `tls` names."""
    cert, key = tls_cert
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert), str(key))
    proxy = CuttableProxy("127.0.0.1", tritonserver.http_port, tls=context).start()
    try:
        config = triton_config(tritonserver)
        backend = config["models"][0]["backends"][0]
        backend.update(url=f"https://127.0.0.1:{proxy.port}", tls={"ca_file": str(cert)})
        gateway = start_gateway(config)
        assert gateway.metric("gateway_backend_slots") == 4  # its model config, read over TLS
        assert gateway.metric("gateway_backend_ready") == 1
    finally:
        proxy.close()
