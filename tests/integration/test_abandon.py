"""A request's slot follows the backend's work, whatever its client does.

The over-commit reproductions: budgets shorter than the service time, and streaming clients that
hang up, used to hand a slot to the next request while the backend still computed the last one.
The backend's own counter (the simulator's peak in flight) is the judge, in both modes: `drain`
in front of a backend that computes on (Triton, KServe; the simulator by default) and `abort` in
front of one that stops on disconnect (vLLM; the simulator with --on-disconnect stop).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from tests.eventually import eventually
from tests.integration.conftest import Launcher
from tests.integration.servers import Gateway, Sim, gateway_config, http_post

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
PATH = "/v2/models/sim/infer"
PATIENT = [{"name": "high", "max_wait_ms": 5000}, {"name": "low", "max_wait_ms": 5000}]


def start_backend(launcher: Launcher, mode: str, **options: Any) -> Sim:
    """The simulator as a backend that computes on after its client left (drain), or stops (abort)."""
    return launcher.sim(on_disconnect="finish" if mode == "drain" else "stop", **options)


def start_gateway_over(launcher: Launcher, sim: Sim, slots: int, mode: str, **overrides: Any) -> Gateway:
    config = gateway_config([(sim.url, slots)], **overrides)
    config["models"][0]["backends"][0]["on_abandon"] = mode
    return launcher.gateway(config)


async def settled(gateway: Gateway, sim: Sim) -> None:
    await eventually(lambda: gateway.assert_metric("gateway_inflight_requests", 0, model="sim"))
    await eventually(lambda: sim.stats()["inflight"] == 0)


async def infer_status(http: aiohttp.ClientSession, gateway: Gateway, **headers: str) -> tuple[int, str]:
    async with http.post(gateway.url + PATH, json=INFER, headers=headers) as reply:
        body = await reply.json(content_type=None)
        return reply.status, body.get("reason", "")


@pytest.mark.parametrize("mode", ["drain", "abort"])
async def test_budgets_shorter_than_the_service_never_overcommit_the_backend(launcher, mode):
    sim = start_backend(launcher, mode, slots=2, base_ms=700)
    # The gateway expects 50 ms, so it admits budgets of 250 ms that the backend cannot meet.
    gateway = start_gateway_over(launcher, sim, 2, mode, expected_service_ms=50, priorities=PATIENT)
    async with aiohttp.ClientSession() as http:
        # Two requests whose budgets run out while the backend computes them, and two patient
        # ones queued behind: these may start only once the backend has stopped the first two.
        budgeted = [
            asyncio.ensure_future(infer_status(http, gateway, **{"X-Request-Timeout-Ms": "250"}))
            for _ in range(2)
        ]
        # Both on the backend (its peak, which stays: in abort mode the backend stops them at
        # their budgets, so that "running" may have fallen back to 0 by the time it is read).
        await eventually(lambda: sim.stats()["peak_inflight"] == 2)
        patient = [asyncio.ensure_future(infer_status(http, gateway)) for _ in range(2)]
        assert await asyncio.gather(*budgeted) == [(504, "upstream_timeout")] * 2
        assert [status for status, _ in await asyncio.gather(*patient)] == [200, 200]
    await settled(gateway, sim)
    stats = sim.stats()
    assert stats["peak_inflight"] <= 2, stats
    assert stats["stopped"] == (2 if mode == "abort" else 0)  # abort: the backend saw them leave


async def hang_up_after_first_event(http: aiohttp.ClientSession, gateway: Gateway) -> int:
    chat = {"model": "sim", "stream": True, "max_tokens": 40, "messages": [{"role": "user", "content": "x"}]}
    async with http.post(gateway.url + "/v1/chat/completions", json=chat) as reply:
        if reply.status == 200:
            assert (await reply.content.readline()).startswith(b"data: ")
        return reply.status  # leaving the block closes the connection mid-stream


@pytest.mark.parametrize("mode", ["drain", "abort"])
async def test_streaming_clients_that_hang_up_never_overcommit_the_backend(launcher, mode):
    sim = start_backend(launcher, mode, slots=4, base_ms=5, token_ms=25)
    gateway = start_gateway_over(launcher, sim, 4, mode, expected_service_ms=1000)
    statuses: list[int] = []
    async with aiohttp.ClientSession() as http:
        for _ in range(3):
            statuses += await asyncio.gather(*(hang_up_after_first_event(http, gateway) for _ in range(8)))
    assert 200 in statuses
    await eventually(
        lambda: (
            gateway.metric(
                "gateway_requests_total", model="sim", priority="low", outcome="client_disconnected"
            )
            == statuses.count(200)
        )
    )
    await settled(gateway, sim)
    stats = sim.stats()
    assert stats["peak_inflight"] <= 4, stats
    assert stats["stopped"] == (statuses.count(200) if mode == "abort" else 0)


async def set_fault(sim: Sim, fault: dict[str, Any]) -> None:
    """The simulator's fault from now on (gateway.tools.model_server.faults): {"hang": True}
    holds the inference requests it takes until it is cleared with {}, however slow the machine is."""
    body = json.dumps(fault).encode()
    assert (await asyncio.to_thread(http_post, sim.url + "/sim/fault", body))[0] == 200


async def send_and_leave(
    gateway: Gateway, sim: Sim, leave_when_running_s: float, *, held: bool = False
) -> float:
    """Send an inference request on a raw socket and close it once the backend has computed it
    for `leave_when_running_s` (held: once it has been held that long by the simulator's hang
    fault, which the caller has set); returns when it closed."""
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(INFER).encode()
    writer.write(
        b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (PATH.encode(), len(body), body)
    )
    await writer.drain()
    if held:  # a held request is counted as hanging, not as running
        await eventually(lambda: sim.stats()["faults"]["hanging"] == 1)
    else:
        await eventually(lambda: sim.stats()["running"] == 1)
    await asyncio.sleep(leave_when_running_s)  # the client's patience is the behaviour under test
    writer.close()
    await writer.wait_closed()
    return time.monotonic()


def queue_ms(reply: aiohttp.ClientResponse) -> float:
    timing = dict(part.strip().split(";dur=") for part in reply.headers["Server-Timing"].split(","))
    return float(timing["queue"])


async def test_client_leaving_frees_its_slot_at_once_on_an_abort_backend(launcher):
    sim = start_backend(launcher, "abort", slots=1, base_ms=2000)
    gateway = start_gateway_over(launcher, sim, 1, "abort", expected_service_ms=2000, priorities=PATIENT)
    left_at = await send_and_leave(gateway, sim, 0.3)
    await eventually(
        lambda: gateway.assert_metric("gateway_inflight_requests", 0, model="sim"), interval_s=0.005
    )
    # Freed once the hang-up reached the backend and its close came back (a few ms), not after
    # the 1.7 s the request had left to run; the bound is generous for a busy machine.
    assert time.monotonic() - left_at < 0.5
    assert sim.stats()["stopped"] == 1
    async with aiohttp.ClientSession() as http, http.post(gateway.url + PATH, json=INFER) as reply:
        assert reply.status == 200
        assert queue_ms(reply) < 100
    assert (
        gateway.metric("gateway_requests_total", model="sim", priority="low", outcome="client_disconnected")
        == 1
    )
    assert sim.stats()["peak_inflight"] == 1


async def test_client_leaving_keeps_its_slot_until_a_draining_backend_is_done(launcher):
    sim = start_backend(launcher, "drain", slots=1, base_ms=800)
    gateway = start_gateway_over(launcher, sim, 1, "drain", expected_service_ms=800, priorities=PATIENT)
    # The abandoned request is held on the backend until the next one has queued behind it; then
    # it goes on for its 800 ms.
    await set_fault(sim, {"hang": True})
    await send_and_leave(gateway, sim, 0.1, held=True)
    await eventually(
        lambda: (
            gateway.metric(
                "gateway_requests_total", model="sim", priority="low", outcome="client_disconnected"
            )
            == 1
        )
    )
    async with aiohttp.ClientSession() as http:
        sending = asyncio.ensure_future(http.post(gateway.url + PATH, json=INFER))
        # (Were the slot freed, it would hang on the backend too, and never queue.)
        await eventually(lambda: gateway.assert_metric("gateway_queue_depth", 1, priority="low"))
        await set_fault(sim, {})
        async with await sending as reply:
            assert reply.status == 200
            assert queue_ms(reply) > 300  # it waited for the backend to finish the abandoned request
    stats = sim.stats()
    assert stats["peak_inflight"] == 1 and stats["faults"]["peak_hanging"] == 1, stats


async def test_budget_answers_504_at_once_and_holds_the_slot_until_the_backend_is_done(launcher):
    sim = start_backend(launcher, "drain", slots=1, base_ms=600)
    gateway = start_gateway_over(launcher, sim, 1, "drain", expected_service_ms=10)
    await set_fault(sim, {"hang": True})  # the backend holds it until the 504 has been checked
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        status = await infer_status(http, gateway, **{"X-Request-Timeout-Ms": "200"})
    assert status == (504, "upstream_timeout")
    assert time.monotonic() - started < 0.55  # answered at its budget, not when the backend is done
    gateway.assert_metric("gateway_inflight_requests", 1, model="sim")  # the backend still computes
    await eventually(lambda: sim.stats()["faults"]["hanging"] == 1)
    await set_fault(sim, {})  # it goes on for its 600 ms
    await settled(gateway, sim)
    # Its service time still counts, as at least what it took (the estimate starts at 10 ms).
    assert gateway.metric("gateway_service_time_seconds", model="sim") > 0.05


async def test_client_leaving_mid_stream_stops_an_abort_backend_and_frees_the_slot(launcher):
    sim = start_backend(launcher, "abort", slots=2, base_ms=5, token_ms=50)
    gateway = start_gateway_over(launcher, sim, 1, "abort")
    async with aiohttp.ClientSession() as http:
        assert await hang_up_after_first_event(http, gateway) == 200  # the whole stream takes 2 s
        await settled(gateway, sim)
        assert sim.stats()["stopped"] == 1
        assert (
            gateway.metric(
                "gateway_requests_total", model="sim", priority="low", outcome="client_disconnected"
            )
            == 1
        )
        # The slot and the upstream connection pool are fine for the next request.
        assert (await infer_status(http, gateway))[0] == 200
