"""Requests priced in tokens (`cost: tokens`): estimated at arrival, learned from the usage the
continuous simulator returns, exported; through the openai client, plain and streamed."""

from __future__ import annotations

import random

import openai
import pytest

from tests.eventually import eventually
from tests.integration.servers import gateway_config

pytestmark = pytest.mark.anyio

WORDS = "the quick brown fox jumps over a lazy dog while engineers internationalize gateways".split()


def token_config(sim, **model_overrides):
    config = gateway_config([(sim.url, 16)])
    model = config["models"][0]
    model["backends"][0]["kind"] = "vllm"
    model.update({"cost": "tokens", **model_overrides})
    return config


def continuous(start_sim):
    return start_sim(extra_args=("--engine", "continuous", "--step-ms", "2", "--max-num-seqs", "16"))


def a_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120)))


async def test_before_any_answer_a_request_costs_its_prompt_at_four_characters_a_token_and_its_max_tokens(
    start_sim, start_gateway
):
    sim = continuous(start_sim)
    gateway = start_gateway(token_config(sim))
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    await client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "x" * 400}], max_tokens=20
    )
    assert gateway.metric("gateway_request_cost_count", model="sim") == 1
    assert gateway.metric("gateway_request_cost_sum", model="sim") == 0.5 * 400 / 4 + 20
    await client.close()


async def test_the_cost_estimate_converges_on_the_usage_the_engine_reports(start_sim, start_gateway):
    sim = continuous(start_sim)
    gateway = start_gateway(token_config(sim))
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    rng = random.Random(3)
    actual_costs = []
    try:
        for index in range(60):
            messages = [{"role": "user", "content": a_prompt(rng)}]
            if index % 2:
                answer = await client.chat.completions.create(
                    model="sim", messages=messages, max_tokens=30, extra_body={"ignore_eos": True}
                )
                usage = answer.usage
            else:  # streams teach it too, when they carry usage
                stream = await client.chat.completions.create(
                    model="sim",
                    messages=messages,
                    max_tokens=30,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                usage = [chunk.usage async for chunk in stream if chunk.usage is not None][-1]
            actual_costs.append(0.5 * usage.prompt_tokens + usage.completion_tokens)
    finally:
        await client.close()
    # The simulator's tokenizer makes about 2.6 characters a token: the prior of 4 was far off.
    await eventually(lambda: gateway.metric("gateway_cost_model_error", model="sim") < 0.1)
    assert gateway.metric("gateway_request_cost_count", model="sim") == 60
    total = gateway.metric("gateway_request_cost_sum", model="sim")
    assert total == pytest.approx(sum(actual_costs), rel=0.1)


async def test_a_model_priced_by_requests_costs_one_each_whatever_its_prompt(start_sim, start_gateway):
    sim = continuous(start_sim)
    gateway = start_gateway(token_config(sim, cost="requests"))
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    for length in (10, 4000):
        await client.completions.create(model="sim", prompt="y" * length, max_tokens=5)
    await client.close()
    assert gateway.metric("gateway_request_cost_sum", model="sim") == 2
    assert gateway.metric_by("gateway_cost_model_error", "model") == {}


async def test_streams_that_do_not_ask_for_usage_teach_it_too_and_get_the_stream_they_asked_for(
    start_sim, start_gateway
):
    sim = continuous(start_sim)
    gateway = start_gateway(token_config(sim))
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    rng = random.Random(5)
    try:
        for _ in range(20):
            stream = await client.chat.completions.create(
                model="sim",
                messages=[{"role": "user", "content": a_prompt(rng)}],
                max_tokens=30,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            chunks = [chunk async for chunk in stream]
            # The gateway asked the engine for usage, and took its chunk out again.
            assert all(chunk.choices for chunk in chunks)
            assert all(chunk.usage is None for chunk in chunks)
            assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    finally:
        await client.close()
    await eventually(lambda: gateway.metric("gateway_cost_model_error", model="sim") < 0.1)
