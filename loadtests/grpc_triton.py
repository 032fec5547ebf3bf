"""gRPC through the gateway against Triton's own gRPC port, and against HTTP through the gateway,
in front of one real tritonserver (nvidia-pytriton's, on the CPU), at light load:

    python -m loadtests.grpc_triton [--rate 20] [--duration 20]

Targets, on the same arrivals in turn: `triton-grpc` (Triton's own gRPC port: the floor),
`gateway-grpc` and `gateway-http` (the gateway in front of the same Triton). Printed per target:
latency p50/p99 of the served, the p50 the gateway adds over Triton's own gRPC, and the gateway's
CPU per request.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.bench import cpu_seconds
from loadtests.grpc_load import run_grpc, small_request
from loadtests.openloop import TrafficClass, poisson_schedule, run, run_fast, summarize
from tests.integration.servers import Gateway, gateway_config
from tests.integration.triton import TritonServer

SLEEP_MS = 20
MIX = (TrafficClass("low", 1.0, 1000),)
BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
).encode()


def gateway_in_front(log_dir: Path, triton: TritonServer) -> Gateway:
    config = gateway_config([(triton.url, 1)], expected_service_ms=SLEEP_MS)
    backend = config["models"][0]["backends"][0]
    del backend["max_concurrency"]  # discovered from Triton's model config
    backend.update(kind="triton", metrics_url=triton.metrics_url)
    config["models"][0]["name"] = "sleep_ms"
    config["grpc_listen"] = {"host": "127.0.0.1", "port": 0}
    gateway = Gateway(log_dir, config)
    gateway.wait_ready()
    return gateway


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=20.0, help="arrivals per second")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="grpc-triton-"))
    triton = TritonServer(log_dir, sleep_ms=SLEEP_MS, max_batch_size=4)
    gateway = gateway_in_front(log_dir, triton)
    request = small_request("sleep_ms")
    request.inputs[0].shape[:] = [1, 4]
    request.raw_input_contents[0] = np.arange(1, 5, dtype="<f4").tobytes()
    schedule = poisson_schedule(args.rate, args.duration, MIX, seed=args.seed)
    warm = poisson_schedule(20, 1.0, MIX, seed=args.seed + 1)
    triton_grpc = f"127.0.0.1:{triton.grpc_port}"
    loads: dict[str, Any] = {
        "triton-grpc": lambda s: run_grpc([triton_grpc], s, request=request, send_class=False),
        "gateway-grpc": lambda s: run_grpc([gateway.grpc_target], s, request=request),
        "gateway-http": lambda s: run(gateway.url, s, path="/v2/models/sleep_ms/infer", body=BODY),
    }
    results: dict[str, dict[str, Any]] = {}
    try:
        for target, load in loads.items():
            run_fast(load(warm))
            before = cpu_seconds(gateway.process.pid)
            outcomes = run_fast(load(schedule))
            cpu_s = cpu_seconds(gateway.process.pid) - before
            low = summarize(outcomes, args.duration, min(5.0, args.duration / 4), 1.0)["low"]
            results[target] = {
                "sent": low.sent,
                "good": low.good,
                "p50_ms": low.p50_ms,
                "p99_ms": low.p99_ms,
                "gateway_cpu_ms_per_request": None
                if target == "triton-grpc"
                else cpu_s * 1000 / len(outcomes),
            }
    finally:
        gateway.stop()
        triton.stop()
    floor = results["triton-grpc"]["p50_ms"] or 0.0
    when = time.strftime("%Y-%m-%d %H:%M")
    print(f"{args.rate:g} rps for {args.duration:g} s, Triton sleep_ms {SLEEP_MS} ms ({when})")
    print("| target | served | p50 ms | p99 ms | p50 added over Triton's gRPC | gateway CPU ms/req |")
    print("|---|---|---|---|---|---|")
    for target, r in results.items():
        cpu = r["gateway_cpu_ms_per_request"]
        print(
            f"| {target} | {r['good']}/{r['sent']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
            f"| {r['p50_ms'] - floor:+.2f} | {'-' if cpu is None else f'{cpu:.2f}'} |"
        )
    out = Path(__file__).parent / "results" / f"grpc-triton-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"rate": args.rate, "duration_s": args.duration, "results": results}, indent=1))
    print(f"saved {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
