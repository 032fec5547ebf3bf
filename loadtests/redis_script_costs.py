"""Redis's own time per script of the Redis store, as Redis counts it (INFO commandstats), with
`--held` leases in flight (docs/benchmarks/scale.md): what one master's core can serve of one model.

A RedisQueue on a private key prefix of the Redis at `--url` (a private one by default) takes
slots at its offers and frees them, then runs the upkeep's scripts; each batch between resets of
Redis's statistics.

    PYTHONPATH=. python -m loadtests.redis_script_costs --held 0,100,1000
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import redis as sync_redis
from redis.asyncio import Redis

from gateway.queues.base import Flow, Granted, Slot
from gateway.queues.redis.store import RedisQueue
from gateway.settings import Estimation
from gateway.upstream.backends import BackendState, ModelPool
from tests.redis_server import RedisServer, unique_prefix

FLOW = Flow("sim", 1, "tenant")
BATCH = 50


def evalsha_usec(admin: sync_redis.Redis) -> float:
    stats = admin.info("commandstats").get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    return float(stats["usec"]) / max(int(stats["calls"]), 1)


async def timed(admin: sync_redis.Redis, step: Callable[[], Awaitable[Any]]) -> float:
    admin.config_resetstat()
    for _ in range(BATCH):
        await step()
    return round(evalsha_usec(admin), 1)


async def costs(url: str, held: int) -> dict[str, Any]:
    admin = sync_redis.Redis.from_url(url)
    prefix = unique_prefix()
    backend = BackendState("sim", "http://127.0.0.1:9", held + BATCH + 1, "/", ready=True)
    pool = ModelPool("sim", [backend], expected_service_s=0.04, upstream_timeout_s=300)
    store = RedisQueue(
        Redis.from_url(url), Redis.from_url(url), [pool], 2, Estimation(), key_prefix=prefix,
        replica_id="costs", lease_ttl_s=5,
    )  # fmt: skip
    await store.start()
    state = store._models["sim"]
    slots: list[Slot] = []

    async def offer() -> None:
        granted = await store.offer(FLOW, 1.0, 5.0, 1e12, 0.0)
        assert isinstance(granted, Granted)
        slots.append(granted.slot)

    async def release() -> None:
        await store.release(slots.pop(), 0.0)
        await store.settle()

    try:
        for _ in range(held):
            await offer()
        row = {"held": held, "offer": await timed(admin, offer), "release": await timed(admin, release)}
        for name, step in (
            ("snapshot", lambda: store._refresh(state)),
            ("heartbeat", lambda: store._presence.beat(state)),
            ("reap", lambda: store._presence.reap(state)),
            ("peers", lambda: store._run("peers", state, {"replica": "costs"})),
        ):
            row[name] = await timed(admin, step)
    finally:
        store._presence.detached = True  # no leave: the keys go below
        await store.stop()
        keys = list(admin.scan_iter(f"{{{prefix}:*"))
        if keys:
            admin.delete(*keys)
        admin.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--held", default="0,100,1000", help="leases in flight, comma-separated")
    parser.add_argument("--url", help="a Redis to measure on (default: a private redis-server)")
    args = parser.parse_args()
    server = None if args.url else RedisServer()
    url = args.url or server.url  # type: ignore[union-attr]
    try:
        print("held\toffer\trelease\tsnapshot\theartbeat\treap\tpeers (Redis usec per call)")
        for held in (int(n) for n in args.held.split(",")):
            row = asyncio.run(costs(url, held))
            print(
                "\t".join(
                    str(row[k])
                    for k in ("held", "offer", "release", "snapshot", "heartbeat", "reap", "peers")
                )
            )
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
