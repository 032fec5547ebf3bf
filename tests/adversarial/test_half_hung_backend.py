"""Half-hung backends: they pass their health checks but do not answer inference, or answer it
with 503s. Passive health (gateway.upstream.health, policies.circuit) must take them out of
dispatch, answer and free what they hold as the slot rules say, and let them back after one
successful trial. Two sims behind one model; the faulty one is listed first, where ties go."""

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.eventually import eventually
from tests.integration.servers import gateway_config, http_get, http_post

pytestmark = pytest.mark.anyio
PATH = "/v2/models/sim/infer"
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
UPSTREAM_TIMEOUT_MS = 30_000  # far beyond every wait below: nothing here is freed by it


def config(*sims: Any, on_abandon: str, slots: int = 4, **health: float) -> dict[str, Any]:
    settings = gateway_config(
        [(sim.url, slots) for sim in sims],
        health={
            "interval_ms": 200,
            "timeout_ms": 500,
            "passive_failures_to_open": 3,
            "stall_timeout_ms": 1000,
            "cooldown_ms": 1000,
            **health,
        },
        priorities=[{"name": "high", "max_wait_ms": 5000}, {"name": "low", "max_wait_ms": 5000}],
        expected_service_ms=20,
    )
    model = settings["models"][0]
    model["upstream_timeout_ms"] = UPSTREAM_TIMEOUT_MS
    for backend in model["backends"]:
        backend["on_abandon"] = on_abandon
    return settings


def set_fault(sim: Any, **fault: Any) -> None:
    assert http_post(sim.url + "/sim/fault", json.dumps(fault).encode())[0] == 200


def faults(sim: Any) -> dict[str, Any]:
    return json.loads(http_get(sim.url + "/sim/fault")[1])


def one_scrape(gateway: Any) -> dict[tuple[str, str], float]:
    """Each sample of /metrics by its name and backend label ("" for none)."""
    families = text_string_to_metric_families(gateway.metrics())
    return {(s.name, s.labels.get("backend", "")): s.value for f in families for s in f.samples}


async def infer(http: aiohttp.ClientSession, gateway: Any) -> tuple[int, str | None, float]:
    """Status, error reason and seconds taken of one inference request."""
    started = time.monotonic()
    async with http.post(gateway.url + PATH, json=INFER) as reply:
        body = await reply.json(content_type=None)
        reason = body.get("reason") if isinstance(body, dict) else None
        return reply.status, reason, time.monotonic() - started


async def in_turn(gateway: Any, count: int) -> list[int]:
    async with aiohttp.ClientSession() as http:
        return [(await infer(http, gateway))[0] for _ in range(count)]


async def test_hung_backend_is_cut_out_its_clients_answered_and_its_slots_freed(start_sim, start_gateway):
    hung = start_sim(slots=4, base_ms=20, on_disconnect="stop")
    healthy = start_sim(slots=4, base_ms=20, on_disconnect="stop")
    gateway = start_gateway(config(hung, healthy, on_abandon="abort", cooldown_ms=3000))
    set_fault(hung, hang=True)

    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(infer(http, gateway) for _ in range(6)))
    stuck = faults(hung)["received"]
    assert stuck >= 1, "some requests reached the hung backend"
    timed_out = [r for r in results if r[0] != 200]
    # Answered at the stall (1 s, found within a look), not at the 30 s upstream timeout.
    assert [(status, reason) for status, reason, _ in timed_out] == [(504, "upstream_timeout")] * stuck
    assert all(taken_s < 10 for _, _, taken_s in timed_out)
    gateway.assert_metric("gateway_backend_ready", 0, backend=hung.url)
    gateway.assert_metric("gateway_backend_slots", 0, backend=hung.url)
    # Abort mode: the gateway closed their connections, the sim stopped them and closed its side.
    await eventually(lambda: faults(hung)["hanging"] == 0, timeout_s=5)
    await eventually(lambda: gateway.assert_metric("gateway_inflight_requests", 0, model="sim"), timeout_s=5)

    served_before = healthy.stats()["completed"]
    assert await in_turn(gateway, 10) == [200] * 10
    assert faults(hung)["received"] == stuck, "an open circuit gets no requests"
    assert healthy.stats()["completed"] == served_before + 10

    set_fault(hung)  # it recovers; after the cool-down one trial decides
    await eventually(lambda: gateway.assert_metric("gateway_backend_slots", 1, backend=hung.url), timeout_s=8)
    gateway.assert_metric("gateway_backend_ready", 1, backend=hung.url)
    assert await in_turn(gateway, 1) == [200]
    assert faults(hung)["received"] == stuck + 1, "the trial went to the recovered backend"
    await eventually(lambda: gateway.assert_metric("gateway_backend_slots", 4, backend=hung.url))
    assert "circuit closed, its trial request succeeded" in gateway.log()

    hung.reset()
    async with aiohttp.ClientSession() as http:
        statuses = [r[0] for r in await asyncio.gather(*(infer(http, gateway) for _ in range(8)))]
    assert statuses == [200] * 8
    assert hung.stats()["peak_inflight"] > 1, "traffic is back with all its slots, not one trial's"


