"""Sequences (Triton's sequence batcher): every request of a sequence reaches the backend its first
one got, over HTTP and gRPC, while requests of no sequence go wherever a slot is free. Two real
simulators, told apart by what each counts as completed; the memory store and the Redis one."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import yaml
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.eventually import eventually
from tests.integration.servers import gateway_config
from tests.integration.test_backpressure import clear_the_fault, hang_the_backend, wait_for_hanging
from tests.integration.test_loadtest import loadtest, read_report

pytestmark = pytest.mark.anyio
STORES = ["memory", pytest.param("redis", marks=pytest.mark.redis)]


def sequence_config(a, b, store=None, **overrides):
    classes = [{"name": "high", "max_wait_ms": 5000}, {"name": "low", "max_wait_ms": 5000}]
    if store is not None:
        overrides["store"] = store
    return gateway_config([(a.url, 1), (b.url, 1)], priorities=classes, expected_service_ms=20, **overrides)


def infer(sequence_id=None, *, start=False, end=False, value=1.0):
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [value]}]}
    if sequence_id is not None:
        body["parameters"] = {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}
    return body


async def post(http, gateway, body, request_id=None):
    headers = {} if request_id is None else {"X-Request-Id": request_id}
    async with http.post(gateway.url + "/v2/models/sim/infer", json=body, headers=headers) as reply:
        return reply.status, await reply.json(content_type=None)


def completed(sim) -> int:
    return sim.stats()["completed"]


def two_backends(start_sim):
    """Two simulated backends of one slot each: A, listed first, and B."""
    return start_sim(slots=1, base_ms=20), start_sim(slots=1, base_ms=20)


async def hold_the_first(http, gateway, a) -> asyncio.Future:
    """A request of no sequence holding A's slot until A's fault is cleared: its answer, to come."""
    await hang_the_backend(a)
    held = asyncio.ensure_future(post(http, gateway, infer()))
    await wait_for_hanging(a, 1)
    return held


@pytest.mark.parametrize("store", STORES)
async def test_a_sequence_waits_for_its_backend_while_others_take_the_free_one(
    start_sim, start_gateway, store_section
):
    a, b = two_backends(start_sim)
    gateway = start_gateway(sequence_config(a, b, store_section))
    async with aiohttp.ClientSession() as http:
        assert (await post(http, gateway, infer(7, start=True)))[0] == 200
        assert (completed(a), completed(b)) == (1, 0)  # both free: the first listed

        held = await hold_the_first(http, gateway, a)
        pinned = asyncio.ensure_future(post(http, gateway, infer(7), request_id="seq-7-b"))
        await eventually(lambda: gateway.assert_metric("gateway_queue_depth", 1, priority="low"))
        async with http.get(gateway.admin_url + "/status/requests/seq-7-b") as reply:
            found = await reply.json()
        assert (found["sequence"], found["waits_for"]) == ("7", "its_sequence_backend"), found
        # B is free, and a request of no sequence takes it past the one that waits for A.
        status, answer = await post(http, gateway, infer())
        assert status == 200, answer
        assert completed(b) == 1 and not pinned.done()
        gateway.assert_metric("gateway_queue_depth", 1, priority="low")

        await clear_the_fault(a)
        assert [(await t)[0] for t in (held, pinned)] == [200, 200]
    assert (completed(a), completed(b)) == (3, 1)


@pytest.mark.parametrize("store", STORES)
async def test_a_sequence_pinned_to_the_second_backend_stays_there_until_a_new_start(
    start_sim, start_gateway, store_section
):
    a, b = two_backends(start_sim)
    gateway = start_gateway(sequence_config(a, b, store_section))
    async with aiohttp.ClientSession() as http:
        held = await hold_the_first(http, gateway, a)
        assert (await post(http, gateway, infer("call-42", start=True)))[0] == 200  # A is busy: B
        await clear_the_fault(a)
        assert (await held)[0] == 200
        assert (completed(a), completed(b)) == (1, 1)

        for last in (False, False, True):  # both free now: the first listed would be A
            assert (await post(http, gateway, infer("call-42", end=last)))[0] == 200
        assert (completed(a), completed(b)) == (1, 4)
        # Ended: its id starts a sequence anew wherever dispatch sends it.
        assert (await post(http, gateway, infer("call-42", start=True)))[0] == 200
        assert (completed(a), completed(b)) == (2, 4)


@pytest.mark.parametrize("store", STORES)
async def test_grpc_sequences_are_pinned_as_http_ones(start_sim, start_gateway, store_section):
    a, b = two_backends(start_sim)
    gateway = start_gateway(
        sequence_config(a, b, store_section, grpc_listen={"host": "127.0.0.1", "port": 0})
    )
    async with aiohttp.ClientSession() as http:
        held = await hold_the_first(http, gateway, a)
        client = triton_grpc.InferenceServerClient(gateway.grpc_target)
        data = np.array([[2.0]], dtype=np.float32)
        inputs = [triton_grpc.InferInput("INPUT0", [1, 1], "FP32")]
        inputs[0].set_data_from_numpy(data)
        await asyncio.to_thread(client.infer, "sim", inputs, sequence_id=9, sequence_start=True)
        await clear_the_fault(a)
        assert (await held)[0] == 200
        for end in (False, True):
            answer = await asyncio.to_thread(client.infer, "sim", inputs, sequence_id=9, sequence_end=end)
            assert answer.as_numpy("OUTPUT0").tolist() == [[2.0]]
        client.close()
    assert (completed(a), completed(b)) == (1, 3)


async def test_a_malformed_sequence_is_a_bad_request(start_sim, start_gateway):
    a, b = two_backends(start_sim)
    gateway = start_gateway(sequence_config(a, b))
    async with aiohttp.ClientSession() as http:
        body = infer(7)
        body["parameters"]["sequence_start"] = "yes"
        status, answer = await post(http, gateway, body)
        assert status == 400 and answer["reason"] == "bad_request" and "sequence_start" in answer["error"]
        body = infer(-3)
        status, answer = await post(http, gateway, body)
        assert status == 400 and "sequence_id" in answer["error"]
    assert completed(a) + completed(b) == 0


@pytest.mark.flood
@pytest.mark.parametrize("store", STORES)
async def test_under_open_loop_overload_each_sequence_stays_on_one_backend_and_the_pool_serves(
    start_sim, start_gateway, store_section, tmp_path
):
    """1.5x the pool's 100 requests/s for 3 s, a third of it in ten sequences: each sequence's
    requests all reach one backend, no backend goes above its slots, the pool keeps serving."""
    a, b = start_sim(slots=4, base_ms=80), start_sim(slots=4, base_ms=80)
    classes = [{"name": "high", "max_wait_ms": 250}, {"name": "low", "max_wait_ms": 1000}]
    store = {} if store_section is None else {"store": store_section}
    gateway = start_gateway(
        gateway_config([(a.url, 4), (b.url, 4)], priorities=classes, expected_service_ms=80, **store)
    )
    tensor = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}
    traffic = [
        {"name": f"sequence-{i}", "share": 1, "body": {**tensor, "parameters": {"sequence_id": 100 + i}}}
        for i in range(10)
    ]
    traffic.append({"name": "plain", "share": 20})
    scenario = tmp_path / "sequences.yaml"
    scenario.write_text(yaml.safe_dump({"traffic": traffic}))
    ran = await asyncio.to_thread(
        loadtest, "--target", gateway.url, "--model", "sim", "--scenario", str(scenario), "--rate", "150",
        "--duration", "3", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    on_a, on_b = a.stats(), b.stats()
    assert set(on_a["sequences"]).isdisjoint(on_b["sequences"]), (on_a["sequences"], on_b["sequences"])
    assert len(on_a["sequences"]) + len(on_b["sequences"]) == 10
    assert on_a["peak_inflight"] <= 4 and on_b["peak_inflight"] <= 4
    overall = read_report(tmp_path / "run")["runs"][0]["overall"]
    # The pool's 100/s, less what sequences wait for: alone 91/s in memory, 86/s on Redis. At 200/s
    # (8 slots x 40 ms) a Redis run alone served 166-171/s on an earlier machine, 130/s on one half
    # as fast: the gateway's CPU, not the pool, set the pace. A pinned head holding back its class
    # (the first try) took it far lower.
    assert overall["goodput_rps"] > 70, overall
    assert on_a["completed"] > 75 and on_b["completed"] > 75  # both backends serve


async def test_one_fixed_backend_pins_nothing_and_its_bodies_pass_unread(start_sim, start_gateway):
    """With one backend there is nothing to pin: the gateway reads no sequence (so it scans no body
    for one) and the backend judges the parameters, as it would alone."""
    sim = start_sim(slots=1, base_ms=20)
    gateway = start_gateway(gateway_config([(sim.url, 1)]))
    async with aiohttp.ClientSession() as http:
        body = infer(7)
        body["parameters"]["sequence_start"] = "yes"  # the two-backend gateway answers 400
        status, _ = await post(http, gateway, body)
    assert status == 200 and sim.stats()["sequences"] == {"7": 1}


@pytest.mark.parametrize("store", [pytest.param("redis", marks=pytest.mark.redis)])
async def test_replicas_sharing_a_redis_send_a_sequence_to_one_backend(
    start_sim, start_gateway, store_section
):
    """The pins live in Redis: a sequence pinned through one replica is followed by the other,
    though the backend listed first is free."""
    a, b = two_backends(start_sim)
    config = sequence_config(a, b, {**store_section, "replicas": 2})
    first, second = start_gateway(config), start_gateway(config)
    async with aiohttp.ClientSession() as http:
        held = await hold_the_first(http, first, a)
        assert (await post(http, first, infer(11, start=True)))[0] == 200  # A is busy: B
        await clear_the_fault(a)
        assert (await held)[0] == 200
        for gateway in (second, first, second):
            status, answer = await post(http, gateway, infer(11))
            assert status == 200, answer
    assert a.stats()["sequences"] == {} and b.stats()["sequences"] == {"11": 4}


async def test_a_decoupled_models_sequence_is_pinned_as_a_unary_ones(start_sim, start_gateway):
    """A decoupled model's requests go up on calls of their own, to the backend of the slot they get:
    a sequence's to its pinned one. Its two backends are gateways in front of one simulator each
    (any KServe v2 gRPC server can be one); the store is the memory one (pins on Redis are held to
    it elsewhere, and the decoupled path takes what the store grants)."""
    a, b = two_backends(start_sim)
    fronts = [
        start_gateway(gateway_config([(sim.url, 1)], grpc_listen={"host": "127.0.0.1", "port": 0}))
        for sim in (a, b)
    ]
    for front in fronts:
        await eventually(
            lambda front=front: "grpc listening on" in front.log(), what="a backend's gRPC listener"
        )
    config = sequence_config(*fronts, grpc_listen={"host": "127.0.0.1", "port": 0})
    config["models"][0]["decoupled"] = True
    for backend, front in zip(config["models"][0]["backends"], fronts, strict=True):
        backend["grpc_port"] = int(front.grpc_target.rsplit(":", 1)[1])
    gateway = start_gateway(config)
    await eventually(lambda: "grpc listening on" in gateway.log(), what="the gateway's gRPC listener")

    def request(request_id: str, sequence_id: int | None = None, **flags: bool):
        message = service_pb2.ModelInferRequest(model_name="sim", id=request_id)
        message.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 1]).contents.fp32_contents.append(1)
        if sequence_id is not None:
            message.parameters["sequence_id"].int64_param = sequence_id
        for flag, value in flags.items():
            message.parameters[flag].bool_param = value
        return message

    async with grpc.aio.insecure_channel(gateway.grpc_target) as channel:
        stream = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
        await hang_the_backend(a)
        await stream.write(request("held"))  # both free: the first listed, A, which holds it
        await wait_for_hanging(a, 1)
        await stream.write(request("start", 5, sequence_start=True))  # A is busy: pinned to B
        assert (await stream.read()).infer_response.id == "start"
        await clear_the_fault(a)
        assert (await stream.read()).infer_response.id == "held"
        for i, end in enumerate((False, False, True)):  # both free now: the first listed would be A
            await stream.write(request(f"next-{i}", 5, sequence_end=end))
            response = await stream.read()
            assert (response.error_message, response.infer_response.id) == ("", f"next-{i}")
        await stream.done_writing()
        assert await stream.read() is grpc.aio.EOF
    assert (completed(a), completed(b)) == (1, 4)
    assert b.stats()["sequences"] == {"5": 4}
