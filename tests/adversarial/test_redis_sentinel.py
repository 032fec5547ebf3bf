"""Redis behind Sentinel (`store.sentinel`): a real master, its replica and a sentinel. The master
is killed -9 while two gateway replicas keep the sim's slots busy; the sentinel promotes the
replica, the gateways follow it within seconds and serve through it again, and the sim never runs
more than its slots: the promoted replica's state, written on another process, is dropped and
rebuilt from the work the gateways still run (lua/common.lua, forget_state)."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
import redis

from tests.eventually import eventually
from tests.integration.servers import Gateway, gateway_config
from tests.redis_server import RedisSentinel, RedisServer, unique_prefix

pytestmark = [pytest.mark.anyio, pytest.mark.redis]
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
PATH = "/v2/models/sim/infer"
MASTER = "queue"
SLOTS = 4
SERVICE_S = 0.1
FOLLOW_S = 15.0  # the sentinel's 1 s to call the master down, its failover, the gateways' rejoin


def master_port(sentinel: RedisSentinel) -> int:
    with redis.Redis(port=sentinel.port) as client:
        _, port = client.sentinel_get_master_addr_by_name(MASTER)
        return int(port)


def replica_in_sync(port: int) -> bool:
    with redis.Redis(port=port) as client:
        return client.info("replication").get("master_link_status") == "up"


def sentinel_knows_the_replica(sentinel: RedisSentinel) -> bool:
    with redis.Redis(port=sentinel.port) as client:
        return len(client.sentinel_slaves(MASTER)) == 1


async def test_after_a_sentinel_failover_every_replica_serves_again_and_the_cap_held(
    start_sim, start_gateway
):
    primary = RedisServer()
    standby = RedisServer("--replicaof", "127.0.0.1", str(primary.port))
    sentinel = RedisSentinel(MASTER, primary.port)
    try:
        await eventually(lambda: replica_in_sync(standby.port), what="the replica in sync")
        await eventually(lambda: sentinel_knows_the_replica(sentinel), what="the sentinel seeing the replica")
        prefix = unique_prefix()
        sim = start_sim(slots=2 * SLOTS, base_ms=SERVICE_S * 1000)
        config = gateway_config(
            [(sim.url, SLOTS)],
            priorities=[{"name": "low", "max_wait_ms": 3000}],
            default_priority="low",
            expected_service_ms=SERVICE_S * 1000,
            store={
                "kind": "redis",
                "sentinel": {"master": MASTER, "nodes": [sentinel.node]},
                "key_prefix": prefix,
                "replicas": 2,
                "lease_ttl_ms": 1000,
                "timeout_ms": 300,
            },
        )
        gateways: list[Gateway] = [start_gateway(config) for _ in range(2)]
        served: dict[int, int] = {port: 0 for port in (primary.port, standby.port)}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            stop = asyncio.Event()
            on_master = [primary.port]

            async def keep_busy(gateway: Gateway) -> None:
                while not stop.is_set():  # bounded: the test's end sets it
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.post(gateway.url + PATH, json=INFER) as reply:
                            await reply.read()
                            if reply.status == 200:
                                served[on_master[0]] += 1

            work = [asyncio.ensure_future(keep_busy(g)) for g in gateways for _ in range(SLOTS)]
            await eventually(lambda: served[primary.port] > 50, what="both serving through the master")
            sim.reset()  # the peak from here on
            primary.stop()  # kill -9
            await eventually(
                lambda: master_port(sentinel) == standby.port, timeout_s=FOLLOW_S, what="the replica promoted"
            )
            on_master[0] = standby.port
            tag = f"{{{prefix}:sim}}"

            def both_live_on_the_promoted_master() -> bool:
                with redis.Redis(port=standby.port) as client:
                    return client.zcard(f"{tag}:replicas") == 2

            await eventually(both_live_on_the_promoted_master, timeout_s=FOLLOW_S, what="both rejoined")
            for gateway in gateways:
                await eventually(lambda g=gateway: g.assert_metric("gateway_store_up", 1), timeout_s=FOLLOW_S)
            before = served[standby.port]
            await eventually(lambda: served[standby.port] > before + 50, what="served through the new master")
            stop.set()
            await asyncio.gather(*work)
        assert sim.stats()["peak_inflight"] <= SLOTS
        with redis.Redis(port=standby.port) as client:
            assert client.get(f"{tag}:server") == client.info("server")["run_id"].encode()
    finally:
        for process in (sentinel, standby, primary):
            process.stop()
