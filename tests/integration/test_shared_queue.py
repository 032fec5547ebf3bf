"""Several gateway replicas on one Redis: one queue, one slot count, leases, and Redis failing."""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import pytest
import redis

from tests.eventually import eventually
from tests.integration.servers import gateway_config, http_post
from tests.redis_server import RedisServer, unique_prefix

pytestmark = [pytest.mark.anyio, pytest.mark.redis]
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
PATH = "/v2/models/sim/infer"


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


def shared_config(sim, slots, redis_url, prefix, **store):
    classes = [{"name": "high", "max_wait_ms": 10_000}, {"name": "low", "max_wait_ms": 10_000}]
    return gateway_config(
        [(sim.url, slots)],
        priorities=classes,
        expected_service_ms=200,
        store={"kind": "redis", "url": redis_url, "key_prefix": prefix, "lease_ttl_ms": 1500, **store},
    )


async def infer(http, gateway, priority="low"):
    async with http.post(gateway.url + PATH, json=INFER, headers={"X-Priority": priority}) as reply:
        await reply.read()
        return reply.status, dict(reply.headers)


def outcome_counts(gateway) -> list[str]:
    return [line for line in gateway.metrics().splitlines() if line.startswith("gateway_requests_total{")]


def set_fault(sim, fault) -> None:
    assert http_post(sim.url + "/sim/fault", json.dumps(fault).encode())[0] == 200


def store_log(gateway) -> list[str]:
    """What a replica logged about its store: why it served from its fallback, or did not."""
    return [line for line in gateway.log().splitlines() if "gateway.store" in line or "Redis" in line]


def slots_in_use(redis_url, prefix) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return sum(int(v) for v in client.hvals(f"{{{prefix}:sim}}:slots"))
    finally:
        client.close()


async def test_replicas_share_one_slot_count_under_overload(start_sim, start_gateway, redis_server):
    sim = start_sim(slots=16, base_ms=50)
    prefix = unique_prefix()
    replicas = [start_gateway(shared_config(sim, 8, redis_server.url, prefix, replicas=3)) for _ in range(3)]
    sim.reset()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        results = await asyncio.gather(*(infer(http, replicas[i % 3]) for i in range(150)))
    assert [status for status, _ in results] == [200] * 150
    stats = sim.stats()
    assert stats["peak_inflight"] == 8  # the sim has 16 slots; the shared count allowed 8
    assert stats["completed"] == 150
    assert all(g.metric("gateway_store_up") == 1 for g in replicas)
    await eventually(lambda: slots_in_use(redis_server.url, prefix) == 0, what="slots to return")


async def test_each_replica_counts_the_scripts_it_runs_and_their_round_trips(
    start_sim, start_gateway, redis_server
):
    sim = start_sim(slots=2, base_ms=20)
    gateway = start_gateway(shared_config(sim, 2, redis_server.url, unique_prefix()))
    async with aiohttp.ClientSession() as http:
        for _ in range(10):  # one at a time: each granted at its offer, released after
            assert (await infer(http, gateway))[0] == 200
    runs = gateway.metric_by("gateway_redis_scripts_total", "script")
    assert runs["offer"] >= 10 and runs["heartbeat"] >= 1, runs
    await eventually(lambda: gateway.metric("gateway_redis_scripts_total", script="release") >= 10)
    took = gateway.metric("gateway_redis_script_seconds_total", script="offer")
    assert 0 < took / runs["offer"] < 1.0  # a round trip on 127.0.0.1, not nothing and not a timeout


async def test_priority_is_global_across_replicas(start_sim, start_gateway, redis_server):
    sim = start_sim(slots=1, base_ms=300)
    prefix = unique_prefix()
    a, b, c = (start_gateway(shared_config(sim, 1, redis_server.url, prefix)) for _ in range(3))
    finished: list[str] = []

    async def tracked(http, name, gateway, priority):
        status, _ = await infer(http, gateway, priority)
        assert status == 200
        finished.append(name)

    async with aiohttp.ClientSession() as http:
        set_fault(sim, {"hang": True})  # the first is held on the slot until all have queued
        tasks = [asyncio.ensure_future(tracked(http, "low-running@A", a, "low"))]
        await eventually(lambda: sim.stats()["faults"]["hanging"] == 1, what="the slot to be taken")
        for name, gateway in (("low@A", a), ("low@B", b)):
            tasks.append(asyncio.ensure_future(tracked(http, name, gateway, "low")))
            expected = len(tasks) - 1.0
            await eventually(
                lambda g=gateway, e=expected: g.metric("gateway_queue_depth", priority="low") == e
            )
        tasks.append(asyncio.ensure_future(tracked(http, "high@C", c, "high")))
        await eventually(lambda: c.metric("gateway_queue_depth", priority="high") == 1, what="high to queue")
        set_fault(sim, {})
        await asyncio.gather(*tasks)
    assert finished == ["low-running@A", "high@C", "low@A", "low@B"]