async def test_half_open_sends_one_trial_at_a_time_to_a_backend_still_hung(start_sim, start_gateway):
    hung = start_sim(slots=4, base_ms=20, on_disconnect="stop")
    healthy = start_sim(slots=4, base_ms=50, on_disconnect="stop")
    gateway = start_gateway(config(hung, healthy, on_abandon="abort", stall_timeout_ms=500, cooldown_ms=500))
    set_fault(hung, hang=True)
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(infer(http, gateway) for _ in range(6)))
    await eventually(lambda: faults(hung)["hanging"] == 0, timeout_s=5)
    hung.reset()
    received = faults(hung)["received"]

    statuses: list[int] = []
    deadline = time.monotonic() + 15

    async def client(http: aiohttp.ClientSession) -> None:
        while faults(hung)["received"] < received + 3 and time.monotonic() < deadline:
            statuses.append((await infer(http, gateway))[0])

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(client(http) for _ in range(4)))
    trials = faults(hung)["received"] - received
    assert trials >= 3, "each cool-down ends in a trial"
    assert faults(hung)["peak_hanging"] == 1, "never more than the one trial on a half-open backend"
    assert statuses.count(504) == trials and statuses.count(200) == len(statuses) - trials


async def test_drain_backend_keeps_stalled_slots_until_its_answers_end(start_sim, start_gateway):
    hung = start_sim(slots=4, base_ms=20)  # computes on when its client leaves, as Triton does
    healthy = start_sim(slots=4, base_ms=20)
    gateway = start_gateway(config(hung, healthy, on_abandon="drain"))
    set_fault(hung, hang=True)
    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(infer(http, gateway) for _ in range(6)))
    stuck = faults(hung)["received"]
    assert [r[0] for r in results].count(504) == stuck >= 1  # the clients do not wait
    await asyncio.sleep(2.5)  # past the cool-down (1 s), twice: the held slots must keep it open
    gateway.assert_metric("gateway_inflight_requests", stuck, model="sim")
    gateway.assert_metric("gateway_backend_ready", 0, backend=hung.url)
    assert "circuit half-open" not in gateway.log()

    set_fault(hung)  # the stuck answers end, and only then may the trial go
    completed = hung.stats()["completed"]

    def slots_back_before_trial() -> bool:
        samples = one_scrape(gateway)  # both values from one moment
        ready = samples[("gateway_backend_ready", hung.url)] == 1
        held = samples[("gateway_inflight_requests", "")]
        assert not (ready and held), "half-open while the backend still works on given-up requests"
        return ready

    await eventually(slots_back_before_trial, timeout_s=8)
    assert hung.stats()["completed"] == completed + stuck
    assert await in_turn(gateway, 2) == [200, 200]
    await eventually(lambda: gateway.assert_metric("gateway_backend_slots", 4, backend=hung.url))


