"""Shutdown ends: a drain that times out answers what it cuts and exits 0; a second signal stops at once.

Real processes: the gateway under the CLI, the simulator behind it. A drain is graceful up to
`shutdown.drain_timeout_ms`; then every request still active is cut: answered 503 `draining` when
its response has not started (a KServe answer has not, until its backend answers), its queue ticket
withdrawn, its exchange closed, and the process exits 0 within a few seconds (EXIT_GRACE_S).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest
import redis

from gateway.server.serving import EXIT_GRACE_S
from tests.eventually import eventually
from tests.integration.scripted import OK, ScriptedServer
from tests.integration.servers import Gateway, gateway_config, http_get
from tests.redis_server import RedisServer, redis_url_or_skip, unique_prefix

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
PATH = "/v2/models/sim/infer"
# A backend answer that outlasts every test here. The simulators that take that long stop working
# on a request whose connection closes (as vLLM does), so that they stop with the test.
LONG_MS = 40_000
# From the signal to the exit, past the drain timeout: the cut, closing the connections, the
# lifespan's shutdown, and the interpreter's own exit, on a busy 2-core machine.
EXIT_BOUND_S = EXIT_GRACE_S + 3.0


def draining_config(sim, *, drain_timeout_ms: float, **overrides):
    """One backend of 1 slot; queued requests may wait long enough to be there when the drain starts."""
    classes = [{"name": "high", "max_wait_ms": 30_000}, {"name": "low", "max_wait_ms": 30_000}]
    return gateway_config(
        [(sim.url, 1)],
        priorities=classes,
        shutdown={"drain_timeout_ms": drain_timeout_ms},
        **overrides,
    )


async def infer(
    http: aiohttp.ClientSession, gateway: Gateway, within_s: float = 20.0
) -> tuple[int, str | None, float]:
    """Status, reason (for errors) and when the answer came (monotonic)."""
    timeout = aiohttp.ClientTimeout(total=within_s)
    async with http.post(gateway.url + PATH, json=INFER, timeout=timeout) as reply:
        body = await reply.read()
        reason = json.loads(body).get("reason") if reply.status != 200 else None
        return reply.status, reason, time.monotonic()


async def exit_code(gateway: Gateway, within_s: float) -> int:
    return await asyncio.to_thread(gateway.wait, within_s)


async def test_a_request_past_the_drain_timeout_is_answered_503_draining_and_the_gateway_exits_0(
    start_sim, start_gateway
):
    sim = start_sim(slots=1, base_ms=LONG_MS, on_disconnect="stop")
    gateway = start_gateway(draining_config(sim, drain_timeout_ms=500, expected_service_ms=LONG_MS))
    async with aiohttp.ClientSession() as http:
        in_flight = asyncio.ensure_future(infer(http, gateway))
        await eventually(lambda: sim.stats()["inflight"] == 1, what="the request to reach the backend")
        signalled_at = time.monotonic()
        gateway.signal(signal.SIGTERM)
        status, reason, answered_at = await in_flight
    assert (status, reason) == (503, "draining")
    assert answered_at - signalled_at >= 0.45  # graceful until the timeout, cut after it
    assert await exit_code(gateway, 0.5 + EXIT_BOUND_S) == 0
    assert time.monotonic() - signalled_at < 0.5 + EXIT_BOUND_S
    # Exiting closed the connection to the backend: all that can end the work at that point.
    await eventually(lambda: sim.stats()["inflight"] == 0, what="the backend to see the request end")


async def test_a_stream_still_running_at_the_drain_timeout_is_cut_short_and_the_gateway_exits_0(
    start_sim, start_gateway
):
    sim = start_sim(slots=1, base_ms=5, token_ms=100, on_disconnect="stop")
    gateway = start_gateway(draining_config(sim, drain_timeout_ms=500))
    chat = {"model": "sim", "stream": True, "max_tokens": 400, "messages": [{"role": "user", "content": "x"}]}
    async with (
        aiohttp.ClientSession() as http,
        http.post(gateway.url + "/v1/chat/completions", json=chat) as reply,
    ):
        assert reply.status == 200
        assert (await reply.content.readline()).startswith(b"data: ")
        gateway.signal(signal.SIGTERM)
        # Its status line is out: it cannot become a 503, so it ends broken rather than cleanly.
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(reply.read(), 0.5 + EXIT_BOUND_S)
    assert await exit_code(gateway, EXIT_BOUND_S) == 0


async def _stalled_upload(gateway: Gateway) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A request head declaring 1000 body bytes, and 11 of them; returns once the gateway reads it.

    `Expect: 100-continue` makes the server say when the app starts reading the body: from then
    on the request is the gateway's, waiting for bytes that never come.
    """
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST {PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\nExpect: 100-continue\r\n\r\n".encode()
    )
    await writer.drain()
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b'{"inputs": ')
    await writer.drain()
    return reader, writer


