"""The gRPC ingress in front of a real tritonserver (nvidia-pytriton's, on the CPU): tritonclient.grpc
through the gateway gets what Triton's own gRPC port answers."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc

from tests.eventually import eventually_blocking
from tests.integration.servers import gateway_config, http_get
from tests.integration.triton import TritonServer

pytestmark = [pytest.mark.triton]


@pytest.fixture(scope="module")
def tritonserver(tmp_path_factory):
    server = TritonServer(tmp_path_factory.mktemp("triton"), sleep_ms=5, max_batch_size=4)
    ready = server.url + "/v2/models/typed_echo/ready"  # Triton's own wait is for sleep_ms
    eventually_blocking(lambda: http_get(ready)[0] == 200, timeout_s=60, what="typed_echo to be ready")
    yield server
    server.stop()


def grpc_triton_config(server: TritonServer) -> dict:
    """Triton's models under their own names, so that every answer can be held to Triton's."""
    config = gateway_config([(server.url, 1)], expected_service_ms=5)
    backend = config["models"][0]["backends"][0]
    del backend["max_concurrency"]  # discovered from the model config
    backend.update(kind="triton", metrics_url=server.metrics_url)
    config["models"] = [
        {**config["models"][0], "name": "sleep_ms"},
        {**config["models"][0], "name": "typed_echo"},
    ]
    config["grpc_listen"] = {"host": "127.0.0.1", "port": 0}
    return config


def typed_inputs(rows: int, seed: int) -> list[triton_grpc.InferInput]:
    rng = np.random.default_rng(seed)
    arrays = {
        "FP16": rng.standard_normal((rows, 3)).astype(np.float16),
        "INT64": rng.integers(-(2**40), 2**40, (rows, 2), dtype=np.int64),
        "BOOL": rng.random((rows, 4)) < 0.5,
        "BYTES": np.array(
            [[bytes(rng.integers(0, 256, int(rng.integers(0, 9)), dtype=np.uint8)) for _ in range(2)]] * rows,
            dtype=np.object_,
        ),
    }
    inputs = []
    for name, array in arrays.items():
        item = triton_grpc.InferInput(f"IN_{name}", list(array.shape), name)
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


def test_tritonclient_grpc_gets_what_tritons_own_grpc_port_answers(tritonserver, start_gateway):
    gateway = start_gateway(grpc_triton_config(tritonserver))
    direct = triton_grpc.InferenceServerClient(f"127.0.0.1:{tritonserver.grpc_port}")
    through = triton_grpc.InferenceServerClient(gateway.grpc_target)
    try:
        for model in ("sleep_ms", "typed_echo"):
            assert through.is_model_ready(model)
            assert through.get_model_metadata(model) == direct.get_model_metadata(model)
            assert through.get_model_config(model) == direct.get_model_config(model)
        data = np.array([[0.5, 1.5, 2.5]], dtype=np.float32)
        plain = triton_grpc.InferInput("INPUT0", list(data.shape), "FP32")
        plain.set_data_from_numpy(data)
        calls = [("sleep_ms", [plain]), ("typed_echo", typed_inputs(2, seed=1))]
        for model, inputs in calls:
            theirs = direct.infer(model, inputs, request_id="r-1").get_response()
            ours = through.infer(model, inputs, request_id="r-1").get_response()
            assert ours == theirs, model
        # Asked for one output only.
        wanted = [triton_grpc.InferRequestedOutput("OUT_BYTES")]
        inputs = typed_inputs(3, seed=2)
        theirs = direct.infer("typed_echo", inputs, outputs=wanted).get_response()
        assert through.infer("typed_echo", inputs, outputs=wanted).get_response() == theirs
    finally:
        direct.close()
        through.close()