async def test_backend_streaming_other_answers_is_not_stalled(start_sim, start_gateway):
    sim = start_sim(slots=4, base_ms=5, token_ms=50, on_disconnect="stop")
    gateway = start_gateway(config(sim, on_abandon="abort", cooldown_ms=10_000))
    set_fault(sim, hang=True, path_prefix="/v2/")  # KServe inference hangs; OpenAI streams on
    chat = {"model": "sim", "stream": True, "max_tokens": 50, "messages": [{"role": "user", "content": "x"}]}

    async def stream(http: aiohttp.ClientSession) -> tuple[bytes, float]:
        async with http.post(gateway.url + "/v1/chat/completions", json=chat) as reply:
            assert reply.status == 200
            return await reply.read(), time.monotonic()

    async with aiohttp.ClientSession() as http:
        streaming = asyncio.ensure_future(stream(http))
        await eventually(lambda: sim.stats()["inflight"] == 1)  # the stream is on the first backend
        hung_infer = asyncio.ensure_future(infer(http, gateway))
        await eventually(lambda: faults(sim)["hanging"] == 1)
        (body, streamed_at), (status, reason, _) = await asyncio.gather(streaming, hung_infer)
        answered_at = time.monotonic()
    assert body.endswith(b"data: [DONE]\n\n"), "the stream ran to its end"
    assert (status, reason) == (504, "upstream_timeout")
    # 2.5 s of tokens kept the backend from stalling; alone, the hung request stalls it 1 s later.
    assert answered_at - streamed_at >= 0.9
    gateway.assert_metric("gateway_backend_ready", 0, backend=sim.url)


async def test_backend_answering_503s_in_a_row_is_cut_out(start_sim, start_gateway):
    failing = start_sim(slots=4, base_ms=5)
    healthy = start_sim(slots=4, base_ms=5)
    gateway = start_gateway(config(failing, healthy, on_abandon="drain", cooldown_ms=10_000))
    set_fault(failing, status=503)
    assert await in_turn(gateway, 6) == [503, 503, 503, 200, 200, 200]
    assert faults(failing)["received"] == 3
    gateway.assert_metric("gateway_backend_ready", 0, backend=failing.url)
    circuit = gateway.metric_by("gateway_backend_circuit_state", "state", backend=failing.url)
    assert circuit == {"closed": 0.0, "open": 1.0, "half_open": 0.0}


async def test_a_model_whose_only_backend_is_cut_out_says_to_come_back_after_the_cooldown(
    start_sim, start_gateway
):
    failing = start_sim(slots=4, base_ms=5)
    gateway = start_gateway(config(failing, on_abandon="drain", cooldown_ms=8000))
    set_fault(failing, status=503)
    assert await in_turn(gateway, 3) == [503, 503, 503]  # the backend's own, passed through
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway.url + PATH, json=INFER) as reply:
            body = await reply.json()
            assert (reply.status, body["reason"]) == (503, "no_backend")
            # The cool-down's rest (8 s, less the moments since it opened), not the 200 ms probe.
            assert 4000 <= int(reply.headers["retry-after-ms"]) <= 8000


@pytest.mark.parametrize("status", [400, 404, 429])
async def test_client_errors_never_open_the_circuit(start_sim, start_gateway, status):
    refusing = start_sim(slots=4, base_ms=5)
    healthy = start_sim(slots=4, base_ms=5)
    gateway = start_gateway(config(refusing, healthy, on_abandon="drain"))
    set_fault(refusing, status=status)
    assert await in_turn(gateway, 8) == [status] * 8
    assert faults(refusing)["received"] == 8
    gateway.assert_metric("gateway_backend_ready", 1, backend=refusing.url)
    gateway.assert_metric("gateway_backend_circuit_state", 1, backend=refusing.url, state="closed")