async def _answer_of(reader: asyncio.StreamReader, timeout_s: float) -> tuple[int, dict]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
    status = int(head.split(b" ", 2)[1])
    fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if line)
    body = await asyncio.wait_for(reader.readexactly(int(fields[b"content-length"])), timeout_s)
    return status, json.loads(body)


async def test_a_stalled_upload_is_answered_503_draining_at_the_drain_timeout_and_the_gateway_exits_0(
    start_sim, start_gateway
):
    sim = start_sim(slots=1, base_ms=5)
    gateway = start_gateway(draining_config(sim, drain_timeout_ms=500))
    reader, writer = await _stalled_upload(gateway)
    try:
        signalled_at = time.monotonic()
        gateway.signal(signal.SIGTERM)
        status, body = await _answer_of(reader, 0.5 + EXIT_BOUND_S)
        answered_at = time.monotonic()
        assert (status, body["reason"]) == (503, "draining")
        assert answered_at - signalled_at >= 0.45
        assert await asyncio.wait_for(reader.read(), EXIT_BOUND_S) == b""  # and the connection closes
    finally:
        writer.close()
    assert await exit_code(gateway, 0.5 + EXIT_BOUND_S) == 0


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_second_signal_ends_a_long_drain_at_once_with_exit_0(start_sim, start_gateway, second):
    sim = start_sim(slots=1, base_ms=LONG_MS, on_disconnect="stop")
    gateway = start_gateway(draining_config(sim, drain_timeout_ms=60_000, expected_service_ms=LONG_MS))
    async with aiohttp.ClientSession() as http:
        in_flight = asyncio.ensure_future(infer(http, gateway))
        await eventually(lambda: sim.stats()["inflight"] == 1, what="the request to reach the backend")
        gateway.signal(signal.SIGTERM)
        await eventually(lambda: http_get(gateway.url + "/readyz")[0] == 503, what="the drain to start")
        signalled_at = time.monotonic()
        gateway.signal(second)
        status, reason, _ = await in_flight
        assert (status, reason) == (503, "draining")
    assert await exit_code(gateway, EXIT_BOUND_S) == 0
    assert time.monotonic() - signalled_at < EXIT_BOUND_S


async def test_a_request_that_ends_within_the_drain_timeout_is_served_and_the_exit_follows_it(
    start_sim, start_gateway
):
    sim = start_sim(slots=1, base_ms=600)
    gateway = start_gateway(draining_config(sim, drain_timeout_ms=20_000, expected_service_ms=600))
    async with aiohttp.ClientSession() as http:
        in_flight = asyncio.ensure_future(infer(http, gateway))
        await eventually(lambda: sim.stats()["inflight"] == 1, what="the request to reach the backend")
        gateway.signal(signal.SIGTERM)
        status, _, answered_at = await in_flight
    assert status == 200
    assert await exit_code(gateway, EXIT_BOUND_S) == 0
    assert time.monotonic() - answered_at < EXIT_BOUND_S  # the drain ended with it, not at its timeout


async def test_requests_queued_at_the_drain_are_served_and_leave_no_slot_behind(start_sim, start_gateway):
    sim = start_sim(slots=1, base_ms=300)
    gateway = start_gateway(draining_config(sim, drain_timeout_ms=4_000, expected_service_ms=300))
    async with aiohttp.ClientSession() as http:
        calls = [asyncio.ensure_future(infer(http, gateway)) for _ in range(4)]
        await eventually(lambda: gateway.assert_metric("gateway_queue_depth", 3, priority="low"))
        # A stalled upload keeps the drain open after the queue is served, so that the gateway's
        # own counters can be read before it exits.
        reader, writer = await _stalled_upload(gateway)
        try:
            gateway.signal(signal.SIGTERM)
            results = await asyncio.gather(*calls)
            assert [status for status, _, _ in results] == [200] * 4
            assert gateway.metric("gateway_inflight_requests", model="sim") == 0
            assert gateway.metric("gateway_queue_depth", priority="low") == 0
            assert sim.stats()["inflight"] == 0
            assert sim.stats()["peak_inflight"] == 1
            assert (await _answer_of(reader, 4 + EXIT_BOUND_S))[1]["reason"] == "draining"
        finally:
            writer.close()
    assert await exit_code(gateway, EXIT_BOUND_S) == 0


