"""What a request costs Redis and the gateway, by path, measured on a running replica (issue 38's
scale plan, docs/benchmarks/scale.md).

One gateway replica on a private Redis in front of the sim (8 slots of 40 ms). Each phase sends
open-loop Poisson load and reads, before and after: the replica's scripts by name and their round
trips (gateway_redis_scripts_total, gateway_redis_script_seconds_total), its outcomes
(gateway_requests_total), its CPU, and Redis's own account of its scripts (INFO commandstats:
calls and microseconds per EVALSHA) and of its CPU. The phases:

- light (0.3x): every request granted at its offer: the immediate-grant path;
- overload (3x): most arrivals refused, many from the replica's own fresh view (no round trip),
  the admitted ones queued and handed a slot by another request's release;
- idle: nothing sent: the upkeep's own scripts per second (heartbeat, snapshot, reap, the returns'
  exchange, the peers' look).

    PYTHONPATH=. python -m loadtests.redis_scale --seconds 15
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from prometheus_client.parser import text_string_to_metric_families

from loadtests.bench import cpu_seconds
from loadtests.openloop import MIX, poisson_schedule, run, run_fast
from tests.integration.servers import Gateway, Sim, gateway_config
from tests.redis_server import RedisServer

SLOTS, SERVICE_MS = 8, 40.0
CAPACITY_RPS = SLOTS / (SERVICE_MS / 1000)


def totals_by(exposition: str, name: str, label: str) -> dict[str, float]:
    """The samples named `name`, summed by the value of `label`."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels.get(label, "")
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def reading(gateway: Gateway, client: redis.Redis) -> dict[str, Any]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    cpu = client.info("cpu")
    return {
        "scripts": gateway.metric_by("gateway_redis_scripts_total", "script"),
        "script_s": gateway.metric_by("gateway_redis_script_seconds_total", "script"),
        "outcomes": totals_by(gateway.metrics(), "gateway_requests_total", "outcome"),
        "gateway_cpu_s": cpu_seconds(gateway.process.pid),
        "redis_calls": int(stats["calls"]),
        "redis_usec": int(stats["usec"]),
        "redis_cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
        "at": time.monotonic(),
    }


def difference(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    def by_key(name: str) -> dict[str, float]:
        keys = set(before[name]) | set(after[name])
        return {k: after[name].get(k, 0.0) - before[name].get(k, 0.0) for k in keys}

    return {
        "scripts": by_key("scripts"),
        "script_s": by_key("script_s"),
        "outcomes": by_key("outcomes"),
        **{
            k: after[k] - before[k]
            for k in ("gateway_cpu_s", "redis_calls", "redis_usec", "redis_cpu_s", "at")
        },
    }


def phase(name: str, load: float, seconds: float, gateway: Gateway, client: redis.Redis) -> dict[str, Any]:
    before = reading(gateway, client)
    if load > 0:
        schedule = poisson_schedule(load * CAPACITY_RPS, seconds, MIX, seed=3)
        outcomes = run_fast(run(gateway.url, schedule))
        sent = len(outcomes)
    else:
        time.sleep(seconds)
        sent = 0
    time.sleep(1.0)  # the releases of the last requests, off their clients' path
    change = difference(before, reading(gateway, client))
    scripts = change["scripts"]
    total_scripts = sum(scripts.values())
    per = max(sent, 1)
    served = change["outcomes"].get("served", 0.0)
    return {
        "phase": name,
        "offered_rps": round(load * CAPACITY_RPS),
        "sent": sent,
        "outcomes": {k: int(v) for k, v in sorted(change["outcomes"].items()) if v},
        "scripts_per_request": round(total_scripts / per, 2) if sent else None,
        "scripts_per_served": round(total_scripts / served, 2) if served else None,
        "scripts_per_s": round(total_scripts / change["at"], 1),
        "by_script_per_request": {k: round(v / per, 3) for k, v in sorted(scripts.items()) if v}
        if sent
        else None,
        "by_script_per_s": {k: round(v / change["at"], 2) for k, v in sorted(scripts.items()) if v},
        "round_trip_ms": {
            k: round(1000 * change["script_s"][k] / v, 3) for k, v in sorted(scripts.items()) if v
        },
        "redis_usec_per_script": round(change["redis_usec"] / max(change["redis_calls"], 1), 1),
        "redis_cpu_ms_per_request": round(1000 * change["redis_cpu_s"] / per, 3) if sent else None,
        "gateway_cpu_ms_per_request": round(1000 * change["gateway_cpu_s"] / per, 3) if sent else None,
        "redis_cpu_share": round(change["redis_cpu_s"] / change["at"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        sim = Sim(Path(log_dir), slots=2 * SLOTS, base_ms=SERVICE_MS)
        server = RedisServer()
        config = gateway_config([(sim.url, SLOTS)], expected_service_ms=SERVICE_MS)
        config["store"] = {"kind": "redis", "url": server.url}
        gateway = Gateway(Path(log_dir), config)
        client = redis.Redis.from_url(server.url)
        try:
            gateway.wait_ready()
            for name, load in (("idle", 0.0), ("light", 0.3), ("overload", 3.0)):
                print(json.dumps(phase(name, load, args.seconds, gateway, client)), flush=True)
        finally:
            client.close()
            gateway.stop()
            sim.stop()
            server.stop()


if __name__ == "__main__":
    main()
