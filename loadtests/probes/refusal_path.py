"""What does the refusal path alone cost? A diagnostic, not a benchmark.

    python -m loadtests.probes.refusal_path

The same open-loop arrivals (600 requests/s for 20 s) go to two targets in turn:
- the gateway with nothing to serve: its one backend slot is held by a hung request (the sim's
  hang fault) and each class may wait 2 ms, so every request is refused 429 at arrival, through
  the whole refusal path (classification, admission, the return booking, the answer);
- HAProxy answering an instant 429 (loadtests.bench's floor).
It prints the refusal latency's percentiles for each (arrivals between second 5 and 18) and the
gateway's CPU per refusal: how much of the core benchmark's overload refusal latency is the
refusal path itself, with no served request beside it.
"""

from __future__ import annotations

import json
import tempfile
import threading
import urllib.request
from pathlib import Path

from loadtests.bench import HAProxy, cpu_seconds
from loadtests.openloop import INFER_BODY, INFER_PATH, Outcome, percentile, poisson_schedule, run, run_fast
from tests.eventually import eventually_blocking
from tests.integration.servers import Gateway, Sim, gateway_config, http_post

RATE_RPS, DURATION_S = 600, 20.0
QUANTILES = (0.5, 0.9, 0.95, 0.99, 0.999)


def refusal_latencies_ms(outcomes: list[Outcome]) -> list[float]:
    return [o.latency_s * 1000 for o in outcomes if o.status == 429 and 5 < o.arrival.at_s < DURATION_S - 2]


def line(name: str, latencies: list[float]) -> str:
    shown = " ".join(f"p{q * 100:g}={percentile(latencies, q) or 0:.2f}" for q in QUANTILES)
    return f"{name:8} refusals={len(latencies)} {shown} ms"


def hold_the_slot(gateway: Gateway) -> None:
    request = urllib.request.Request(gateway.url + INFER_PATH, data=INFER_BODY, method="POST")
    try:
        urllib.request.urlopen(request, timeout=DURATION_S + 30)
    except OSError:
        pass  # cut at the end


def main() -> None:
    log_dir = Path(tempfile.mkdtemp(prefix="refusal-path-"))
    schedule = poisson_schedule(RATE_RPS, DURATION_S, seed=7)
    sim = Sim(log_dir, slots=1, base_ms=40)
    try:
        config = gateway_config([(sim.url, 1)], expected_service_ms=40, health={"interval_ms": 1000})
        config["priorities"] = [{"name": "high", "max_wait_ms": 2}, {"name": "low", "max_wait_ms": 2}]
        gateway = Gateway(log_dir, config)
        gateway.wait_ready()
        assert http_post(sim.url + "/sim/fault", json.dumps({"hang": True}).encode())[0] == 200
        threading.Thread(target=hold_the_slot, args=(gateway,), daemon=True).start()
        eventually_blocking(lambda: gateway.metric("gateway_inflight_requests", model="sim") == 1)
        before = cpu_seconds(gateway.process.pid)
        outcomes = run_fast(run([gateway.url], schedule))
        cpu_ms = (cpu_seconds(gateway.process.pid) - before) * 1000 / len(outcomes)
        assert http_post(sim.url + "/sim/fault", b"{}")[0] == 200
        gateway.stop()
        print(line("gateway", refusal_latencies_ms(outcomes)), f"CPU {cpu_ms:.2f} ms per refusal", flush=True)
        floor = HAProxy(log_dir, sim.url, instant_429=True)
        try:
            print(line("floor", refusal_latencies_ms(run_fast(run([floor.url], schedule)))))
        finally:
            floor.stop()
    finally:
        sim.stop()


if __name__ == "__main__":
    main()