async def _answers_only_health_checks(
    server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """A backend that passes its health checks and never answers anything else."""
    while request := await server.read_request(reader):
        if not request.startswith(b"GET /v2/health/"):
            await reader.read()  # until the gateway closes the connection
            return
        writer.write(OK)
        await writer.drain()


async def test_a_metadata_request_to_a_hung_backend_is_cut_too_and_the_lifespan_shutdown_runs(
    start_gateway,
):
    async with ScriptedServer(_answers_only_health_checks) as backend:
        backend_url = f"http://127.0.0.1:{backend.origin.port}"
        config = gateway_config([(backend_url, 1)], shutdown={"drain_timeout_ms": 500})
        gateway = await asyncio.to_thread(start_gateway, config)  # this loop answers its health checks
        async with aiohttp.ClientSession() as http:
            # Model metadata takes no slot, but the drain counts it like the inference.
            metadata = asyncio.ensure_future(get_json(http, gateway.url + "/v2/models/sim"))
            inference = asyncio.ensure_future(infer(http, gateway))
            await eventually(
                lambda: {r.split(b" ", 2)[1] for r in backend.requests} >= {b"/v2/models/sim", PATH.encode()},
                what="both requests at the backend",
            )
            signalled_at = time.monotonic()
            gateway.signal(signal.SIGTERM)
            assert (await inference)[:2] == (503, "draining")
            assert await metadata == (503, "draining")
            assert await exit_code(gateway, EXIT_BOUND_S) == 0
            assert time.monotonic() - signalled_at < EXIT_BOUND_S
    # The lifespan's shutdown (the store's leave, the loops' stop) still ran.
    assert "Application shutdown complete." in gateway.log()


async def get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with http.get(url) as reply:
        return reply.status, (await reply.json(content_type=None))["reason"]


def _shared_tickets(url: str, prefix: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return sum(client.zcard(key) for key in client.scan_iter(f"{{{prefix}:sim}}:q:*"))
    finally:
        client.close()


@pytest.mark.redis
async def test_requests_cut_on_a_shared_store_are_answered_and_leave_no_ticket_behind(
    start_sim, start_gateway
):
    url = redis_url_or_skip()
    prefix = unique_prefix()
    sim = start_sim(slots=1, base_ms=LONG_MS, on_disconnect="stop")
    store = {"kind": "redis", "url": url, "key_prefix": prefix}
    gateway = start_gateway(draining_config(sim, drain_timeout_ms=500, store=store))
    async with aiohttp.ClientSession() as http:
        calls = [asyncio.ensure_future(infer(http, gateway)) for _ in range(3)]
        await eventually(lambda: gateway.assert_metric("gateway_queue_depth", 2, priority="low"))
        assert _shared_tickets(url, prefix) == 2
        gateway.signal(signal.SIGTERM)
        results = await asyncio.gather(*calls)
    assert [(status, reason) for status, reason, _ in results] == [(503, "draining")] * 3
    assert await exit_code(gateway, 0.5 + EXIT_BOUND_S) == 0
    assert _shared_tickets(url, prefix) == 0


@pytest.mark.redis
async def test_a_store_that_hangs_at_the_exit_does_not_hold_it(start_sim, start_gateway):
    server = RedisServer()  # of its own, to pause
    assert server.process is not None
    try:
        sim = start_sim(slots=1, base_ms=5)
        # Each Redis command may hang 30 s: only the bound on the lifespan's shutdown ends it sooner.
        store = {"kind": "redis", "url": server.url, "key_prefix": unique_prefix(), "timeout_ms": 30_000}
        gateway = start_gateway(draining_config(sim, drain_timeout_ms=500, store=store))
        server.process.send_signal(signal.SIGSTOP)
        signalled_at = time.monotonic()
        gateway.signal(signal.SIGTERM)
        assert await exit_code(gateway, EXIT_BOUND_S) == 0
        assert time.monotonic() - signalled_at < EXIT_BOUND_S
    finally:
        server.process.send_signal(signal.SIGCONT)
        server.stop()
