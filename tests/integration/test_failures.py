"""When things break: no backend, a backend that dies, a slow backend, shutdown, a bad config."""

import asyncio
import json
import signal
import socket
import subprocess
import sys

import aiohttp
import pytest

from tests.eventually import eventually
from tests.integration.servers import gateway_config, http_get, http_post

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
PATH = "/v2/models/sim/infer"


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def set_fault(sim, fault):
    """The simulator's fault from now on (gateway.tools.model_server.faults): {"hang": True}
    holds the inference requests it takes until it is cleared with {}, however slow the machine is;
    a held request is counted in the faults' "hanging", not in "inflight"."""
    body = json.dumps(fault).encode()
    assert (await asyncio.to_thread(http_post, sim.url + "/sim/fault", body))[0] == 200


async def infer(gateway, **headers):
    async with aiohttp.ClientSession() as http:
        reply = await http.post(gateway.url + PATH, json=INFER, headers=headers)
        return reply.status, dict(reply.headers), await reply.json(content_type=None)


async def test_no_ready_backend_is_503_with_retry_after(start_gateway):
    gateway = start_gateway(gateway_config([(closed_port_url(), 2)]), wait_ready=False)
    assert http_get(gateway.url + "/readyz")[0] == 503
    status, headers, body = await infer(gateway)
    assert (status, body["reason"]) == (503, "no_backend")
    assert int(headers["Retry-After"]) >= 1 and "retry-after-ms" in headers
    async with aiohttp.ClientSession() as http:
        reply = await http.post(gateway.url + "/v1/embeddings", json={"model": "sim", "input": "x"})
        assert reply.status == 503
        assert (await reply.json())["error"]["code"] == "no_backend"


async def test_a_backend_down_from_the_start_is_logged_once_with_its_reason(start_gateway):
    url = closed_port_url()
    gateway = start_gateway(gateway_config([(url, 2)]), wait_ready=False)
    said = f"backend {url} of model sim is not ready: cannot connect to {url}/v2/health/ready"
    await eventually(lambda: said in gateway.log())
    await asyncio.sleep(1.0)  # five more health checks (every 200 ms) must not say it again
    assert gateway.log().count("is not ready") == 1


async def test_backend_death_fails_fast_and_recovery_restores_service(start_sim, start_gateway):
    sim = start_sim(slots=1, base_ms=400)
    classes = [{"name": "high", "max_wait_ms": 5000}, {"name": "low", "max_wait_ms": 5000}]
    gateway = start_gateway(gateway_config([(sim.url, 1)], priorities=classes, expected_service_ms=400))
    await set_fault(sim, {"hang": True})  # the running request is on the backend when it dies
    running = asyncio.ensure_future(infer(gateway))
    await eventually(lambda: sim.stats()["faults"]["hanging"] == 1, what="the request to reach the backend")
    gateway.assert_metric("gateway_inflight_requests", 1, model="sim")
    queued = asyncio.ensure_future(infer(gateway))
    await eventually(lambda: gateway.assert_metric("gateway_queue_depth", 1, priority="low"))
    sim.kill()
    first, second = await asyncio.gather(running, queued)
    assert (first[0], first[2]["reason"]) == (502, "upstream_error")
    assert (second[0], second[2]["reason"]) == (503, "no_backend")
    assert (await infer(gateway))[0] == 503
    assert gateway.metric("gateway_inflight_requests", model="sim") == 0
    assert gateway.metric("gateway_queue_depth", priority="low") == 0

    start_sim(port=int(sim.url.rsplit(":", 1)[1]), base_ms=5)  # the backend comes back
    gateway.wait_ready(timeout_s=15)
    assert (await infer(gateway))[0] == 200


async def test_backend_dying_mid_stream_breaks_the_stream(start_sim, start_gateway):
    sim = start_sim(slots=1, base_ms=5, token_ms=100)
    gateway = start_gateway(gateway_config([(sim.url, 1)]))
    chat = {"model": "sim", "stream": True, "max_tokens": 50, "messages": [{"role": "user", "content": "x"}]}
    async with aiohttp.ClientSession() as http:
        reply = await http.post(gateway.url + "/v1/chat/completions", json=chat)
        assert reply.status == 200
        assert (await reply.content.readline()).startswith(b"data: ")
        sim.kill()
        with pytest.raises(aiohttp.ClientPayloadError):
            await reply.read()
    await eventually(lambda: gateway.assert_metric("gateway_inflight_requests", 0, model="sim"))
    assert gateway.metric("gateway_requests_total", outcome="upstream_error") == 1


async def test_sigterm_drains_in_flight_work_and_refuses_new(start_sim, start_gateway):
    sim = start_sim(slots=2, base_ms=500)
    gateway = start_gateway(gateway_config([(sim.url, 2)], expected_service_ms=500))
    await set_fault(sim, {"hang": True})  # it stays in flight until the new one has been refused
    in_flight = asyncio.ensure_future(infer(gateway))
    await eventually(lambda: sim.stats()["faults"]["hanging"] == 1, what="the request to reach the backend")
    gateway.signal(signal.SIGTERM)
    await eventually(lambda: http_get(gateway.url + "/readyz")[0] == 503, what="/readyz to say draining")
    status, headers, body = await infer(gateway)
    assert (status, body["reason"]) == (503, "draining")
    assert "Retry-After" in headers
    assert not in_flight.done()  # the gateway waits for it
    await set_fault(sim, {})
    assert (await in_flight)[0] == 200
    assert await asyncio.to_thread(gateway.wait, 10) == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("listen: [1, 2\n", "not valid YAML"),
        ("- just a list\n", "top level must be a mapping"),
        ("priorities: []\ndefault_priority: x\nmodels: []\n", "priorities: List should have at least 1 item"),
        (
            "priorities: [{name: a, max_wait_ms: 10}]\ndefault_priority: b\n"
            "models: [{name: m, backends: [{url: 'http://x:1', max_concurrency: 1}]}]\n",
            "default_priority 'b' is not one of ['a']",
        ),
        (
            "priorities: [{name: a, max_wait_ms: 10}]\ndefault_priority: a\n"
            "models: [{name: m, backends: [{url: 'ftp://x', max_concurrency: 0}]}]\nextra: 1\n",
            "models[0].backends[0].max_concurrency: Input should be greater than or equal to 1",
        ),
    ],
)
def test_config_errors_exit_2_naming_the_field(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert expected in done.stderr
    assert "Traceback" not in done.stderr


def test_missing_config_file_exits_2(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(tmp_path / "none.yaml")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "cannot read" in done.stderr


def test_a_port_already_in_use_is_one_line_naming_it_and_exit_2(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "priorities: [{name: a, max_wait_ms: 10}]\ndefault_priority: a\n"
        "models: [{name: m, backends: [{url: 'http://127.0.0.1:9', max_concurrency: 1}]}]\n"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "Traceback" not in done.stderr
