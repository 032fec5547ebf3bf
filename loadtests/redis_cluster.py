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
import json
import tempfile
from pathlib import Path
from typing import Any

from gateway.tools.loadtest import client
from gateway.tools.loadtest.requests import Prepared
from gateway.tools.loadtest.workload import Scenario, Traffic, arrivals
from loadtests.openloop import INFER_BODY, run_fast
from tests.integration.servers import Gateway, Sim, gateway_config
from tests.redis_server import RedisClusterServers, RedisServer, unique_prefix

DEADLINE_MS = 1000


async def load(urls: list[str], models: list[str], rate: float, seconds: float) -> dict[str, list[float]]:
    """Per model, the scheduled times (from the start) of the requests served in time: Poisson
    arrivals at `rate` per model, over the replicas in turn, by the kit's client."""
    scenario = Scenario(tuple(Traffic(model, deadline_ms=DEADLINE_MS) for model in models))
    schedule = arrivals(scenario, rate * len(models), seconds, seed=1)
    headers = {"Content-Type": "application/json", "X-Request-Timeout-Ms": str(DEADLINE_MS)}
    prepared = [
        Prepared(f"/v2/models/{model}/infer", INFER_BODY, headers, False, DEADLINE_MS / 1000)
        for model in models
    ]
    records, _ = await client.run(urls, schedule, prepared)
    in_time: dict[str, list[float]] = {model: [] for model in models}
    for record in records:
        if record.served and record.latency_s <= DEADLINE_MS / 1000:
            in_time[models[record.arrival.traffic]].append(record.arrival.at_s)
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