async def test_redis_outage_falls_back_to_local_queues_and_recovers(start_sim, start_gateway, redis_server):
    sim = start_sim(slots=16, base_ms=40)
    prefix = unique_prefix()
    replicas = [start_gateway(shared_config(sim, 8, redis_server.url, prefix, replicas=2)) for _ in range(2)]
    statuses: list[int] = []
    stop_at = time.monotonic() + 6.0

    async def client(http, gateway):
        while time.monotonic() < stop_at:
            statuses.append((await infer(http, gateway))[0])

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        # Each replica holds 4 of the 8 shared slots when Redis goes: requests that hang in the
        # backend until the outage began. (What a replica may serve from its fallback is what it
        # held then; under a free-running load that is luck, and may be nothing.)
        set_fault(sim, {"hang": True})
        held = []
        for gateway in replicas:
            held += [asyncio.ensure_future(infer(http, gateway)) for _ in range(4)]
            count = len(held)
            await eventually(lambda n=count: slots_in_use(redis_server.url, prefix) == n, what="slots held")
        load = [asyncio.ensure_future(client(http, replicas[i % 2])) for i in range(20)]
        await eventually(
            lambda: all(g.metric("gateway_queue_depth", priority="low") == 20 for g in replicas),
            what="the load to queue in Redis",
        )
        redis_server.stop()
        await eventually(lambda: all(g.metric("gateway_store_up") == 0 for g in replicas), what="fallback")
        set_fault(sim, {})
        sim.reset()
        await eventually(lambda: statuses.count(200) >= 100, what="requests served from local queues")
        assert all(g.metric("gateway_store_up") == 0 for g in replicas)  # still down meanwhile
        redis_server.start()
        await eventually(lambda: all(g.metric("gateway_store_up") == 1 for g in replicas), what="recovery")
        await asyncio.gather(*load)
        assert [status for status, _ in await asyncio.gather(*held)] == [200] * 8
    assert set(statuses) == {200}, [outcome_counts(g) + store_log(g) for g in replicas]
    # Each replica served from its fallback only on the slots it held when Redis went (its half of
    # the backend's), and freed none until it rejoined: the backend's 8 hold throughout.
    assert sim.stats()["peak_inflight"] <= 8
    await eventually(lambda: slots_in_use(redis_server.url, prefix) == 0, what="no stuck slots")
    held_4 = rf"serving from the fallback for [\d.]+ s on the leases held: {sim.url} 4\n"
    for gateway in replicas:
        assert re.search(held_4, gateway.log())
        assert "Redis is back" in gateway.log()


async def test_reject_mode_answers_503_while_redis_is_down(start_sim, start_gateway, redis_server):
    sim = start_sim(slots=2, base_ms=10)
    prefix = unique_prefix()
    gateway = start_gateway(shared_config(sim, 2, redis_server.url, prefix, on_store_failure="reject"))
    async with aiohttp.ClientSession() as http:
        assert (await infer(http, gateway))[0] == 200
        redis_server.stop()
        status, headers = await infer(http, gateway)
        if status == 200:  # the failure shows on the first command that meets it
            status, headers = await infer(http, gateway)
        assert status == 503 and int(headers["Retry-After"]) >= 1
        redis_server.start()
        await eventually(lambda: gateway.metric("gateway_store_up") == 1, what="recovery")
        assert (await infer(http, gateway))[0] == 200


async def test_gateway_starts_without_redis_and_joins_when_it_comes(start_sim, start_gateway, redis_server):
    sim = start_sim(slots=2, base_ms=10)
    prefix = unique_prefix()
    redis_server.stop()
    gateway = start_gateway(shared_config(sim, 2, redis_server.url, prefix))
    assert gateway.metric("gateway_store_up") == 0
    async with aiohttp.ClientSession() as http:
        # It holds no lease, so nothing to serve on from its fallback: another replica (an old one
        # of a rollout) may be using every slot.
        assert (await infer(http, gateway))[0] == 503
        redis_server.start()
        await eventually(lambda: gateway.metric("gateway_store_up") == 1, what="joining")
        assert (await infer(http, gateway))[0] == 200
    await eventually(lambda: slots_in_use(redis_server.url, prefix) == 0, what="the slot to return")
