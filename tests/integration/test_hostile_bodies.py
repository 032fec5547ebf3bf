"""Bodies built to hurt the gateway itself: JSON nested past Python's recursion limit, model names
megabytes long, bodies large enough to stall the event loop while they parse. Each gets a clear
answer, counted, and leaves nothing behind in memory."""

import io
import json
from pathlib import Path

import aiohttp
import pytest

from tests.integration.servers import gateway_config

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def gateway(module_launcher):
    sim = module_launcher.sim(slots=2, base_ms=1)
    return module_launcher.gateway(gateway_config([(sim.url, 2)]))


async def chat(http: aiohttp.ClientSession, gateway, body: bytes) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    # A file-like body: aiohttp warns that raw bytes this large would block its own loop.
    async with http.post(
        gateway.url + "/v1/chat/completions", data=io.BytesIO(body), headers=headers
    ) as reply:
        return reply.status, await reply.json(content_type=None)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc status")


async def test_json_nested_past_the_recursion_limit_is_a_counted_400(gateway):
    deep = b'{"model": "sim", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    async with aiohttp.ClientSession() as http:
        status, body = await chat(http, gateway, deep)
        assert (status, body["error"]["code"]) == (400, "bad_request")
        assert "nests too deep" in body["error"]["message"]
        fine = b'{"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
        assert (await chat(http, gateway, fine))[0] == 200
    assert gateway.metric("gateway_requests_total", model="", priority="low", outcome="bad_request") >= 1
    assert "Traceback" not in gateway.log()


async def test_a_large_body_is_parsed_off_the_event_loop_and_served(gateway):
    padding = "x" * (3 << 20)  # past the size parsed inline
    message = {"role": "user", "content": padding}
    body = json.dumps({"model": "sim", "max_tokens": 1, "messages": [message]}).encode()
    async with aiohttp.ClientSession() as http:
        assert (await chat(http, gateway, body))[0] == 200


@pytest.fixture(scope="module")
def priced(module_launcher):
    """Models priced by their bodies: batch items, and tokens."""
    sim = module_launcher.sim(slots=2, base_ms=1)
    config = gateway_config([(sim.url, 2)])
    backends = config["models"][0]["backends"]
    config["models"] += [
        {"name": "items", "cost": "batch_items", "expected_service_ms": 40, "backends": backends},
        {"name": "tok", "cost": "tokens", "expected_service_ms": 40, "backends": backends},
    ]
    return module_launcher.gateway(config)


async def test_bodies_that_pricing_cannot_read_cost_one_and_reach_the_backend(priced):
    """A body nested past the recursion limit, a prompt nested hundreds deep, a header length of
    more digits than int() takes: pricing gives up on them (they cost 1 unit), it never ends the
    request in a 500 of the gateway's own, uncounted."""
    infer_url = priced.url + "/v2/models/items/infer"
    deep_tensor = b'{"inputs": [{"name": "x", "shape": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}"
    nested_prompt = {"model": "tok", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(600):
        nested_prompt["messages"][0]["content"] = [nested_prompt["messages"][0]["content"]]
    async with aiohttp.ClientSession() as http:
        async with http.post(infer_url, data=io.BytesIO(deep_tensor)) as reply:
            deep = reply.status, await reply.text()
        digits = {"Inference-Header-Content-Length": "9" * 5000}
        async with http.post(infer_url, data=b'{"inputs": []}', headers=digits) as reply:
            long_length = reply.status, await reply.text()
        async with http.post(priced.url + "/v1/chat/completions", json=nested_prompt) as reply:
            prompt = reply.status, await reply.text()
    # The backend's own verdicts (the simulator refuses the first two), in its words.
    assert deep[0] == 400 and "Internal Server Error" not in deep[1]
    assert long_length[0] == 400 and "Internal Server Error" not in long_length[1]
    assert prompt[0] == 200
    assert (
        priced.metric("gateway_requests_total", model="items", priority="low", outcome="backend_client_error")
        == 2
    )
    assert priced.metric("gateway_requests_total", model="tok", priority="low", outcome="ok") == 1
    assert "Traceback" not in priced.log()
