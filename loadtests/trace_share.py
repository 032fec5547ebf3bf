"""Tracing's share of the gateway's CPU at 10% sampling (issue 40's 3%), under 3x overload unless
told, read from a sampling profile of the traced gateway rather than as the difference of two
runs' CPU, which varies by more than 3% from run to run on this machine.

    PYTHONPATH=. python -m loadtests.trace_share [--load 3] [--duration 30] [--rate 200]

The bench's traced target (8 slots x 40 ms, 200 rps a unit of load, the bench's class mix) is
profiled by py-spy (in the `load` extra) for the run, sampling the thread that holds the GIL (the
only one running Python; stacks read without pausing the process come torn, and a thread waiting on
a condition reads as busy). A sample is tracing's when its stack passes through OpenTelemetry (the
SDK, the batch processor's thread, its OTLP encoding and export) or gateway/telemetry/tracing.py.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtests.bench import CAPACITY_RPS, Cores, start_target
from loadtests.openloop import poisson_schedule, run, run_fast
from tests.integration.servers import Sim

TRACING_FRAMES = ("/opentelemetry/", "gateway/telemetry/tracing.py")


def tracing_share(raw_profile: str) -> tuple[int, int]:
    """Of py-spy's raw (collapsed) samples: how many are tracing's, and how many in all."""
    tracing = total = 0
    for line in raw_profile.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        total += int(count)
        if any(frame in stack for frame in TRACING_FRAMES):
            tracing += int(count)
    return tracing, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples a second")
    parser.add_argument("--load", type=float, default=3.0, help="the offered load, x capacity")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        sys.exit("py-spy is not installed (pip install -e '.[load]')")
    log_dir = Path(tempfile.mkdtemp(prefix="trace-share-"))
    cores = Cores.layout(["traced"], share=False)
    sim = Sim(log_dir, slots=8, base_ms=40)
    _, servers = start_target("traced", log_dir, sim)
    gateway = servers[0]
    url = gateway.url
    try:
        if cores is not None:
            cores.pin_under_test(gateway.process.pid)
        run_fast(run([url], poisson_schedule(50, 0.5, seed=2)))  # warm the connections
        profile = log_dir / "profile.txt"
        command = ["record", "--format", "raw", "--full-filenames", "--gil", "--rate", str(args.rate)]
        command += ["--duration", str(int(args.duration)), "--pid", str(gateway.process.pid)]
        spy = subprocess.Popen(
            [py_spy, *command, "--output", str(profile)],
            stdout=subprocess.DEVNULL,
        )
        outcomes = run_fast(run([url], poisson_schedule(args.load * CAPACITY_RPS, args.duration, seed=1)))
        spy.wait(timeout=30)  # it stops after --duration
    finally:
        for server in servers:
            server.stop()
        sim.stop()
    tracing, total = tracing_share(profile.read_text())
    print(f"profile: {profile}")
    print(f"{len(outcomes)} requests; {total} samples of the gateway's threads, {tracing} in tracing:")
    print(f"tracing's share of the gateway's CPU: {100 * tracing / max(total, 1):.1f}%")


if __name__ == "__main__":
    main()
