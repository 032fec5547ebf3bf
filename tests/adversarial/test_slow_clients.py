"""Slow, silent and greedy clients cannot hold the gateway's connections (gateway.server.connections).

Real processes: the gateway under the CLI with short limits (a head within 0.5 s, a body within
0.5 s of its head), the simulator behind it serving each request for 1 s, longer than both. Slow
heads, half-sent bodies and silent sockets are cut within their timeout while probes and requests
keep answering; requests that queue or are served past the timeouts, kept-alive and pipelined ones
among them, are never cut; under a low open-file limit, a flood of idle sockets gives way to new
connections.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gateway.server.client_limits import connections_for
from gateway.settings import parse_settings
from tests.adversarial.slow_client_support import (
    INFER_BODY,
    INFER_PATH,
    closed_within,
    connect,
    drip,
    head_size,
    infer_request,
    open_file_limit,
    python_with_open_file_limit,
    read_answer,
)
from tests.eventually import eventually
from tests.integration.servers import Gateway, gateway_config

pytestmark = pytest.mark.anyio

HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 0.5
SERVICE_MS = 1000
# A timer's lateness on a busy 2-core machine, plus the client's own connect and reads.
SLACK_S = 2.0
LONG_WAITS = [{"name": "high", "max_wait_ms": 20_000}, {"name": "low", "max_wait_ms": 20_000}]
CLIENTS = 30


@pytest.fixture(scope="module")
def sim(module_launcher):
    return module_launcher.sim(slots=2, base_ms=SERVICE_MS)


@pytest.fixture(scope="module")
def gateway(module_launcher, sim):
    limits = {"header_timeout_ms": HEADER_TIMEOUT_S * 1000, "body_timeout_ms": BODY_TIMEOUT_S * 1000}
    config = gateway_config(
        [(sim.url, 2)], expected_service_ms=SERVICE_MS, priorities=LONG_WAITS, limits=limits
    )
    return module_launcher.gateway(config)


def closed_for(gateway: Gateway, reason: str) -> float:
    return gateway.metric("gateway_client_connections_closed_total", reason=reason)


async def probes_and_a_request(gateway: Gateway) -> list[int]:
    """Statuses of /readyz, /metrics and an inference request, asked while clients misbehave."""
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        statuses = []
        for path in ("/readyz", "/metrics", "/readyz", "/metrics"):
            async with http.get(gateway.url + path) as reply:
                statuses.append(reply.status)
        async with http.post(gateway.url + INFER_PATH, data=INFER_BODY) as reply:
            statuses.append(reply.status)
        return statuses


async def test_slow_heads_are_cut_within_the_header_timeout_while_probes_and_requests_answer(gateway):
    before = closed_for(gateway, "header_timeout")
    head = infer_request(("X-Padding", "p" * 200))  # at one byte per 50 ms, 12 s to send

    async def slow_client() -> float:
        reader, writer = await connect(gateway)
        try:
            return await drip(head, reader, writer, every_s=0.05)
        finally:
            writer.close()

    cut_after, statuses = await asyncio.gather(
        asyncio.gather(*(slow_client() for _ in range(CLIENTS))), probes_and_a_request(gateway)
    )
    assert statuses == [200] * 5
    assert all(HEADER_TIMEOUT_S * 0.8 <= s <= HEADER_TIMEOUT_S + SLACK_S for s in cut_after), cut_after
    assert closed_for(gateway, "header_timeout") - before == CLIENTS


async def test_a_slow_head_on_a_kept_alive_connection_is_cut_from_its_first_byte(gateway):
    reader, writer = await connect(gateway)
    try:
        writer.write(infer_request())
        assert (await read_answer(reader)).status == 200
        cut_after = await drip(infer_request(("X-Padding", "p" * 200)), reader, writer, every_s=0.05)
    finally:
        writer.close()
    assert HEADER_TIMEOUT_S * 0.8 <= cut_after <= HEADER_TIMEOUT_S + SLACK_S


async def test_silent_sockets_are_closed_within_the_header_timeout(gateway):
    before = closed_for(gateway, "header_timeout")
    sockets = [await connect(gateway) for _ in range(CLIENTS)]
    statuses = await probes_and_a_request(gateway)
    closed = await asyncio.gather(*(closed_within(r, HEADER_TIMEOUT_S + SLACK_S) for r, _ in sockets))
    for _, writer in sockets:
        writer.close()
    assert statuses == [200] * 5
    assert all(closed)
    assert closed_for(gateway, "header_timeout") - before == CLIENTS


async def test_half_sent_and_dripping_bodies_are_cut_within_the_body_timeout(gateway, sim):
    before = closed_for(gateway, "body_timeout")
    served = sim.stats()["completed"]
    request = infer_request()
    head, body = request[: request.index(b"\r\n\r\n") + 4], request[request.index(b"\r\n\r\n") + 4 :]

    async def half_sent() -> bool:
        reader, writer = await connect(gateway)
        writer.write(head + body[:10])
        try:
            return await closed_within(reader, BODY_TIMEOUT_S + SLACK_S)
        finally:
            writer.close()

    async def dripping() -> float:
        reader, writer = await connect(gateway)
        writer.write(head)
        try:
            return await drip(body, reader, writer, every_s=0.05)
        finally:
            writer.close()

    halves, drips, statuses = await asyncio.gather(
        asyncio.gather(*(half_sent() for _ in range(CLIENTS // 2))),
        asyncio.gather(*(dripping() for _ in range(CLIENTS // 2))),
        probes_and_a_request(gateway),
    )
    assert statuses == [200] * 5
    assert all(halves)
    assert all(BODY_TIMEOUT_S * 0.8 <= s <= BODY_TIMEOUT_S + SLACK_S for s in drips), drips
    assert closed_for(gateway, "body_timeout") - before == CLIENTS
    assert sim.stats()["completed"] - served == 1  # the probe's request, none of theirs


async def test_requests_queued_and_served_past_the_timeouts_are_answered_on_kept_alive_connections(gateway):
    cuts = [closed_for(gateway, reason) for reason in ("header_timeout", "body_timeout")]
    kept = await connect(gateway)
    kept[1].write(infer_request())
    assert (await read_answer(kept[0])).status == 200  # served for 1 s, twice each timeout
    # Three at once on two slots: one queues for a service time, then is served for another,
    # while the first connection stays idle between its requests.
    others = [await connect(gateway) for _ in range(3)]
    for _, writer in others:
        writer.write(infer_request())
    answers = await asyncio.gather(*(read_answer(reader) for reader, _ in others))
    assert [a.status for a in answers] == [200] * 3
    kept[1].write(infer_request())
    assert (await read_answer(kept[0])).status == 200
    for _, writer in [kept, *others]:
        writer.close()
    assert [closed_for(gateway, reason) for reason in ("header_timeout", "body_timeout")] == cuts


async def test_a_pipelined_head_is_not_timed_while_the_request_before_it_is_served(gateway):
    reader, writer = await connect(gateway)
    second = infer_request()
    writer.write(infer_request() + second[:20])
    assert (await read_answer(reader)).status == 200  # 1 s, while the second head waited half-sent
    writer.write(second[20:])
    assert (await read_answer(reader)).status == 200
    writer.close()


async def test_a_pipelined_body_is_not_timed_while_the_request_before_it_is_served(gateway):
    reader, writer = await connect(gateway)
    second = infer_request()
    head_end = second.index(b"\r\n\r\n") + 4
    writer.write(infer_request() + second[:head_end])
    assert (await read_answer(reader)).status == 200  # 1 s, while the second body waited unread
    writer.write(second[head_end:])
    assert (await read_answer(reader)).status == 200
    writer.close()


async def test_under_a_low_open_file_limit_idle_sockets_give_way_to_probes_and_requests(launcher, tmp_path):
    open_files = 256
    sim = launcher.sim(slots=4, base_ms=5)
    config = gateway_config([(sim.url, 4)], limits={"header_timeout_ms": 40_000})  # no timeout here
    gateway = Gateway(launcher.log_dir, config, python=python_with_open_file_limit(tmp_path, open_files))
    launcher.started.append(gateway)
    gateway.wait_ready()
    assert open_file_limit(gateway.process.pid) == open_files
    held = connections_for(open_files, parse_settings(config).backend_connections())
    assert gateway.metric("gateway_client_connections_max") == held

    silent = [await connect(gateway) for _ in range(open_files)]
    half_heads = [await connect(gateway) for _ in range(open_files // 2)]
    for _, writer in half_heads:
        writer.write(infer_request()[:30])
    try:
        assert await probes_and_a_request(gateway) == [200] * 5
        oldest = await asyncio.gather(*(closed_within(reader, SLACK_S) for reader, _ in silent[:50]))
        assert all(oldest)
        flood = len(silent) + len(half_heads)
        assert gateway.metric("gateway_client_connections_closed_total", reason="evicted") >= flood - held
        assert gateway.metric("gateway_client_connections") <= held
    finally:
        for _, writer in silent + half_heads:
            writer.close()


async def test_connections_with_requests_in_progress_are_never_evicted_and_a_newcomer_is_refused(
    start_sim, start_gateway
):
    slots = 16  # the least max_connections there is
    sim = start_sim(slots=slots, base_ms=3000)
    config = gateway_config(
        [(sim.url, slots)],
        expected_service_ms=3000,
        priorities=LONG_WAITS,
        limits={"max_connections": slots},
        admin_listen={"host": "127.0.0.1", "port": 0},
    )
    gateway = start_gateway(config)
    busy = [await connect(gateway) for _ in range(slots)]
    for _, writer in busy:
        writer.write(infer_request())
    await eventually(lambda: sim.stats()["inflight"] == slots, what="every connection's request served")
    newcomer, writer = await connect(gateway)
    assert await closed_within(newcomer, SLACK_S)
    writer.close()
    # The admin listener holds connections of its own: a kubelet's probe still answers.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        async with http.get(gateway.admin_url + "/readyz") as reply:
            assert reply.status == 200
    answers = await asyncio.gather(*(read_answer(reader) for reader, _ in busy))
    assert [a.status for a in answers] == [200] * slots  # none was closed for the newcomer
    for _, writer in busy:
        writer.close()
    assert gateway.metric("gateway_client_connections_closed_total", reason="refused") == 1


async def test_stalled_bodies_give_way_to_a_newcomer_at_the_connection_limit(start_sim, start_gateway):
    # Under a low open-file limit, heads that stall their bodies held every connection for the
    # whole body timeout (60 s): every newcomer, a probe's included, was closed at once.
    most = 16  # the least max_connections there is
    sim = start_sim(slots=2, base_ms=5)
    limits = {"max_connections": most, "body_idle_ms": 300}  # the body timeout stays at its 60 s
    gateway = start_gateway(gateway_config([(sim.url, 2)], limits=limits))
    stalled = [await connect(gateway) for _ in range(most)]
    request = infer_request()
    for _, writer in stalled:
        writer.write(request[: head_size(request) + 5])  # the head, and 5 bytes of its body
    served: list[int] = []

    async def newcomer_served() -> bool:
        reader, writer = await connect(gateway)
        try:
            writer.write(infer_request())
            served.append((await read_answer(reader)).status)
        except (ConnectionError, asyncio.IncompleteReadError):
            return False  # closed at once: every other connection still counts as busy
        finally:
            writer.close()
        return served[-1] == 200

    deadline = asyncio.get_running_loop().time() + SLACK_S + 1.0
    while not await newcomer_served():  # until the stalled bodies are evictable (polled, as eventually)
        assert asyncio.get_running_loop().time() < deadline, f"no newcomer served: {served}"
        await asyncio.sleep(0.05)
    assert gateway.metric("gateway_client_connections_closed_total", reason="evicted") >= 1
    assert await closed_within(stalled[0][0], SLACK_S), "the longest stalled body was closed for it"
    for _, writer in stalled:
        writer.close()
