"""The gRPC ingress in front of a real tritonserver (nvidia-pytriton's, on the CPU): tritonclient.grpc
through the gateway gets what Triton's own gRPC port answers."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from tests.eventually import eventually_blocking
from tests.integration.servers import gateway_config
from tests.integration.triton import COUNT_UP_RESPONSES, TritonServer
from tests.redis_server import free_port

pytestmark = [pytest.mark.triton]


@pytest.fixture(scope="module")
def tritonserver(tmp_path_factory):
    server = TritonServer(tmp_path_factory.mktemp("triton"), sleep_ms=5, max_batch_size=4)
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


def count_up_stream(client: triton_grpc.InferenceServerClient, calls: list[dict]) -> dict[str, list]:
    """Each call's answers on one stream, sent one after the other's end, by request id in the
    order they came (as JSON)."""
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    got: dict[str, list] = {}
    try:
        for call in calls:
            client.async_stream_infer("count_up", **call)
            for _ in range(COUNT_UP_RESPONSES + bool(call.get("enable_empty_final_response"))):
                result, error = answers.get(timeout=20)
                assert error is None, error
                response = result.get_response(as_json=True)
                got.setdefault(response["id"], []).append(response)
        return got
    finally:
        client.stop_stream()


def count_up_input(values: list[float]) -> list[triton_grpc.InferInput]:
    item = triton_grpc.InferInput("INPUT0", [len(values)], "FP32")
    item.set_data_from_numpy(np.array(values, dtype=np.float32))
    return [item]


def count_up_config(server: TritonServer, slots: int) -> dict:
    config = grpc_triton_config(server)
    backend = {**config["models"][0]["backends"][0], "grpc_port": server.grpc_port, "max_concurrency": slots}
    config["models"].append(
        {**config["models"][0], "name": "count_up", "decoupled": True, "backends": [backend]}
    )
    return config


def test_a_decoupled_models_responses_stream_through_as_tritons_own(tritonserver, start_gateway):
    """count_up answers each request three times, then ends it with the final flag alone. Through the
    gateway a stream gets what Triton's own gRPC port sends (the empty final response only when
    asked for), and a unary call Triton's own refusal."""
    gateway = start_gateway(count_up_config(tritonserver, slots=2))
    direct = triton_grpc.InferenceServerClient(f"127.0.0.1:{tritonserver.grpc_port}")
    through = triton_grpc.InferenceServerClient(gateway.grpc_target)
    try:
        calls = [
            {"inputs": count_up_input([1.0, 2.0]), "request_id": "plain"},
            {"inputs": count_up_input([5.0]), "request_id": "ended", "enable_empty_final_response": True},
        ]
        theirs, ours = count_up_stream(direct, calls), count_up_stream(through, calls)
        assert ours == theirs
        assert (len(ours["plain"]), len(ours["ended"])) == (COUNT_UP_RESPONSES, COUNT_UP_RESPONSES + 1)
        with pytest.raises(InferenceServerException) as unary_ours:
            through.infer("count_up", count_up_input([1.0]))
        with pytest.raises(InferenceServerException) as unary_theirs:
            direct.infer("count_up", count_up_input([1.0]))
        ours_refused, theirs_refused = unary_ours.value, unary_theirs.value
        assert (ours_refused.status(), ours_refused.message()) == (
            theirs_refused.status(),
            theirs_refused.message(),
        )
    finally:
        direct.close()
        through.close()


def test_a_decoupled_request_holds_its_slot_until_its_last_response(tritonserver, start_gateway):
    """One slot, twelve requests on one stream: the server, which could run two at once, never runs
    more than one (its own count, in each response), and every request gets all its answers."""
    gateway = start_gateway(count_up_config(tritonserver, slots=1))
    through = triton_grpc.InferenceServerClient(gateway.grpc_target)
    answers: queue.Queue = queue.Queue()
    try:
        tritonserver.hold()  # the requests queue behind the one on the slot
        through.start_stream(callback=lambda result, error: answers.put((result, error)))
        ids = [f"r{i}" for i in range(12)]
        for request_id in ids:
            through.async_stream_infer("count_up", count_up_input([0.0]), request_id=request_id)
        eventually_blocking(
            lambda: gateway.metric("gateway_queue_depth", model="count_up", priority="low") == len(ids) - 1,
            what="all but one queued",
        )
        tritonserver.let_go()
        running: dict[str, list[int]] = {}
        for _ in range(len(ids) * COUNT_UP_RESPONSES):
            result, error = answers.get(timeout=20)
            assert error is None, error
            running.setdefault(result.get_response().id, []).append(int(result.as_numpy("RUNNING")[0]))
        assert sorted(running) == sorted(ids) and all(len(r) == COUNT_UP_RESPONSES for r in running.values())
        assert max(max(r) for r in running.values()) == 1, running
        eventually_blocking(
            lambda: gateway.metric("gateway_inflight_requests", model="count_up") == 0, what="the slots back"
        )
    finally:
        tritonserver.let_go()
        through.stop_stream()
        through.close()


