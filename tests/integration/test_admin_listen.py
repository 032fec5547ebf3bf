"""`admin_listen`: /metrics, /healthz and /readyz on a port of their own, and not on the client's."""

import subprocess
import sys

import aiohttp
import pytest
import yaml

from tests.eventually import eventually_blocking
from tests.integration.servers import gateway_config

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
OPS = ["/metrics", "/healthz", "/readyz"]


@pytest.fixture
def gateway(start_sim, start_gateway):
    sim = start_sim(slots=2, base_ms=5)
    return start_gateway(gateway_config([(sim.url, 2)], admin_listen={"host": "127.0.0.1", "port": 0}))


async def test_operator_routes_answer_on_the_admin_port_only(gateway):
    assert gateway.admin_url != gateway.url
    async with aiohttp.ClientSession() as http:
        for path in OPS:
            async with http.get(gateway.admin_url + path) as reply:
                assert reply.status == 200, path
            async with http.get(gateway.url + path) as reply:
                assert reply.status == 404, path
        async with http.get(gateway.admin_url + "/metrics") as reply:
            assert "gateway_requests_total" in await reply.text()


async def test_the_load_testers_health_probe_answers_on_the_client_port(gateway):
    # GuideLLM and its kind probe /health on the port they will load, before a run.
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway.url + "/health") as reply:
            assert (reply.status, await reply.json()) == (200, {"live": True})


async def test_clients_are_served_on_the_client_port_only(gateway):
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway.url + "/v2/models/sim/infer", json=INFER) as reply:
            assert reply.status == 200
        async with http.post(gateway.admin_url + "/v2/models/sim/infer", json=INFER) as reply:
            assert reply.status == 404
        async with http.get(gateway.admin_url + "/v2/models/sim") as reply:
            assert reply.status == 404
    assert gateway.metric_by("gateway_requests_total", "outcome", model="sim") == {"ok": 1.0}


def probe(gateway, port: int, *flags: str) -> subprocess.CompletedProcess[str]:
    """`inference-gateway probe` against the gateway's own config, given the port it bound for 0."""
    command = [sys.executable, "-m", "gateway", "probe", "--config", str(gateway.config_path)]
    return subprocess.run([*command, "--port", str(port), *flags], capture_output=True, text=True, timeout=30)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_probe_asks_the_admin_listener_where_the_config_moved_the_operator_routes(gateway):
    healthy = probe(gateway, port_of(gateway.admin_url))
    assert healthy.returncode == 0, healthy.stderr
    assert healthy.stdout.strip() == f"http://127.0.0.1:{port_of(gateway.admin_url)}/healthz: 200"
    ready = probe(gateway, port_of(gateway.admin_url), "--ready")
    assert ready.returncode == 0, ready.stderr
    # Given the client port instead, it asks the admin path there and is answered 404.
    wrong = probe(gateway, port_of(gateway.url))
    assert wrong.returncode == 1
    assert ": 404" in wrong.stderr


def test_probe_asks_the_client_listener_without_admin_listen_and_fails_when_not_ready(
    start_sim, start_gateway
):
    sim = start_sim(slots=1, base_ms=5)
    gateway = start_gateway(gateway_config([(sim.url, 1)]))
    assert probe(gateway, port_of(gateway.url), "--ready").returncode == 0
    sim.stop()
    eventually_blocking(
        lambda: probe(gateway, port_of(gateway.url), "--ready").returncode == 1,
        timeout_s=10,
        what="the probe fails once the only backend is gone",
    )
    assert probe(gateway, port_of(gateway.url)).returncode == 0  # alive, though not ready


def test_probe_with_a_port_of_0_and_no_override_says_why_it_cannot_ask(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump(gateway_config([("http://127.0.0.1:9", 1)])))
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "probe", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "listen.port is 0" in result.stderr
