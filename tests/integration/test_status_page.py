"""The status page against a real gateway: what waits where, a queued request found by its id (a
tenant finds only its own), the stream, the refusals of the last minute, and the page in a real
headless browser (Debian's chromium)."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import subprocess
import time

import aiohttp
import pytest

from tests.integration.servers import gateway_config, http_get
from tests.integration.test_backpressure import (
    clear_the_fault,
    hang_the_backend,
    wait_for_hanging,
    wait_for_metric,
)
from tests.redis_server import IN_CI

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
ACME, BETA = "key-of-acme-0001", "key-of-beta-0002"


def status_config(sim, **overrides):
    config = gateway_config(
        [(sim.url, 1)],
        priorities=[{"name": "high", "max_wait_ms": 5000}, {"name": "low", "max_wait_ms": 5000}],
        tenants=[{"name": "acme", "api_keys": [ACME], "weight": 2}, {"name": "beta", "api_keys": [BETA]}],
        **overrides,
    )
    config["admin_listen"] = {"host": "127.0.0.1", "port": 0}
    return config


async def queue_up(http, gateway, sim):
    """One request of acme's on the backend's only slot, held there; behind it acme's a-1 and
    a-2 and beta's b-1 in `low`, and acme's h-1 in `high`: (tasks of them all)."""
    url = gateway.url + "/v2/models/sim/infer"

    async def send(request_id, key, priority="low"):
        headers = {"Authorization": f"Bearer {key}", "X-Request-Id": request_id, "X-Priority": priority}
        async with http.post(url, json=INFER, headers=headers) as reply:
            return reply.status

    await hang_the_backend(sim)
    tasks = [asyncio.ensure_future(send("running", ACME))]
    await wait_for_hanging(sim, 1)
    for count, (request_id, key) in enumerate([("a-1", ACME), ("a-2", ACME), ("b-1", BETA)], start=1):
        tasks.append(asyncio.ensure_future(send(request_id, key)))
        await wait_for_metric(gateway, "gateway_queue_depth", float(count), priority="low")
    tasks.append(asyncio.ensure_future(send("h-1", ACME, "high")))
    await wait_for_metric(gateway, "gateway_queue_depth", 1.0, priority="high")
    return tasks


async def test_the_document_shows_what_waits_where_and_a_request_is_found_by_its_id(start_sim, start_gateway):
    sim = start_sim(slots=1, base_ms=20)
    gateway = start_gateway(status_config(sim))
    async with aiohttp.ClientSession() as http:
        tasks = await queue_up(http, gateway, sim)
        status, body = http_get(gateway.admin_url + "/status.json")
        document = json.loads(body)
        assert status == 200 and document["schema"] == 1 and document["store"]["kind"] == "memory"
        (model,) = document["models"]
        high, low = model["classes"]
        assert (high["name"], high["queued"], low["name"], low["queued"]) == ("high", 1, "low", 3)
        assert {t["name"]: t["queued_work"] for t in low["tenants"]} == {"acme": 2.0, "beta": 1.0}
        assert low["oldest_wait_ms"] > 0 and low["predicted_wait_ms"] > high["predicted_wait_ms"] > 0
        assert model["in_flight"] == 1 and model["backends"][0]["in_flight"] == 1
        assert model["backends"][0]["circuit"] == "closed"

        # Operators find every request on the admin listener; a tenant only its own, by its key.
        _, body = http_get(gateway.admin_url + "/status/requests/b-1")
        found = json.loads(body)
        assert (found["class"], found["tenant"], found["cost"]) == ("low", "beta", 1.0)
        assert found["work_ahead"]["more_urgent_classes"] == 1.0  # h-1
        assert found["waits_for"] == "more_urgent_classes" and found["waited_ms"] > 0
        assert found["starts_within_ms"] > 0
        lookup = gateway.url + "/status/requests/"
        async with http.get(lookup + "a-2", headers={"Authorization": f"Bearer {ACME}"}) as reply:
            assert reply.status == 200 and (await reply.json())["tenant"] == "acme"
        async with http.get(lookup + "a-2", headers={"Authorization": f"Bearer {BETA}"}) as reply:
            assert reply.status == 404  # another tenant's request is not there, for beta
        async with http.get(lookup + "a-2") as reply:
            assert reply.status == 401
        assert http_get(gateway.url + "/status.json")[0] == 404  # the page is the operators'

        await clear_the_fault(sim)
        assert await asyncio.gather(*tasks) == [200] * 5
    assert http_get(gateway.admin_url + "/status/requests/b-1")[0] == 404  # served: no longer queued
    document = json.loads(http_get(gateway.admin_url + "/status.json")[1])
    assert [c["queued"] for c in document["models"][0]["classes"]] == [0, 0]


async def test_refusals_of_the_last_minute_and_the_last_advice_are_shown(start_sim, start_gateway):
    sim = start_sim(slots=1, base_ms=300)
    config = status_config(sim, expected_service_ms=300)
    config["priorities"] = [{"name": "high", "max_wait_ms": 100}, {"name": "low", "max_wait_ms": 100}]
    gateway = start_gateway(config)
    url = gateway.url + "/v2/models/sim/infer"
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {ACME}"}

        async def one():
            async with http.post(url, json=INFER, headers=headers) as reply:
                return reply.status, reply.headers.get("retry-after-ms")

        answers = await asyncio.gather(*(one() for _ in range(10)))
    refused = [advice for status, advice in answers if status == 429]
    assert refused, answers
    low = json.loads(http_get(gateway.admin_url + "/status.json")[1])["models"][0]["classes"][1]
    assert sum(low["refusals_per_minute"].values()) == len(refused)
    assert low["last_retry_after_s"] > 0


async def test_the_stream_sends_the_document_at_most_every_500_ms(start_sim, start_gateway):
    sim = start_sim(slots=1, base_ms=20)
    gateway = start_gateway(status_config(sim))
    arrivals = []
    async with aiohttp.ClientSession() as http, http.get(gateway.admin_url + "/status/stream") as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        async for line in reply.content:
            if line.startswith(b"data: "):
                arrivals.append((time.monotonic(), json.loads(line[6:])))
                if len(arrivals) == 3:
                    break
    assert all(document["schema"] == 1 for _, document in arrivals)
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(arrivals)]
    assert all(gap >= 0.45 for gap in gaps), gaps


CHROMIUM = shutil.which("chromium")


async def test_the_page_renders_in_a_headless_browser_with_models_classes_tenants_and_queued_work(
    start_sim, start_gateway
):
    if CHROMIUM is None:
        reason = "needs Debian's chromium (apt-get install chromium; .ci/run installs it)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    sim = start_sim(slots=1, base_ms=20)
    gateway = start_gateway(status_config(sim))
    async with aiohttp.ClientSession() as http:
        tasks = await queue_up(http, gateway, sim)
        page = await asyncio.to_thread(
            subprocess.run,
            [
                CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--enable-logging=stderr", "--v=0", "--virtual-time-budget=2500", "--dump-dom",
                gateway.admin_url + "/status",
            ],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        await clear_the_fault(sim)
        await asyncio.gather(*tasks)
    dom = page.stdout
    assert '<h2 data-model="sim">sim</h2>' in dom, page.stderr[-2000:]
    assert "<td>high</td><td>1</td>" in dom and "<td>low</td><td>3</td>" in dom
    assert "<td>low / acme</td><td>2.0</td>" in dom and "<td>low / beta</td><td>1.0</td>" in dom
    assert sim.url in dom
    assert "Uncaught" not in page.stderr, page.stderr[-2000:]