def test_a_decoupled_request_whose_client_leaves_or_whose_budget_ends_keeps_its_slot_till_the_backend_ends(
    tritonserver, start_gateway
):
    """Triton's backends drain (on_abandon): a stream cancelled mid-request, and a request whose
    budget ran out (told DEADLINE_EXCEEDED in-band), hold their slots until the server is done."""
    gateway = start_gateway(count_up_config(tritonserver, slots=2))
    client = triton_grpc.InferenceServerClient(gateway.grpc_target)
    answers: queue.Queue = queue.Queue()
    try:
        tritonserver.hold()
        client.start_stream(
            callback=lambda result, error: answers.put((result, error)),
            headers={"x-request-timeout-ms": "400"},
        )
        client.async_stream_infer("count_up", count_up_input([0.0]), request_id="late")
        _, error = answers.get(timeout=10)
        assert error is not None and error.message() == "the backend did not answer in time", error
        client.stop_stream()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("count_up", count_up_input([0.0]), request_id="left")
        eventually_blocking(
            lambda: gateway.metric("gateway_inflight_requests", model="count_up") == 2, what="both on a slot"
        )
        client.stop_stream(cancel_requests=True)
        eventually_blocking(
            lambda: (
                gateway.metric(
                    "gateway_requests_total", model="count_up", priority="low", outcome="client_disconnected"
                )
                == 1
            ),
            what="the client's leaving counted",
        )
        assert (
            gateway.metric("gateway_inflight_requests", model="count_up") == 2
        )  # the server still runs both
        tritonserver.let_go()
        eventually_blocking(
            lambda: gateway.metric("gateway_inflight_requests", model="count_up") == 0, what="the slots back"
        )
    finally:
        tritonserver.let_go()
        client.close()


def test_a_decoupled_models_backend_whose_grpc_port_is_closed_is_not_ready_and_the_stream_goes_on(
    tritonserver, start_gateway
):
    """Its HTTP port answers, its gRPC port, where its requests would go, does not: the probes ask
    both, so it is never ready, the gateway says why, and a request is told so in-band."""
    config = count_up_config(tritonserver, slots=2)
    grpc_port = free_port()  # nothing listens there
    config["models"][-1]["backends"][0]["grpc_port"] = grpc_port
    gateway = start_gateway(config, wait_ready=False)
    eventually_blocking(
        lambda: (
            f"its gRPC port 127.0.0.1:{grpc_port} failed: UNAVAILABLE" in gateway.log()
            and "grpc listening on" in gateway.log()
        ),
        what="the gateway to say why the backend is not ready",
    )
    assert gateway.metric("gateway_backend_ready", model="count_up") == 0
    assert gateway.metric("gateway_backend_ready", model="sleep_ms") == 1
    client = triton_grpc.InferenceServerClient(gateway.grpc_target)
    answers: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("count_up", count_up_input([0.0]), request_id="first")
        _, error = answers.get(timeout=10)
        assert error is not None and error.message() == "no backend of this model is ready", error
        batch = triton_grpc.InferInput("INPUT0", [1, 1], "FP32")
        batch.set_data_from_numpy(np.array([[1.0]], dtype=np.float32))
        client.async_stream_infer("sleep_ms", [batch], request_id="second")  # the stream goes on
        result, error = answers.get(timeout=10)
        assert error is None and result.get_response().id == "second", error.message()
    finally:
        client.stop_stream()
        client.close()


def test_a_decoupled_model_not_configured_so_is_named_in_the_log(tritonserver, start_gateway):
    config = grpc_triton_config(tritonserver)
    config["models"].append({**config["models"][0], "name": "count_up"})
    gateway = start_gateway(config)
    eventually_blocking(
        lambda: "model count_up is decoupled on" in gateway.log() and "decoupled: true" in gateway.log(),
        what="the gateway to say what to configure",
    )
    assert gateway.log().count("is decoupled on") == 1  # said once, though discovery reads it again


def test_a_decoupled_models_own_error_comes_in_band_as_tritons_and_the_stream_goes_on(
    tritonserver, start_gateway
):
    gateway = start_gateway(count_up_config(tritonserver, slots=2))
    direct = triton_grpc.InferenceServerClient(f"127.0.0.1:{tritonserver.grpc_port}")
    through = triton_grpc.InferenceServerClient(gateway.grpc_target)
    wrong = triton_grpc.InferInput("INPUT0", [2], "INT32")  # count_up takes FP32
    wrong.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
    try:
        errors = []
        for client in (direct, through):
            answers: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error, answers=answers: answers.put((result, error)))
            client.async_stream_infer("count_up", [wrong], request_id="wrong")
            _, error = answers.get(timeout=20)
            errors.append(error.message())
            client.async_stream_infer("count_up", count_up_input([1.0]), request_id="right")
            for _ in range(COUNT_UP_RESPONSES):  # the stream goes on
                result, error = answers.get(timeout=20)
                assert error is None and result.get_response().id == "right", error
            client.stop_stream()
        assert errors[1] == errors[0] and "INT32" in errors[0], errors
        outcome = "backend_server_error"
        assert (
            gateway.metric("gateway_requests_total", model="count_up", priority="low", outcome=outcome) == 1
        )
    finally:
        direct.close()
        through.close()
