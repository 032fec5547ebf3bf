"""Two models at 2x from three gateway replicas, on a Redis Cluster of three masters against one
Redis (issue 38's bar: at least 0.9x of capacity in time on the cluster).

Each model has a sim of its own (SLOTS slots of SERVICE_MS requests); the models' names are chosen
so that their keys land on two different masters. Open-loop Poisson load at `--load` times each
sim's capacity per model goes to the replicas in turn; goodput is the requests served within
their deadline, as a share of each sim's capacity, after the first second.

    PYTHONPATH=. python -m loadtests.redis_cluster --load 2 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.openloop import INFER_BODY, run_fast
from tests.integration.servers import Gateway, Sim, gateway_config
from tests.redis_server import RedisClusterServers, RedisServer, unique_prefix

DEADLINE_MS = 1000


async def load(urls: list[str], models: list[str], rate: float, seconds: float) -> dict[str, list[float]]:
    """Per model, the scheduled times (from the start) of the requests served in time."""
    rng = random.Random(1)
    in_time: dict[str, list[float]] = {model: [] for model in models}
    headers = {"Content-Type": "application/json", "X-Request-Timeout-Ms": str(DEADLINE_MS)}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        started = time.monotonic()

        async def one(url: str, model: str, at: float) -> None:
            try:
                async with session.post(
                    f"{url}/v2/models/{model}/infer", data=INFER_BODY, headers=headers
                ) as r:
                    await r.read()
                    if r.status == 200 and time.monotonic() - started - at <= DEADLINE_MS / 1000:
                        in_time[model].append(at)
            except aiohttp.ClientError:
                pass

        sends, at, index = [], 0.0, 0
        while (at := at + rng.expovariate(rate * len(models))) < seconds:
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))
            model = models[index % len(models)]
            sends.append(asyncio.ensure_future(one(urls[index % len(urls)], model, at)))
            index += 1
        await asyncio.gather(*sends)
    return in_time


def run_store(args: argparse.Namespace, kind: str, log_dir: Path) -> dict[str, Any]:
    prefix = unique_prefix()
    if kind == "cluster":
        servers: Any = RedisClusterServers(3)
        names, masters = [], set()
        for index in range(64):
            master = servers.port_of(f"{{{prefix}:m{index}}}")
            if master not in masters:
                names.append(f"m{index}")
                masters.add(master)
            if len(names) == 2:
                break
        store = {"kind": "redis", "cluster": True, "url": servers.url}
    else:
        servers = RedisServer()
        names = ["m0", "m1"]
        store = {"kind": "redis", "url": servers.url}
    sims = {name: Sim(log_dir, slots=2 * args.slots, base_ms=args.service_ms) for name in names}
    config = gateway_config(
        [], priorities=[{"name": "low", "max_wait_ms": DEADLINE_MS}], default_priority="low"
    )
    config["store"] = {**store, "key_prefix": prefix, "replicas": args.replicas}
    config["models"] = [
        {
            "name": name,
            "expected_service_ms": args.service_ms,
            "backends": [{"url": sim.url, "max_concurrency": args.slots}],
        }
        for name, sim in sims.items()
    ]
    gateways = [Gateway(log_dir, config) for _ in range(args.replicas)]
    try:
        for gateway in gateways:
            gateway.wait_ready()
        capacity = args.slots / (args.service_ms / 1000)
        in_time = run_fast(load([g.url for g in gateways], names, args.load * capacity, args.duration))
        peaks = {name: int(sim.stats()["peak_inflight"]) for name, sim in sims.items()}
    finally:
        for process in (*gateways, *sims.values()):
            process.stop()
        servers.stop()
    window = args.duration - 1.0
    goodput = {
        name: round(sum(at >= 1.0 for at in times) / window / capacity, 3) for name, times in in_time.items()
    }
    return {"store": kind, "goodput_x_capacity": goodput, "peak_inflight": peaks, "slots": args.slots}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--service-ms", type=float, default=40.0)
    parser.add_argument("--load", type=float, default=2.0, help="offered load per model, times its capacity")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--stores", default="cluster,single")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        for kind in args.stores.split(","):
            print(json.dumps(run_store(args, kind, Path(log_dir))), flush=True)


if __name__ == "__main__":
    main()
