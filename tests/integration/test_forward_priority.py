"""The gateway's class, forwarded to engines that schedule by priority (`forward_priority`): the
simulator records the values it receives, in vLLM's body field and in Triton's parameter."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
import tritonclient.http.aio as triton

from tests.eventually import eventually
from tests.integration.servers import gateway_config

pytestmark = pytest.mark.anyio

VLLM_VALUES = {"high": 0, "low": 10}


def forwarding_config(sim, values, *, slots=8, **backend):
    config = gateway_config([(sim.url, slots)])
    config["models"][0]["backends"][0].update({"forward_priority": {"values": values}, **backend})
    config["priorities"] = [{"name": "high", "max_wait_ms": 5000}, {"name": "low", "max_wait_ms": 5000}]
    config["tenants"] = [{"name": "free", "max_priority": "low"}, {"name": "paid"}]
    return config


async def chat(http, gateway, tenant, class_name, **body):
    headers = {"X-Tenant": tenant, "X-Priority": class_name}
    request = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    async with http.post(gateway.url + "/v1/chat/completions", json=request, headers=headers) as reply:
        assert reply.status == 200, await reply.text()
        return await reply.json()


async def test_vllm_gets_the_class_in_its_priority_field_never_a_priority_the_tenant_may_not_ask_for(
    start_sim, start_gateway
):
    sim = start_sim(extra_args=("--engine", "continuous", "--step-ms", "1"))
    gateway = start_gateway(forwarding_config(sim, VLLM_VALUES, kind="vllm"))
    async with aiohttp.ClientSession() as http:
        await chat(http, gateway, "paid", "high")
        assert sim.stats()["priorities"] == {"0": 1}
        # A tenant capped at low asks for high, and writes its own engine priority into the body.
        await chat(http, gateway, "free", "high", priority=-100)
        assert sim.stats()["priorities"] == {"0": 1, "10": 1}
        await chat(http, gateway, "paid", "low")
        assert sim.stats()["priorities"] == {"0": 1, "10": 2}


async def test_triton_gets_the_class_as_its_priority_parameter_in_json_and_binary_bodies(
    start_sim, start_gateway
):
    sim = start_sim()
    gateway = start_gateway(forwarding_config(sim, {"high": 1, "low": 5}, kind="kserve"))
    client = triton.InferenceServerClient(gateway.url.removeprefix("http://"))
    try:
        for binary in (True, False):
            item = triton.InferInput("INPUT0", [1, 3], "FP32")
            item.set_data_from_numpy(np.arange(3, dtype=np.float32).reshape(1, 3), binary_data=binary)
            # tritonclient's own priority (1 = highest) is replaced by the class's.
            result = await client.infer(
                "sim", [item], priority=1, headers={"X-Tenant": "free", "X-Priority": "high"}
            )
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.arange(3).reshape(1, 3))
    finally:
        await client.close()
    assert sim.stats()["priorities"] == {"5": 2}


async def test_without_forward_priority_the_body_passes_as_the_client_sent_it(start_sim, start_gateway):
    sim = start_sim(extra_args=("--engine", "continuous", "--step-ms", "1"))
    config = gateway_config([(sim.url, 8)])
    gateway = start_gateway(config)
    async with aiohttp.ClientSession() as http:
        request = {"model": "sim", "prompt": "x", "max_tokens": 1, "priority": 7}
        async with http.post(gateway.url + "/v1/completions", json=request) as reply:
            assert reply.status == 200
    assert sim.stats()["priorities"] == {"7": 1}


async def test_an_engine_that_schedules_by_priority_runs_the_urgent_request_before_those_queued_inside(
    start_sim, start_gateway
):
    # The engine runs one sequence at a time; the gateway lets four in, so three wait inside it.
    sim = start_sim(
        extra_args=(
            "--engine",
            "continuous",
            "--step-ms",
            "3",
            "--max-num-seqs",
            "1",
            "--scheduling-policy",
            "priority",
        )
    )
    gateway = start_gateway(forwarding_config(sim, VLLM_VALUES, slots=4, kind="vllm"))
    long = {"max_tokens": 300, "ignore_eos": True}  # 0.9 s each: the high one arrives well within
    async with aiohttp.ClientSession() as http:
        lows = [asyncio.ensure_future(chat(http, gateway, "paid", "low", **long)) for _ in range(3)]
        await eventually(lambda: sim.stats()["continuous"]["waiting"] == 2, what="two lows waiting inside")
        high = asyncio.ensure_future(chat(http, gateway, "paid", "high", **long))
        done, _ = await asyncio.wait([high, *lows[1:]], return_when=asyncio.FIRST_COMPLETED)
        first_done = done.pop()
        await asyncio.gather(high, *lows)
    assert first_done is high
