"""The simulator's continuous engine over HTTP: answers and streams with usage as vLLM writes
them, clients that leave, its metrics as the gateway's scraper reads them, a runtime slowdown."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from gateway.signals.exposition import Exposition
from gateway.signals.readings import read_server
from tests.eventually import eventually
from tests.integration.servers import http_get, http_post

pytestmark = pytest.mark.anyio


def continuous(start_sim, *extra: str):
    return start_sim(extra_args=("--engine", "continuous", "--step-ms", "10", *extra))


async def events(reply: aiohttp.ClientResponse) -> list[dict]:
    return [
        json.loads(line[len(b"data: ") :])
        async for line in reply.content
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"
    ]


async def test_answers_carry_usage_and_streams_carry_it_last_when_asked(start_sim):
    sim = continuous(start_sim)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi there!"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(sim.url + "/v1/chat/completions", json={**chat, "max_tokens": 5}) as reply:
            answer = await reply.json()
        stream = {**chat, "max_tokens": 4, "ignore_eos": True, "stream": True}
        async with http.post(
            sim.url + "/v1/chat/completions", json={**stream, "stream_options": {"include_usage": True}}
        ) as reply:
            with_usage = await events(reply)
        async with http.post(sim.url + "/v1/chat/completions", json=stream) as reply:
            without = await events(reply)
    made = answer["usage"]["completion_tokens"]
    assert 1 <= made <= 5
    assert answer["usage"] == {"prompt_tokens": 11, "completion_tokens": made, "total_tokens": 11 + made}
    assert len(answer["choices"][0]["message"]["content"].split()) == made
    pieces = [c["choices"][0]["delta"]["content"] for c in with_usage[:-1]]
    assert pieces == ["tok0 ", "tok1 ", "tok2 ", "tok3"]
    assert all(c["usage"] is None for c in with_usage[:-1])
    assert with_usage[-1]["choices"] == []
    assert with_usage[-1]["usage"] == {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}
    assert len(without) == 4 and all("usage" not in c for c in without)


async def test_a_client_that_leaves_is_aborted_waiting_or_running(start_sim):
    sim = continuous(start_sim, "--max-num-seqs", "1")
    long = {"model": "m", "prompt": "x", "max_tokens": 5000, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        running = asyncio.ensure_future(http.post(sim.url + "/v1/completions", json=long))
        waiting = asyncio.ensure_future(http.post(sim.url + "/v1/completions", json={**long, "stream": True}))
        await eventually(lambda: sim.stats()["continuous"]["waiting"] == 1, what="one waiting inside")
        running.cancel()
        waiting.cancel()
        await eventually(lambda: sim.stats()["stopped"] == 2, what="both aborted")
    stats = sim.stats()
    assert stats["inflight"] == 0 and stats["continuous"]["kv_used"] == 0


async def test_the_gateways_scraper_reads_the_engines_queue_from_its_metrics(start_sim):
    sim = continuous(start_sim, "--max-num-seqs", "2", "--served-model-name", "llama")
    long = {"model": "llama", "prompt": "x", "max_tokens": 300, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        sends = [asyncio.ensure_future(http.post(sim.url + "/v1/completions", json=long)) for _ in range(5)]
        try:
            await eventually(lambda: sim.stats()["continuous"]["waiting"] == 3, what="three waiting inside")
            reading = read_server(Exposition.parse(http_get(sim.metrics_url)[1].decode()), "llama")
        finally:
            for send in sends:
                send.cancel()
    assert reading is not None
    assert (reading.waiting, reading.running) == (3, 2)
    assert reading.kv_cache_usage is not None and reading.kv_cache_usage > 0


async def test_a_slowdown_set_at_runtime_lengthens_every_step(start_sim):
    sim = continuous(start_sim)
    request = {"model": "m", "prompt": "x", "max_tokens": 20, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:

        async def timed() -> float:
            loop = asyncio.get_running_loop()
            began = loop.time()
            async with http.post(sim.url + "/v1/completions", json=request) as reply:
                assert reply.status == 200
                await reply.read()
            return loop.time() - began

        normal = await timed()
        assert http_post(sim.url + "/sim/speed", b'{"slowdown": 4}')[0] == 200
        slowed = await timed()
    assert normal >= 20 * 0.010
    assert slowed >= 20 * 0.040  # every one of its 20 steps took 4 x 10 ms at least
    assert http_post(sim.url + "/sim/speed", b'{"slowdown": 0}')[0] == 400
