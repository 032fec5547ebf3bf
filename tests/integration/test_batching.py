"""Gateway-side micro-batching through a real gateway and the simulator, with tritonclient's client.

The simulator's model is the identity, and it counts the inference requests it receives: a batch
is one request there, and every member must get back exactly its own rows under its own id.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest
import tritonclient.http.aio as triton

from tests.eventually import eventually
from tests.integration.scripted import OK, Reader, ScriptedServer, Writer
from tests.integration.servers import gateway_config, http_post

pytestmark = pytest.mark.anyio
STORES = ["memory", pytest.param("redis", marks=pytest.mark.redis)]


def batching_config(sim, *, max_batch_size=16, max_delay_ms=0.0, store=None, **overrides):
    config = gateway_config([(sim.url, 1)], expected_service_ms=overrides.pop("expected_service_ms", 100))
    config["models"][0]["batching"] = {"max_batch_size": max_batch_size, "max_delay_ms": max_delay_ms}
    if store is not None:
        config["store"] = store
    config["priorities"] = [{"name": "high", "max_wait_ms": 5000}, {"name": "low", "max_wait_ms": 5000}]
    config.update(overrides)
    return config


def rows(count: int, seed: int, datatype: str = "FP32") -> np.ndarray:
    values = np.arange(count * 3).reshape(count, 3) + 1000 * seed
    return values.astype(np.float32 if datatype == "FP32" else np.int64)


async def infer(client, array, request_id, *, binary=True, datatype="FP32", **options):
    item = triton.InferInput("INPUT0", list(array.shape), datatype)
    item.set_data_from_numpy(array, binary_data=binary)
    wanted = [triton.InferRequestedOutput("OUTPUT0", binary_data=binary)]
    return await client.infer("sim", [item], request_id=request_id, outputs=wanted, **options)


def check_own_rows(result, array, request_id):
    answer = result.get_response()
    assert answer["id"] == request_id
    assert answer["outputs"][0]["shape"] == list(array.shape)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), array)


async def hold_the_slot(client, sim):
    """A request alone on the backend's one slot, held there until `let_go`, so that what comes
    next queues behind it however slow the machine is."""
    assert http_post(sim.url + "/sim/fault", json.dumps({"hang": True}).encode())[0] == 200
    blocker = asyncio.ensure_future(infer(client, rows(1, 99), "blocker"))
    await eventually(lambda: sim.stats()["faults"]["hanging"] == 1, what="the blocker to be on the backend")
    return blocker


async def let_go(sim, fault=None):
    """The held blocker goes on, and the backend has `fault` from now on (none by default)."""
    body = json.dumps(fault or {}).encode()
    assert (await asyncio.to_thread(http_post, sim.url + "/sim/fault", body))[0] == 200


async def queued(gateway, count):
    await eventually(
        lambda: gateway.metric("gateway_queue_depth", model="sim", priority="low") == count,
        what=f"{count} requests to queue",
    )


@pytest.mark.parametrize("store", STORES)
async def test_queued_requests_merge_into_one_call_and_each_gets_its_own_rows(
    start_sim, start_gateway, store_section
):
    sim = start_sim(slots=1, base_ms=150)
    config = batching_config(sim, store=store_section)
    gateway = start_gateway(config)
    client = triton.InferenceServerClient(gateway.url.removeprefix("http://"))
    try:
        blocker = await hold_the_slot(client, sim)
        binary = [(rows(n, i), f"bin-{i}") for i, n in enumerate([1, 3, 2, 4])]
        sends = [asyncio.ensure_future(infer(client, a, rid)) for a, rid in binary]
        await queued(gateway, 4)
        # JSON tensors have another key: they queue behind and merge among themselves.
        inline = [(rows(n, 10 + i, "INT64"), f"json-{i}") for i, n in enumerate([2, 1])]
        sends += [
            asyncio.ensure_future(infer(client, a, rid, binary=False, datatype="INT64")) for a, rid in inline
        ]
        await queued(gateway, 6)
        await let_go(sim)
        results = await asyncio.gather(*sends)
        check_own_rows(await blocker, rows(1, 99), "blocker")
    finally:
        await client.close()
    for result, (array, request_id) in zip(results, binary + inline, strict=True):
        check_own_rows(result, array, request_id)
    stats = sim.stats()
    assert stats["completed"] == 3  # the blocker, one batch of 10 items, one of 3
    assert stats["peak_inflight"] == 1
    assert gateway.metric("gateway_batch_size_count", model="sim") == 3
    assert gateway.metric("gateway_batch_size_sum", model="sim") == 1 + 10 + 3
    assert gateway.metric("gateway_requests_total", model="sim", priority="low", outcome="ok") == 7


async def test_requests_merge_only_with_requests_sent_alike(start_sim, start_gateway):
    """A merged call goes up with its first member's headers and query: a request another client
    sent with other credentials or another query must not ride on it. Trace ids may differ."""
    sim = start_sim(slots=1, base_ms=100)
    gateway = start_gateway(batching_config(sim))
    client = triton.InferenceServerClient(gateway.url.removeprefix("http://"))
    alice = {"Authorization": "Bearer alice"}
    try:
        blocker = await hold_the_slot(client, sim)
        requests = [
            ("a1", {**alice, "traceparent": "00-a1"}, None),
            ("a2", {**alice, "traceparent": "00-a2"}, None),
            ("b", {"Authorization": "Bearer bob"}, None),
            ("q", alice, {"trace": "1"}),
        ]
        sends = []
        for seed, (request_id, headers, query) in enumerate(requests, start=1):
            sends.append(
                asyncio.ensure_future(
                    infer(client, rows(1, seed), request_id, headers=headers, query_params=query)
                )
            )
            await queued(gateway, seed)  # in this order
        await let_go(sim)
        results = await asyncio.gather(*sends)
        await blocker
    finally:
        await client.close()
    for result, seed, request_id in zip(results, [1, 2, 3, 4], ["a1", "a2", "b", "q"], strict=True):
        check_own_rows(result, rows(1, seed), request_id)
    assert sim.stats()["completed"] == 1 + 3  # the blocker; a1 with a2; b alone; q alone
    assert gateway.metric("gateway_batch_size_sum", model="sim") == 1 + 2 + 1 + 1


async def test_a_batch_takes_at_most_max_batch_size_items(start_sim, start_gateway):
    sim = start_sim(slots=1, base_ms=100)
    gateway = start_gateway(batching_config(sim, max_batch_size=4))
    client = triton.InferenceServerClient(gateway.url.removeprefix("http://"))
    try:
        blocker = await hold_the_slot(client, sim)
        arrays = [rows(n, i) for i, n in enumerate([3, 1, 2, 2, 4])]
        sends = [asyncio.ensure_future(infer(client, a, f"r{i}")) for i, a in enumerate(arrays)]
        await queued(gateway, 5)
        await let_go(sim)
        results = await asyncio.gather(*sends)
        await blocker
    finally:
        await client.close()
    for i, (result, array) in enumerate(zip(results, arrays, strict=True)):
        check_own_rows(result, array, f"r{i}")
    # 3+1, then 2+2, then 4: never more than 4 items in one call.
    assert sim.stats()["completed"] == 4
    assert gateway.metric("gateway_batch_size_bucket", model="sim", le="4.0") == 4


@pytest.mark.parametrize("store", STORES)
async def test_the_most_urgent_band_is_batched_first(start_sim, start_gateway, store_section):
    sim = start_sim(slots=1, base_ms=100)
    config = batching_config(sim, store=store_section)
    gateway = start_gateway(config)
    client = triton.InferenceServerClient(gateway.url.removeprefix("http://"))
    finished: list[str] = []

    async def send(request_id: str, priority: str):
        result = await infer(client, rows(1, len(finished)), request_id, headers={"X-Priority": priority})
        finished.append(priority)
        return result

    try:
        blocker = await hold_the_slot(client, sim)
        sends = [asyncio.ensure_future(send(f"low-{i}", "low")) for i in range(3)]
        await queued(gateway, 3)
        sends += [asyncio.ensure_future(send(f"high-{i}", "high")) for i in range(3)]
        await eventually(
            lambda: gateway.assert_metric("gateway_queue_depth", 3, model="sim", priority="high")
        )
        await let_go(sim)
        await asyncio.gather(*sends)
        await blocker
    finally:
        await client.close()
    # Queued later, the high requests leave first, as one call; the low ones as the next.
    assert finished == ["high"] * 3 + ["low"] * 3
    assert sim.stats()["completed"] == 3
    assert gateway.metric("gateway_batch_size_sum", model="sim") == 1 + 3 + 3


async def test_a_request_that_cannot_merge_passes_alone_and_one_alone_passes_byte_for_byte(
    start_sim, start_gateway
):
    sim = start_sim(slots=1, base_ms=100)
    gateway = start_gateway(batching_config(sim))
    document = {
        "id": "odd",
        "inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1.5, 2]}],
    }
    body = json.dumps(document, indent=1).encode()  # spacing the gateway would not write itself
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway.url + "/v2/models/sim/infer", data=body) as reply:
            through_gateway = await reply.read()
        async with http.post(sim.url + "/v2/models/sim/infer", data=body) as reply:
            direct = await reply.read()
    assert through_gateway == direct

    client = triton.InferenceServerClient(gateway.url.removeprefix("http://"))
    try:
        blocker = await hold_the_slot(client, sim)
        first = asyncio.ensure_future(infer(client, rows(1, 1), "a"))
        await queued(gateway, 1)
        # A sequence request must reach the backend as it is, never merged.
        odd = asyncio.ensure_future(infer(client, rows(1, 2), "seq", sequence_id=7, sequence_start=True))
        await queued(gateway, 2)
        last = asyncio.ensure_future(infer(client, rows(1, 3), "b"))
        await queued(gateway, 3)
        await let_go(sim)
        results = await asyncio.gather(first, odd, last)
        await blocker
    finally:
        await client.close()
    for result, seed, request_id in zip(results, [1, 2, 3], ["a", "seq", "b"], strict=True):
        check_own_rows(result, rows(1, seed), request_id)
    # One backend: nothing is pinned (policies.sequences), the sequence's request keeps its place in
    # its flow, passes alone, and keeps the two around it apart.
    assert sim.stats()["completed"] == 2 + 1 + 3
    assert sim.stats()["sequences"] == {"7": 1}
    assert gateway.metric("gateway_batch_size_sum", model="sim") == 4  # each alone, the first one too


async def test_an_upstream_error_reaches_exactly_the_members_of_its_batch(start_sim, start_gateway):
    sim = start_sim(slots=1, base_ms=200)
    gateway = start_gateway(batching_config(sim))
    client = triton.InferenceServerClient(gateway.url.removeprefix("http://"))
    try:
        blocker = await hold_the_slot(client, sim)
        members = [asyncio.ensure_future(infer(client, rows(2, i), f"m{i}")) for i in range(4)]
        await queued(gateway, 4)
        # From now on the backend answers every inference it receives 500: the batch is one.
        await let_go(sim, {"status": 500})
        outcomes = await asyncio.gather(*members, return_exceptions=True)
        check_own_rows(await blocker, rows(1, 99), "blocker")
        received = json.loads((await asyncio.to_thread(http_post, sim.url + "/sim/fault", b"{}"))[1])[
            "received"
        ]
        after = await infer(client, rows(1, 5), "after")
    finally:
        await client.close()
    assert all(isinstance(o, Exception) for o in outcomes), outcomes
    assert all(getattr(o, "status", lambda: None)() == "500" for o in outcomes), outcomes
    assert len({str(o) for o in outcomes}) == 1  # the backend's own message, to each
    assert received == 2  # the blocker and the one batch
    check_own_rows(after, rows(1, 5), "after")
    assert (
        gateway.metric("gateway_requests_total", model="sim", priority="low", outcome="backend_server_error")
        == 4
    )


async def test_a_client_that_leaves_while_its_batch_is_in_flight_does_not_disturb_the_others(
    start_sim, start_gateway
):
    sim = start_sim(slots=1, base_ms=1000)  # a wide window to leave while the batch runs
    gateway = start_gateway(batching_config(sim))
    client = triton.InferenceServerClient(gateway.url.removeprefix("http://"))
    try:
        blocker = await hold_the_slot(client, sim)
        members = [asyncio.ensure_future(infer(client, rows(1, i), f"m{i}")) for i in range(3)]
        await queued(gateway, 3)
        async with aiohttp.ClientSession() as http:
            document = {
                "inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [7, 8, 9]}]
            }
            leaving = asyncio.ensure_future(http.post(gateway.url + "/v2/models/sim/infer", json=document))
            await queued(gateway, 4)
            await let_go(sim)
            await blocker
            await eventually(lambda: sim.stats()["completed"] == 1 and sim.stats()["inflight"] == 1)
            leaving.cancel()  # its batch is on the backend: the client goes
            results = await asyncio.gather(*members)
    finally:
        await client.close()
    for i, result in enumerate(results):
        check_own_rows(result, rows(1, i), f"m{i}")
    assert sim.stats()["completed"] == 2
    await eventually(
        lambda: (
            gateway.metric(
                "gateway_requests_total", model="sim", priority="low", outcome="client_disconnected"
            )
            == 1
        )
    )
    await eventually(lambda: gateway.metric("gateway_inflight_requests", model="sim") == 0)


async def test_on_the_last_free_slot_a_batch_waits_for_companions_up_to_max_delay(start_sim, start_gateway):
    sim = start_sim(slots=1, base_ms=20)
    # A delay far longer than the test needs, and a batch of 4 that leaves as soon as it is full:
    # however slow the machine, the companions join before the first member's wait is up.
    config = batching_config(sim, max_batch_size=4, max_delay_ms=3000, expected_service_ms=20)
    gateway = start_gateway(config)
    client = triton.InferenceServerClient(gateway.url.removeprefix("http://"))
    try:
        # Nothing queued, the one slot free: the first waits, and three more join it.
        first = asyncio.ensure_future(infer(client, rows(1, 0), "r0"))
        await queued(gateway, 1)
        await asyncio.sleep(0.3)  # how long the first waits alone is the scenario
        assert gateway.metric("gateway_queue_depth", model="sim", priority="low") == 1  # still held
        assert sim.stats()["faults"]["received"] == 0  # nothing sent yet, the slot free
        rest = [asyncio.ensure_future(infer(client, rows(1, i), f"r{i}")) for i in (1, 2, 3)]
        results = await asyncio.gather(first, *rest)
    finally:
        await client.close()
    for i, result in enumerate(results):
        check_own_rows(result, rows(1, i), f"r{i}")
    assert sim.stats()["completed"] == 1
    assert gateway.metric("gateway_batch_size_sum", model="sim") == 4
    waited = gateway.metric("gateway_batch_wait_seconds_sum", model="sim")
    # The first member was held at least the 0.3 s it waited alone; the batch left once full,
    # not when the first member's 3 s were up (all four would have been held until then).
    assert 0.3 <= waited < 3.0


async def infer_timed(gateway, array, request_id, **headers):
    """`infer` as tritonclient sends it (binary tensors), with the gateway's Server-Timing of the
    answer in ms by name (queue, batch, upstream), which tritonclient does not show."""
    item = triton.InferInput("INPUT0", list(array.shape), "FP32")
    item.set_data_from_numpy(array, binary_data=True)
    wanted = [triton.InferRequestedOutput("OUTPUT0", binary_data=True)]
    body, json_size = triton.InferenceServerClient.generate_request_body(
        [item], outputs=wanted, request_id=request_id
    )
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    async with (
        aiohttp.ClientSession() as http,
        http.post(gateway.url + "/v2/models/sim/infer", data=body, headers=headers) as reply,
    ):
        assert reply.status == 200, await reply.text()
        answer = await reply.read()
        header_length = reply.headers.get("Inference-Header-Content-Length")
        timing = dict(part.strip().split(";dur=") for part in reply.headers["Server-Timing"].split(","))
    result = triton.InferResult.from_response_body(answer, False, header_length)
    return result, {name: float(ms) for name, ms in timing.items()}


async def test_batching_never_holds_a_request_past_its_budget(start_sim, start_gateway):
    # A service time of 100 ms: the margins the hold keeps are service times, wide enough to read
    # on a slow machine.
    sim = start_sim(slots=1, base_ms=100)
    gateway = start_gateway(batching_config(sim, max_delay_ms=3000, expected_service_ms=100))
    client = triton.InferenceServerClient(gateway.url.removeprefix("http://"))
    try:
        patient = asyncio.ensure_future(infer(client, rows(1, 0), "patient"))
        await queued(gateway, 1)
        # 1 s in all: 900 ms it may wait (the budget less a service time), and the batch leaves
        # a service time before that, at 800 ms, long before the 3 s it would wait for companions
        # otherwise.
        urgent, timing = await infer_timed(gateway, rows(1, 1), "urgent", **{"X-Request-Timeout-Ms": "1000"})
        check_own_rows(urgent, rows(1, 1), "urgent")
        check_own_rows(await patient, rows(1, 0), "patient")
    finally:
        await client.close()
    assert sim.stats()["completed"] == 1  # one batch: the patient left with the urgent one
    assert gateway.metric("gateway_requests_total", model="sim", priority="low", outcome="ok") == 2
    # The urgent member's own hold (800 ms) ended within the wait its budget allows, so that a
    # service time of its budget was left; and the patient one left with it, far from its 3 s:
    # the two holds, about 0.8 s each, come to less than the budget each.
    assert timing["batch"] < 900, timing
    assert gateway.metric("gateway_batch_wait_seconds_sum", model="sim") < 2 * 1.0


def held_infers(go: asyncio.Event, infer_answer: bytes):
    """A backend that answers health checks at once and each inference with `infer_answer` once
    `go` is set."""

    async def handler(server: ScriptedServer, reader: Reader, writer: Writer) -> None:
        while request := await server.read_request(reader):
            if request.startswith(b"POST"):
                await go.wait()
                writer.write(infer_answer)
            else:
                writer.write(OK)
            await writer.drain()

    return handler


async def test_a_batched_answer_whose_header_length_cannot_be_read_is_a_502_to_each_member(start_gateway):
    go = asyncio.Event()
    unreadable = (  # more digits than Python's int() takes
        b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
        b"inference-header-content-length: " + b"9" * 5000 + b"\r\ncontent-length: 2\r\n\r\n{}"
    )
    document = {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    async with ScriptedServer(held_infers(go, unreadable)) as server:
        backend = SimpleNamespace(url=f"http://127.0.0.1:{server.origin.port}")
        gateway = await asyncio.to_thread(start_gateway, batching_config(backend))

        async def post(http: aiohttp.ClientSession) -> int:
            headers = {"X-Request-Timeout-Ms": "8000"}
            async with http.post(
                gateway.url + "/v2/models/sim/infer", json=document, headers=headers
            ) as reply:
                await reply.read()
                return reply.status

        async with aiohttp.ClientSession() as http:
            first = asyncio.ensure_future(post(http))
            await eventually(lambda: any(r.startswith(b"POST") for r in server.requests), what="a call held")
            members = [asyncio.ensure_future(post(http)) for _ in range(2)]
            await queued(gateway, 2)
            go.set()
            assert await first == 200  # alone, its answer passes as it came
            assert await asyncio.gather(*members) == [502, 502]
    assert sum(r.startswith(b"POST") for r in server.requests) == 2  # the members' call was one
    assert (
        gateway.metric("gateway_requests_total", model="sim", priority="low", outcome="upstream_error") == 2
    )
    assert "Traceback" not in gateway.log()
