"""Queued request bodies are bounded in bytes (limits.max_queued_bytes, models[].max_queued_bytes):
a body that does not fit is refused 429 queue_full with Retry-After at once, the ones that fit are
served, and the bytes held go back to 0."""

import asyncio
import io
import json

import aiohttp
import pytest

from tests.eventually import eventually
from tests.integration.servers import gateway_config, http_post, rss_bytes

pytestmark = pytest.mark.anyio
MIB = 1024 * 1024


def infer_body(size: int) -> bytes:
    """A KServe request of about `size` bytes: a small tensor and a padding parameter."""
    head = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
    padded = json.dumps({**head, "parameters": {"pad": ""}}).encode()
    return padded.replace(b'"pad": ""', b'"pad": "' + b"x" * max(0, size - len(padded)) + b'"')


def config_for(sim, **limits):
    config = gateway_config(
        [(sim.url, 1)],
        expected_service_ms=400,
        priorities=[{"name": "high", "max_wait_ms": 20_000}, {"name": "low", "max_wait_ms": 20_000}],
        limits=limits.pop("limits", {}),
    )
    config["models"][0].update(limits)
    return config


def start_gateway_with(start_sim, start_gateway, **limits):
    return start_gateway(config_for(start_sim(slots=1, base_ms=400), **limits))


async def post(http, gateway, size: int) -> tuple[int, dict, dict]:
    async with http.post(gateway.url + "/v2/models/sim/infer", data=io.BytesIO(infer_body(size))) as reply:
        return reply.status, dict(reply.headers), await reply.json(content_type=None)


async def fill(http, gateway, sizes: list[int]) -> list[asyncio.Task]:
    """One request on the slot, then `sizes` queued behind it; returns their tasks once queued."""
    first = asyncio.ensure_future(post(http, gateway, 100))
    await eventually(lambda: gateway.metric("gateway_inflight_requests", model="sim") == 1)
    queued = [asyncio.ensure_future(post(http, gateway, size)) for size in sizes]
    await eventually(lambda: gateway.metric("gateway_queue_depth", model="sim", priority="low") == len(sizes))
    return [first, *queued]


@pytest.mark.parametrize(
    "limits",
    [{"limits": {"max_queued_bytes": 3 * MIB}}, {"max_queued_bytes": 3 * MIB}],
    ids=["replica-wide", "per-model"],
)
async def test_a_body_past_the_bound_is_refused_at_once_and_the_rest_are_served(
    start_sim, start_gateway, limits
):
    gateway = start_gateway_with(start_sim, start_gateway, **limits)
    async with aiohttp.ClientSession() as http:
        served = await fill(http, gateway, [MIB, MIB])
        held = gateway.metric("gateway_queued_body_bytes", model="sim")
        assert 2 * MIB <= held < 2 * MIB + 4096

        status, headers, body = await post(http, gateway, 3 * MIB // 2)
        assert status == 429 and body["reason"] == "queue_full"
        assert int(headers["retry-after-ms"]) > 0 and int(headers["Retry-After"]) >= 1
        named = "limits.max_queued_bytes" if "limits" in limits else "models[sim].max_queued_bytes"
        assert body["rule"] == named  # the setting to raise, not a neighbour of it

        served.append(asyncio.ensure_future(post(http, gateway, MIB // 2)))  # fits in the rest
        assert [status for status, _, _ in await asyncio.gather(*served)] == [200] * 4
    await eventually(lambda: gateway.metric("gateway_queued_body_bytes", model="sim") == 0)
    assert gateway.metric_by("gateway_requests_total", "outcome", model="sim") == {
        "ok": 4.0,
        "queue_full": 1.0,
    }


async def test_a_body_that_gets_a_slot_at_once_is_not_held(start_sim, start_gateway):
    """Only queued bodies count: with the slot free, a body larger than the bound is served."""
    gateway = start_gateway_with(start_sim, start_gateway, limits={"max_queued_bytes": MIB})
    async with aiohttp.ClientSession() as http:
        status, _, _ = await post(http, gateway, 2 * MIB)
    assert status == 200


async def test_a_queued_body_is_held_once(start_sim, start_gateway, monkeypatch):
    """The body is kept only in the request as it will go on the wire, not beside it as well: each
    queued body adds about its size to the gateway's memory, not twice that. (Measured over bodies
    after the first two; glibc's mmap threshold is fixed, so that every body-sized block is its own
    mapping and freed ones leave the process: by default the threshold rises after the first large
    free, and the heap keeps a varying part of the freed bodies.)"""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    sim = start_sim(slots=1, base_ms=400)
    # The slot's request stays on it until the test is done (then it ends, so that no stop waits for it).
    assert http_post(sim.url + "/sim/fault", json.dumps({"hang": True}).encode())[0] == 200
    gateway = start_gateway(config_for(sim))
    pid = gateway.process.pid
    try:
        async with aiohttp.ClientSession() as http:
            waiting = await fill(http, gateway, [16 * MIB] * 2)
            before = rss_bytes(pid)
            waiting += await queue_more(http, gateway, [16 * MIB] * 4, depth=6)
            grown = rss_bytes(pid) - before
            for request in waiting:
                request.cancel()  # the clients leave: their tickets go, the bodies with them
    finally:
        assert http_post(sim.url + "/sim/fault", b"{}")[0] == 200
    # One copy each is 64 MiB, two 128.
    assert grown < 1.5 * 64 * MIB, f"4 queued 16 MiB bodies took {grown / MIB:.0f} MiB"
    await eventually(lambda: gateway.metric("gateway_queued_body_bytes", model="sim") == 0)


async def queue_more(http, gateway, sizes: list[int], *, depth: int) -> list[asyncio.Task]:
    queued = [asyncio.ensure_future(post(http, gateway, size)) for size in sizes]
    await eventually(lambda: gateway.metric("gateway_queue_depth", model="sim", priority="low") == depth)
    return queued
