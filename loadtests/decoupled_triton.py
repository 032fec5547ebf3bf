"""A decoupled model's stream through the gateway against Triton's own gRPC port, at light load, in
front of one real tritonserver (nvidia-pytriton's, on the CPU):

    python -m loadtests.decoupled_triton [--rate 20] [--duration 20]

The model is the tests' `count_up`: three responses to each request, `--sleep-ms` apart, then the
final flag alone. Each target gets the same Poisson arrivals on one `ModelStreamInfer` stream:
`triton` (Triton's own port: the floor), `gateway` (the gateway in front of the same Triton, the
model `decoupled: true`, each request sent up on a call of its own). Printed per target: the time
to the first and to the last response (p50 and p99), what the gateway adds at the p50, and the
gateway's CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from loadtests.bench import cpu_seconds
from tests.eventually import eventually_blocking
from tests.integration.servers import Gateway, gateway_config
from tests.integration.triton import COUNT_UP_INSTANCES, COUNT_UP_RESPONSES, TritonServer


def gateway_in_front(log_dir: Path, triton: TritonServer, sleep_ms: float) -> Gateway:
    config = gateway_config(
        [(triton.url, COUNT_UP_INSTANCES)], expected_service_ms=COUNT_UP_RESPONSES * sleep_ms
    )
    config["models"][0].update(name="count_up", decoupled=True)
    config["models"][0]["backends"][0].update(kind="triton", grpc_port=triton.grpc_port)
    config["grpc_listen"] = {"host": "127.0.0.1", "port": 0}
    gateway = Gateway(log_dir, config)
    gateway.wait_ready()
    eventually_blocking(lambda: "grpc listening on" in gateway.log(), what="the gRPC listener")
    return gateway


async def stream(target: str, arrivals: list[float]) -> list[tuple[float, float]]:
    """Each request's (first, last) response times from its sending, in seconds."""
    request = service_pb2.ModelInferRequest(model_name="count_up")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
    request.raw_input_contents.append(np.arange(4, dtype="<f4").tobytes())
    sent: dict[str, float] = {}
    seen: dict[str, list[float]] = {}
    async with grpc.aio.insecure_channel(target) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=len(arrivals) + 60)

        async def read() -> None:
            while (response := await call.read()) is not grpc.aio.EOF:
                assert not response.error_message, response.error_message
                seen.setdefault(response.infer_response.id, []).append(time.monotonic())

        reading = asyncio.ensure_future(read())
        started = time.monotonic()
        for i, at in enumerate(arrivals):
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))
            request.id = str(i)
            sent[request.id] = time.monotonic()
            await call.write(request)
        await call.done_writing()
        await reading
    return [(times[0] - sent[i], times[-1] - sent[i]) for i, times in seen.items()]


def quantiles_ms(values: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(values, n=100)
    return round(1000 * cuts[49], 2), round(1000 * cuts[98], 2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--sleep-ms", type=float, default=10.0, help="count_up's time per response")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng, at, arrivals = random.Random(args.seed), 0.0, []
    while (at := at + rng.expovariate(args.rate)) < args.duration:
        arrivals.append(at)
    log_dir = Path(tempfile.mkdtemp(prefix="decoupled-triton-"))
    triton = TritonServer(log_dir, sleep_ms=args.sleep_ms)
    gateway = None
    results: dict[str, dict[str, Any]] = {}
    try:
        gateway = gateway_in_front(log_dir, triton, args.sleep_ms)
        for target, address in (
            ("triton", f"127.0.0.1:{triton.grpc_port}"),
            ("gateway", gateway.grpc_target),
        ):
            asyncio.run(stream(address, [0.05 * i for i in range(10)]))  # warm the channels
            before = cpu_seconds(gateway.process.pid)
            times = asyncio.run(stream(address, arrivals))
            cpu_s = cpu_seconds(gateway.process.pid) - before
            first, last = quantiles_ms([t[0] for t in times]), quantiles_ms([t[1] for t in times])
            results[target] = {"requests": len(times), "first_p50_p99_ms": first, "last_p50_p99_ms": last}
            if target == "gateway":
                results[target]["cpu_ms_per_request"] = round(1000 * cpu_s / len(times), 2)
    finally:
        if gateway is not None:
            gateway.stop()
        triton.stop()
    floor, ours = results["triton"], results["gateway"]
    ours["first_p50_added_ms"] = round(ours["first_p50_p99_ms"][0] - floor["first_p50_p99_ms"][0], 2)
    ours["last_p50_added_ms"] = round(ours["last_p50_p99_ms"][0] - floor["last_p50_p99_ms"][0], 2)
    out = Path(f"decoupled-triton-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(json.dumps(results, indent=1))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
