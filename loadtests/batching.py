"""Gateway-side micro-batching (issue 15) against HAProxy, which cannot batch, and the gateway without it.

    python -m loadtests.batching                  # 0.3x and 4x unbatched capacity, every target
    python -m loadtests.batching --quick          # a smoke run, under a minute

The simulated backend has 2 slots and serves a batch in 20 ms + 1 ms per item: about 95 requests a
second one by one, while a batch of 16 takes 36 ms. Every request is one item with a 250 ms deadline
(sent as X-Request-Timeout-Ms); the open-loop Poisson arrivals (seeded) are the same for every
target, each in front of a fresh backend, at `--loads` x the unbatched capacity.

Targets:
- haproxy: maxconn 2, a queue timeout of the deadline less 1.5 unbatched service times;
- gateway: the gateway without batching (the same class limit);
- batching: the gateway with `batching: {max_batch_size: 16, max_delay_ms: --delay}`.

Per target it prints the goodput (answers within their deadline, per second of arrivals) and its
ratio to the offered rate, p50 and p99 latency of the answered, refusals, the backend's calls and
peak in-flight, and saves them as JSON under loadtests/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadtests.bench import HAProxy
from loadtests.matrix import chosen_targets, result_table, results_path, run_matrix
from loadtests.openloop import INFER_PATH, Arrival, TrafficClass, percentile, poisson_schedule, run, run_fast
from tests.integration.servers import Gateway, Sim, gateway_config

SLOTS = 2
BASE_MS, PER_ITEM_MS = 20.0, 1.0
DEADLINE_MS = 250
UNBATCHED_RPS = SLOTS / (BASE_MS + PER_ITEM_MS) * 1000
WAIT_LIMIT_MS = round(DEADLINE_MS - 1.5 * (BASE_MS + PER_ITEM_MS))
TARGETS = ("haproxy", "gateway", "batching")
BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1.0] * 4}]}
).encode()


def start_target(target: str, log_dir: Path, sim: Sim, python: str, delay_ms: float) -> tuple[str, list[Any]]:
    if target == "haproxy":
        proxy = HAProxy(log_dir, sim.url, slots=SLOTS, queue_timeout_ms=WAIT_LIMIT_MS)
        return proxy.url, [proxy]
    classes = [{"name": "standard", "max_wait_ms": WAIT_LIMIT_MS}]
    config = gateway_config([(sim.url, SLOTS)], priorities=classes, default_priority="standard")
    config["models"][0]["expected_service_ms"] = BASE_MS + PER_ITEM_MS
    if target == "batching":
        config["models"][0]["batching"] = {"max_batch_size": 16, "max_delay_ms": delay_ms}
    config["health"] = {"interval_ms": 1000}
    gateway = Gateway(log_dir, config, python=python)
    gateway.wait_ready()
    return gateway.url, [gateway]


def run_one(
    target: str, load: float, duration_s: float, seed: int, log_dir: Path, python: str, delay_ms: float
) -> dict[str, Any]:
    sim = Sim(log_dir, slots=SLOTS, base_ms=BASE_MS, per_item_ms=PER_ITEM_MS)
    servers: list[Any] = [sim]
    try:
        url, started = start_target(target, log_dir, sim, python, delay_ms)
        servers += started
        arrivals = poisson_schedule(
            load * UNBATCHED_RPS, duration_s, [TrafficClass("standard", 1.0, DEADLINE_MS)], seed
        )

        def request_for(arrival: Arrival) -> tuple[bytes, dict[str, str]]:
            return BODY, {"Content-Type": "application/json", "X-Request-Timeout-Ms": str(DEADLINE_MS)}

        outcomes = run_fast(run(url, arrivals, path=INFER_PATH, request_for=request_for))
        stats = sim.stats()
    finally:
        for server in reversed(servers):
            server.stop()
    good = [o for o in outcomes if o.status == 200 and o.latency_s * 1000 <= DEADLINE_MS]
    latencies = [o.latency_s * 1000 for o in outcomes if o.status == 200]
    offered = len(arrivals) / duration_s
    return {
        "target": target,
        "load": load,
        "offered_rps": round(offered, 1),
        "goodput_rps": round(len(good) / duration_s, 1),
        "goodput_of_offered": round(len(good) / max(1, len(arrivals)), 3),
        "p50_ms": _rounded(percentile(latencies, 0.5)),
        "p99_ms": _rounded(percentile(latencies, 0.99)),
        "refused": sum(o.status is not None and o.status != 200 for o in outcomes),
        "late": sum(o.status == 200 and o.latency_s * 1000 > DEADLINE_MS for o in outcomes),
        "unanswered": sum(o.status is None for o in outcomes),
        "backend_calls": stats["completed"],
        "peak_inflight": stats["peak_inflight"],
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


COLUMNS = (
    "target", "load", "offered", "goodput_rps", "goodput_of_offered", "p50_ms", "p99_ms", "refused",
    "late", "unanswered", "backend_calls", "peak_inflight",
)  # fmt: skip


def table(results: list[dict[str, Any]]) -> str:
    return result_table(results, COLUMNS, lambda r, c: r["offered_rps"] if c == "offered" else r[c])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", default=",".join(TARGETS), help=", ".join(TARGETS))
    parser.add_argument("--loads", default="0.3,4", help="x the unbatched capacity, comma-separated")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    parser.add_argument("--delay", type=float, default=5.0, help="batching.max_delay_ms")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="6 s per run: a smoke run")
    parser.add_argument(
        "--gateway-python", default=sys.executable, help="the interpreter that runs the gateway"
    )
    args = parser.parse_args()
    targets = chosen_targets(parser, args.targets, TARGETS)
    duration_s = 6.0 if args.quick else args.duration
    log_dir = Path(tempfile.mkdtemp(prefix="batching-"))
    out = results_path("batching")
    report: dict[str, Any] = {
        "machine": f"{os.cpu_count()} cores",
        "seed": args.seed,
        "duration_s": duration_s,
        "unbatched_capacity_rps": round(UNBATCHED_RPS, 1),
        "max_delay_ms": args.delay,
        "results": [],
    }
    loads = [float(x) for x in args.loads.split(",")]

    def one(target: str, load: float) -> dict[str, Any]:
        return run_one(target, load, duration_s, args.seed, log_dir, args.gateway_python, args.delay)

    run_matrix(report, out, loads, targets, one, table)
    print(f"saved {out} (server logs in {log_dir})")


if __name__ == "__main__":
    main()
