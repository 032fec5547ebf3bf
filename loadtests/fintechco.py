"""The seed's FinTechCo mix (issue 14): interactive requests beside batch jobs on one GPU pool.

    python -m loadtests.fintechco                    # every target, at 0.9x and 1.3x capacity
    python -m loadtests.fintechco --reserved 3       # the gateway keeping 3 of the 8 slots instead
    python -m loadtests.fintechco --quick            # a smoke run, under a minute

One pool of 8 slots, the simulated backend at 20 ms a request plus 30 ms per batch item. 80% of the
requests are interactive (1 item: 50 ms, deadline 1 s) from the `retail` tenant; 20% are batch jobs
(16 items: 500 ms, deadline 10 s), 3/4 of them from `risk` and 1/4 from `reporting`. Batch jobs hold
71% of the pool's busy time. The open-loop Poisson arrivals (seeded) are the same for every target,
each in front of a fresh backend, at `--loads` x capacity (8 slots / 140 ms mean service = 57 rps).

Targets:
- haproxy: maxconn 8, interactive first (`set-priority-class`), one `timeout queue` for both
  classes (HAProxy has one per backend): the batch class's limit.
- fifo: the gateway with a single class and no tenants, first come first served; each request's
  deadline still sent as X-Request-Timeout-Ms, so admission still refuses what it cannot serve.
  Both gateway targets price requests by batch items (`cost: batch_items`).
- gateway: the gateway with the two classes, `--reserved` (2) of the 8 slots reserved for
  interactive work, and the batch tenants sharing their class 1:1 (weighted fair queuing).

A class's queue-wait limit is its deadline less 1.5 of its service times. Per target it prints the
interactive queue wait (latency less the class's service time) at p50 and p99, the interactive and
batch goodput (answers within their deadline, per second of arrivals) and the batch tenants', the
batch goodput of the steady window (arrivals from 5 s until a batch deadline before the last one),
and saves them as JSON under loadtests/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests.bench import HAProxy
from loadtests.matrix import chosen_targets, results_path, run_matrix
from loadtests.openloop import (
    INFER_PATH,
    Arrival,
    Outcome,
    TrafficClass,
    percentile,
    poisson_schedule,
    run,
    run_fast,
)
from tests.integration.servers import Gateway, Sim, gateway_config

SLOTS = 8
BASE_MS, PER_ITEM_MS = 20.0, 30.0
WAIT_LIMIT_SERVICES = 1.5
TARGETS = ("haproxy", "fifo", "gateway")
STEADY_FROM_S = 5.0


@dataclass(frozen=True, slots=True)
class JobClass:
    name: str
    share: float
    items: int
    deadline_ms: int
    tenants: tuple[tuple[str, float], ...]
    """(tenant, share of the class's requests)."""

    @property
    def service_ms(self) -> float:
        return BASE_MS + PER_ITEM_MS * self.items

    @property
    def wait_limit_ms(self) -> int:
        return round(self.deadline_ms - WAIT_LIMIT_SERVICES * self.service_ms)

    def body(self) -> bytes:
        data = [1.0] * (self.items * 4)
        tensor = {"name": "INPUT0", "shape": [self.items, 4], "datatype": "FP32", "data": data}
        return json.dumps({"inputs": [tensor]}).encode()


INTERACTIVE = JobClass("interactive", 0.8, 1, 1000, (("retail", 1.0),))
BATCH = JobClass("batch", 0.2, 16, 10_000, (("risk", 0.75), ("reporting", 0.25)))
CLASSES = (INTERACTIVE, BATCH)
MEAN_SERVICE_MS = sum(c.share * c.service_ms for c in CLASSES)
CAPACITY_RPS = SLOTS / MEAN_SERVICE_MS * 1000


def schedule(load: float, duration_s: float, seed: int) -> list[tuple[Arrival, str]]:
    """The arrivals at `load` x capacity, each with its tenant (drawn from the same seed)."""
    mix = [TrafficClass(c.name, c.share, c.deadline_ms) for c in CLASSES]
    arrivals = poisson_schedule(load * CAPACITY_RPS, duration_s, mix, seed)
    by_name = {c.name: c for c in CLASSES}
    picked: list[tuple[Arrival, str]] = []
    for index, arrival in enumerate(arrivals):
        tenants = by_name[arrival.priority].tenants
        # A fixed low-discrepancy pick, so every target sees the same tenant per request.
        u, cumulative = (index * 0.6180339887) % 1.0, 0.0
        chosen = tenants[-1][0]
        for tenant, share in tenants:
            cumulative += share
            if u < cumulative:
                chosen = tenant
                break
        picked.append((arrival, chosen))
    return picked


def start_target(target: str, log_dir: Path, sim: Sim, python: str, reserved: int) -> tuple[str, list[Any]]:
    if target == "haproxy":
        proxy = HAProxy(
            log_dir, sim.url, slots=SLOTS, queue_timeout_ms=BATCH.wait_limit_ms, urgent_class=INTERACTIVE.name
        )
        return proxy.url, [proxy]
    if target == "fifo":
        classes = [{"name": "standard", "max_wait_ms": BATCH.wait_limit_ms}]
        config = gateway_config([(sim.url, SLOTS)], priorities=classes, default_priority="standard")
    else:
        classes = [
            {
                "name": INTERACTIVE.name,
                "max_wait_ms": INTERACTIVE.wait_limit_ms,
                "reserved_slots": reserved,
            },
            {"name": BATCH.name, "max_wait_ms": BATCH.wait_limit_ms},
        ]
        tenants = [{"name": name} for c in CLASSES for name, _ in c.tenants]
        config = gateway_config(
            [(sim.url, SLOTS)], priorities=classes, default_priority=BATCH.name, tenants=tenants
        )
    config["models"][0]["expected_service_ms"] = MEAN_SERVICE_MS
    config["models"][0]["cost"] = "batch_items"  # a batch job is 16 items of work, not 1
    config["health"] = {"interval_ms": 1000}
    gateway = Gateway(log_dir, config, python=python)
    gateway.wait_ready()
    return gateway.url, [gateway]


def run_one(
    target: str, load: float, duration_s: float, seed: int, log_dir: Path, python: str, reserved: int
) -> dict[str, Any]:
    sim = Sim(log_dir, slots=SLOTS, base_ms=BASE_MS, per_item_ms=PER_ITEM_MS)
    servers: list[Any] = [sim]
    try:
        url, started = start_target(target, log_dir, sim, python, reserved)
        servers += started
        jobs = schedule(load, duration_s, seed)
        tenant_of = {id(arrival): tenant for arrival, tenant in jobs}
        bodies = {c.name: c.body() for c in CLASSES}

        def request_for(arrival: Arrival) -> tuple[bytes, dict[str, str]]:
            headers = {"Content-Type": "application/json", "X-Request-Timeout-Ms": str(arrival.deadline_ms)}
            if target != "fifo":
                headers["X-Priority"] = arrival.priority
            if target == "gateway":
                headers["X-Tenant"] = tenant_of[id(arrival)]
            return bodies[arrival.priority], headers

        outcomes = run_fast(run(url, [a for a, _ in jobs], path=INFER_PATH, request_for=request_for))
        peak = sim.stats()["peak_inflight"]
    finally:
        for server in reversed(servers):
            server.stop()
    return summarize(target, load, duration_s, outcomes, {id(a): t for a, t in jobs}, peak)


def summarize(
    target: str,
    load: float,
    duration_s: float,
    outcomes: Sequence[Outcome],
    tenant_of: dict[int, str],
    peak_inflight: int,
) -> dict[str, Any]:
    service_ms = {c.name: c.service_ms for c in CLASSES}

    def good(o: Outcome) -> bool:
        return o.status == 200 and o.latency_s * 1000 <= o.arrival.deadline_ms

    # The steady window leaves out the first seconds and the arrivals whose deadline reaches past
    # the last one: work queued at the end is served in the idle time after it (as HAProxy, with
    # the longer queue, does more of), which a steady overload does not have.
    steady_from, steady_to = min(STEADY_FROM_S, duration_s / 4), duration_s - BATCH.deadline_ms / 1000
    steady_s = max(steady_to - steady_from, 1e-9)

    def steady(o: Outcome) -> bool:
        return good(o) and steady_from <= o.arrival.at_s < steady_to

    result: dict[str, Any] = {"target": target, "load": load, "peak_inflight": peak_inflight}
    for c in CLASSES:
        mine = [o for o in outcomes if o.arrival.priority == c.name]
        waits = [o.latency_s * 1000 - service_ms[c.name] for o in mine if o.status == 200]
        result[c.name] = {
            "sent": len(mine),
            "goodput_rps": round(sum(map(good, mine)) / duration_s, 2),
            "steady_goodput_rps": round(sum(map(steady, mine)) / steady_s, 2)
            if steady_to > steady_from
            else None,
            "wait_p50_ms": _rounded(percentile(waits, 0.5)),
            "wait_p99_ms": _rounded(percentile(waits, 0.99)),
            "refused": sum(o.status is not None and o.status != 200 for o in mine),
            "late": sum(o.status == 200 and not good(o) for o in mine),
            "unanswered": sum(o.status is None for o in mine),
        }
    for tenant, _ in BATCH.tenants:
        mine = [o for o in outcomes if tenant_of.get(id(o.arrival)) == tenant]
        result[BATCH.name][f"{tenant}_goodput_rps"] = round(sum(map(good, mine)) / duration_s, 2)
    return result


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(max(0.0, value), 1)


def table(results: Sequence[dict[str, Any]]) -> str:
    columns = (
        "target", "load", "int p50 ms", "int p99 ms", "int good/s", "int late+refused",
        "batch good/s", "steady", "risk", "reporting", "batch refused", "peak",
    )  # fmt: skip
    rows = [columns]
    for r in results:
        if "error" in r:
            rows.append((r["target"], str(r.get("load")), r["error"][:60], *[""] * (len(columns) - 3)))
            continue
        i, b = r[INTERACTIVE.name], r[BATCH.name]
        cells = (
            r["target"], f"{r['load']:.2f}", i["wait_p50_ms"], i["wait_p99_ms"], i["goodput_rps"],
            i["late"] + i["refused"] + i["unanswered"], b["goodput_rps"], b["steady_goodput_rps"],
            b["risk_goodput_rps"], b["reporting_goodput_rps"], b["refused"], r["peak_inflight"],
        )  # fmt: skip
        rows.append(tuple(str(cell) for cell in cells))
    widths = [max(len(row[k]) for row in rows) for k in range(len(columns))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", default=",".join(TARGETS), help=", ".join(TARGETS))
    parser.add_argument("--loads", default="0.9,1.3", help="x capacity, comma-separated")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument(
        "--reserved", type=int, default=2, help="slots the gateway keeps for interactive work"
    )
    parser.add_argument("--quick", action="store_true", help="8 s per run: a smoke run")
    parser.add_argument(
        "--gateway-python", default=sys.executable, help="the interpreter that runs the gateway"
    )
    args = parser.parse_args()
    targets = chosen_targets(parser, args.targets, TARGETS)
    duration_s = 8.0 if args.quick else args.duration
    log_dir = Path(tempfile.mkdtemp(prefix="fintechco-"))
    out = results_path("fintechco")
    report: dict[str, Any] = {
        "machine": f"{os.cpu_count()} cores",
        "seed": args.seed,
        "duration_s": duration_s,
        "capacity_rps": round(CAPACITY_RPS, 1),
        "reserved": args.reserved,
        "results": [],
    }
    loads = [float(x) for x in args.loads.split(",")]

    def one(target: str, load: float) -> dict[str, Any]:
        return run_one(target, load, duration_s, args.seed, log_dir, args.gateway_python, args.reserved)

    run_matrix(report, out, loads, targets, one, table)
    print(f"saved {out} (server logs in {log_dir})")


if __name__ == "__main__":
    main()
