"""Kill -9 one of several gateway replicas under load, with and without beacons (issue 38).

Replicas share one sim (SLOTS slots of SERVICE_MS requests) through one Redis; open-loop Poisson
load at `--load` times the sim's capacity goes to them in turn, as a round-robin balancer sends
it; at `--kill-at` one replica is killed -9, and from then on the balancer sends to the others
only (it noticed at once: the gateway is what is measured). Goodput is the requests served
within their deadline, per second and over the windows before the kill and from a few seconds
after it; the sim's own peak in flight is the judge of the cap.

    PYTHONPATH=. python -m loadtests.replica_kill --replicas 3 --load 1.5 --duration 25
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.tools.loadtest import client
from gateway.tools.loadtest.requests import Prepared
from gateway.tools.loadtest.workload import Scenario, Traffic, arrivals
from loadtests.openloop import INFER_BODY, INFER_PATH, run_fast
from tests.integration.servers import Gateway, Sim, gateway_config
from tests.redis_server import RedisServer

DEADLINE_MS = 1000


@dataclass(frozen=True, slots=True)
class Answer:
    sent_at_s: float
    """Scheduled, from the start."""
    status: int | None
    latency_s: float

    @property
    def in_time(self) -> bool:
        return self.status == 200 and self.latency_s <= DEADLINE_MS / 1000


async def load(
    urls: list[str], rate: float, duration_s: float, kill_at_s: float, kill: Any, seed: int = 1
) -> list[Answer]:
    """Poisson arrivals over the replicas in turn, by the kit's client (gateway/tools/loadtest/); at
    `kill_at_s` the first replica is killed and the balancer sends to the others from then on."""
    live = list(urls)
    schedule = arrivals(Scenario((Traffic("load", deadline_ms=DEADLINE_MS),)), rate, duration_s, seed)
    headers = {"Content-Type": "application/json", "X-Request-Timeout-Ms": str(DEADLINE_MS)}
    prepared = [Prepared(INFER_PATH, INFER_BODY, headers, False, DEADLINE_MS / 1000)]

    async def kill_then_forget() -> None:
        await asyncio.sleep(kill_at_s)
        kill()
        live.pop(0)

    killing = asyncio.ensure_future(kill_then_forget())
    records, _ = await client.run(lambda index, _: live[index % len(live)], schedule, prepared)
    await killing
    return [Answer(r.arrival.at_s, r.final.status, r.latency_s) for r in records]


def run_variant(args: argparse.Namespace, beacon: bool, log_dir: Path) -> dict[str, Any]:
    sim = Sim(log_dir, slots=2 * args.slots, base_ms=args.service_ms, on_disconnect=args.on_disconnect)
    redis = RedisServer()
    config = gateway_config([(sim.url, args.slots)], expected_service_ms=args.service_ms)
    config["priorities"] = [{"name": "low", "max_wait_ms": DEADLINE_MS}]
    config["store"] = {
        "kind": "redis",
        "url": redis.url,
        "replicas": args.replicas,
        "lease_ttl_ms": args.lease_ttl_ms,
        "peer_port": 0 if beacon else None,
    }
    config["models"][0]["backends"][0]["on_abandon"] = "abort" if args.on_disconnect == "stop" else "drain"
    gateways = [Gateway(log_dir, config) for _ in range(args.replicas)]
    try:
        for gateway in gateways:
            gateway.wait_ready()
        sim.reset()
        capacity = args.slots / (args.service_ms / 1000)
        answers = run_fast(
            load(
                [g.url for g in gateways],
                args.load * capacity,
                args.duration,
                args.kill_at,
                lambda: gateways[0].signal(signal.SIGKILL),
            )
        )
        peak = int(sim.stats()["peak_inflight"])
    finally:
        for process in (*gateways, sim, redis):
            process.stop()
    recovered_from = args.kill_at + args.lease_ttl_ms / 1000 + args.settle
    windows = {"before": (1.0, args.kill_at), "after": (recovered_from, args.duration)}
    summary: dict[str, Any] = {"beacon": beacon, "capacity_rps": capacity, "peak_inflight": peak}
    for name, (lo, hi) in windows.items():
        served = sum(a.in_time for a in answers if lo <= a.sent_at_s < hi)
        summary[f"goodput_{name}"] = round(served / (hi - lo) / capacity, 3)
    seconds = int(args.duration)
    in_second = [sum(a.in_time for a in answers if s <= a.sent_at_s < s + 1) for s in range(seconds)]
    summary["per_second"] = [round(served / capacity, 2) for served in in_second]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--service-ms", type=float, default=40.0)
    parser.add_argument("--load", type=float, default=1.5, help="offered load, times the sim's capacity")
    parser.add_argument("--duration", type=float, default=25.0)
    parser.add_argument("--kill-at", type=float, default=6.0)
    parser.add_argument("--lease-ttl-ms", type=float, default=5000.0, help="store.lease_ttl_ms (default 5 s)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after the lapse the window starts")
    parser.add_argument("--on-disconnect", choices=("finish", "stop"), default="finish")
    parser.add_argument("--variants", default="beacon,none")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        for variant in args.variants.split(","):
            print(json.dumps(run_variant(args, variant == "beacon", Path(log_dir))), flush=True)


if __name__ == "__main__":
    main()
