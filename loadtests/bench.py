"""The core benchmark: one arrival sequence, one run, three targets side by side.

    python -m loadtests.bench                      # light, saturate, overload: direct, HAProxy, gateway
    python -m loadtests.bench --scenarios overload --targets haproxy,gateway,floor
    python -m loadtests.bench --scenarios overload --targets gateway,floor --repeat 5   # the median ratio

Every target sits in front of a fresh simulated backend of 8 slots x 40 ms (capacity 200 rps):
- direct: clients talk to the backend itself (its unbounded FIFO is the only queue);
- haproxy: HAProxy as a priority queue, the peer to beat: one server with maxconn = slots,
  `http-request set-priority-class` from X-Priority, `timeout queue` = the low class's budget
  less the service time, 960 ms (HAProxy has one queue timeout per backend, so the high class
  relies on its priority), one thread like the gateway's one process;
- gateway: this project, in-memory store;
- traced: the gateway tracing 10% of requests (OpenTelemetry, OTLP/HTTP to loadtests.otlp_sink);
- status-polled: the gateway while an operator's page polls its /status.json twice a second;
- grpc: the same gateway, loaded over gRPC (KServe v2 `ModelInfer`, loadtests.grpc_load) on its
  `grpc_listen`, the class and budget as metadata;
- passthrough: a bare uvicorn + aiohttp pass-through (loadtests/passthrough.py), the floor of the
  gateway's own HTTP stack, so that the gateway's cost shows as the difference between the two;
- floor: HAProxy answering an instant 429 to everything: this machine's floor for refusal latency;
- instant-shed: HAProxy refusing at once, at random, the share of `low` requests that capacity
  cannot serve beside the `high` ones, and queueing the rest as the haproxy target does: admission
  at no cost, the floor for refusal latency beside the same served load (the floor's run serves
  nothing, so neither the backend nor the proxying shares the cores with its refusals);
- redis1-delay5 (and any redisN-delayM): the same, M ms added each way between the replicas and
  Redis (loadtests.delay_proxy), a Redis in another zone;
- redis1, redis3: the gateway on the Redis store (a private redis-server), one replica or three
  with the load spread over them in turn; CPU per request counts every replica and Redis.
On a machine of two cores or more the servers under test (the proxy, or its replicas and their
Redis) run on the first core and everything else (this process, which generates the load, and
the simulated backend) on the others, as in a fleet, where neither the clients nor the GPU
servers share the gateway's cores. Sharing them, the processes the proxy's answers wake take its
core from it, and every request it has read waits for their turn
(docs/benchmarks/history/2026-12-04.md, "Who runs
where"). A run with a redis target shares the cores: pinned, its replicas and Redis would share
one core that one gateway has to itself. `--share-cores` shares them in every run, as every run
did before 2026-12-04.
Results print as a table (per class: goodput overall and over the steady window, latency,
refusals by status and their latency, the share of refusals with Retry-After, backend busy, the
proxy's CPU per request) and are saved as JSON under loadtests/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from loadtests.grpc_load import run_grpc
from loadtests.openloop import MIX, ClassSummary, poisson_schedule, run, run_fast, summarize
from tests.integration.servers import Gateway, ServerProcess, Sim, gateway_config, http_get
from tests.redis_server import RedisServer

SLOTS, SERVICE_MS = 8, 40
CAPACITY_RPS = SLOTS * 1000 / SERVICE_MS
WARMUP_S, COOLDOWN_S = 5.0, 2.0


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    load: float  # x capacity
    duration_s: float


SCENARIOS = {
    "light": Scenario("light", 0.3, 20.0),
    "saturate": Scenario("saturate", 1.0, 20.0),
    "overload": Scenario("overload", 3.0, 30.0),
}

HAPROXY_CONFIG = """
global
    maxconn 8000
    nbthread 1
defaults
    mode http
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    timeout queue {queue_timeout_ms}ms
    option http-keep-alive
frontend fe
    bind 127.0.0.1:{port}
    {frontend_rule}
backend be
    http-reuse always
    server sim {backend} maxconn {slots}
"""
PRIORITY_RULES = (
    "http-request set-priority-class int(0) if {{ req.hdr(x-priority) -m str {urgent} }}\n"
    "    http-request set-priority-class int(1) unless {{ req.hdr(x-priority) -m str {urgent} }}\n"
    "    default_backend be"
)
"""HAProxy's priority queue: the `urgent` class first."""
INSTANT_429 = 'http-request return status 429 content-type text/plain string "busy" hdr retry-after 1'
SHED_LOW = INSTANT_429 + " if {{ req.hdr(x-priority) -m str low }} {{ rand(1000) lt {permille} }}"


def low_share_beyond_capacity(load: float) -> float:
    """The share of `low` requests that capacity cannot serve at `load` once `high` is served."""
    offered = CAPACITY_RPS * load
    high, low = (offered * c.share for c in MIX)
    return max(0.0, 1.0 - max(0.0, CAPACITY_RPS - high) / low) if low > 0 else 0.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, slots=True)
class Cores:
    """Where the servers under test run, and where the load generator and the backend run."""

    under_test: frozenset[int]
    load_and_backend: frozenset[int]

    @classmethod
    def layout(cls, targets: Sequence[str], share: bool) -> Cores | None:
        """The first of this process's cores for the servers under test, the others for the load
        and the backend; None (all shared) if asked, on one core, or with a redis target among
        `targets` (see the module)."""
        cores = sorted(os.sched_getaffinity(0))
        if share or len(cores) < 2 or any(t.startswith("redis") for t in targets):
            return None
        return cls(frozenset(cores[:1]), frozenset(cores[1:]))

    def as_json(self) -> dict[str, list[int]]:
        return {"under_test": sorted(self.under_test), "load_and_backend": sorted(self.load_and_backend)}

    def pin_under_test(self, pid: int) -> None:
        """Every thread of process `pid` onto the cores under test (its later threads inherit them)."""
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(task.name), self.under_test)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class HAProxy:
    def __init__(
        self,
        log_dir: Path,
        backend_url: str,
        *,
        instant_429: bool = False,
        slots: int = SLOTS,
        queue_timeout_ms: float = 1000 - SERVICE_MS,
        urgent_class: str = "high",
        shed_low_share: float = 0.0,
    ) -> None:
        """`shed_low_share`: the share of `low` requests refused at once, at random (the rest queued)."""
        self.port = free_port()
        rule = INSTANT_429 if instant_429 else PRIORITY_RULES.format(urgent=urgent_class)
        if shed_low_share > 0 and not instant_429:
            rule = SHED_LOW.format(permille=round(shed_low_share * 1000)) + "\n    " + rule
        config = HAPROXY_CONFIG.format(
            port=self.port,
            backend=backend_url.removeprefix("http://"),
            slots=slots,
            queue_timeout_ms=round(queue_timeout_ms),
            frontend_rule=rule,
        )
        path = log_dir / f"haproxy-{self.port}.cfg"
        path.write_text(config)
        self.process = subprocess.Popen(
            ["haproxy", "-db", "-f", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("haproxy did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


class PassThroughProcess(ServerProcess):
    def __init__(self, log_dir: Path, upstream: str) -> None:
        super().__init__(
            "passthrough", [], log_dir, "/", module="loadtests.passthrough", extra=["--upstream", upstream]
        )


class DelayProxy(ServerProcess):
    """loadtests.delay_proxy in front of Redis: `delay_ms` added each way."""

    def __init__(self, log_dir: Path, upstream_port: int, delay_ms: float) -> None:
        self.port = free_port()
        extra = [
            "--listen-port",
            str(self.port),
            "--upstream-port",
            str(upstream_port),
            "--delay-ms",
            str(delay_ms),
        ]
        super().__init__("delay-proxy", [], log_dir, "/", module="loadtests.delay_proxy", extra=extra)

    def _probed_url(self) -> str:
        return self.url

    def _wait_answering(self, path: str, timeout_s: float = 30.0) -> None:
        return None  # not HTTP: listening is enough


class OtlpSink(ServerProcess):
    """loadtests.otlp_sink: where the traced target sends its spans (its CPU is not the gateway's)."""

    def __init__(self, log_dir: Path) -> None:
        port = free_port()
        super().__init__(
            "otlp-sink", [], log_dir, "/", module="loadtests.otlp_sink", extra=["--port", str(port)]
        )


TARGETS = (
    "direct", "passthrough", "haproxy", "gateway", "traced", "status-polled", "grpc", "floor", "instant-shed"
)  # fmt: skip


def is_target(name: str) -> bool:
    replicas, _, delay = name.removeprefix("redis").partition("-delay")
    return name in TARGETS or (
        name.startswith("redis") and replicas.isdigit() and (not delay or delay.isdigit())
    )


def start_target(
    target: str, log_dir: Path, sim: Sim, python: str = sys.executable, load: float = 1.0
) -> tuple[list[str], list[Any]]:
    """The URLs to load (in turn) and the processes whose CPU counts (none for direct); `load`:
    the scenario's, which instant-shed sheds for."""
    if target == "direct":
        return [sim.url], []
    if target in ("haproxy", "floor", "instant-shed"):
        shed = low_share_beyond_capacity(load) if target == "instant-shed" else 0.0
        proxy = HAProxy(log_dir, sim.url, instant_429=target == "floor", shed_low_share=shed)
        return [proxy.url], [proxy]
    if target == "passthrough":
        proxy = PassThroughProcess(log_dir, sim.url)
        return [proxy.url], [proxy]
    config = gateway_config([(sim.url, SLOTS)], expected_service_ms=SERVICE_MS, health={"interval_ms": 1000})
    if target == "grpc":
        config["grpc_listen"] = {"host": "127.0.0.1", "port": 0}
        gateway = Gateway(log_dir, config, python=python)
        gateway.wait_ready()
        return [gateway.grpc_target], [gateway]
    if target == "traced":
        sink = OtlpSink(log_dir)
        env = {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": sink.url + "/v1/traces",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.1",
        }
        gateway = Gateway(log_dir, config, python=python, env=env)
        gateway.wait_ready()
        return [gateway.url], [gateway, sink]
    replicas = 1
    redis: list[Any] = []
    if target.startswith("redis"):  # redis1, redis3: replicas sharing one Redis; -delayM: M ms each way
        count, _, delay = target.removeprefix("redis").partition("-delay")
        replicas = int(count)
        redis = [RedisServer()]
        url = redis[0].url
        if delay:
            proxy = DelayProxy(log_dir, redis[0].port, float(delay))
            redis.append(proxy)
            url = f"redis://127.0.0.1:{proxy.port}/0"
        config["store"] = {"kind": "redis", "url": url, "replicas": replicas}
    gateways = [Gateway(log_dir, config, python=python) for _ in range(replicas)]
    for gateway in gateways:
        gateway.wait_ready()
    return [g.url for g in gateways], [*gateways, *redis]


@contextlib.contextmanager
def polling(url: str | None, interval_s: float = 0.5) -> Iterator[None]:
    """GET `url` every `interval_s` while the block runs (a status page left open), from a thread."""
    if url is None:
        yield
        return
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(interval_s):
            with contextlib.suppress(OSError):
                http_get(url)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        yield
    finally:
        stop.set()
        poller.join(5)


def run_one(
    scenario: Scenario,
    target: str,
    log_dir: Path,
    seed: int,
    python: str = sys.executable,
    cores: Cores | None = None,
) -> dict[str, Any]:
    """One target's run; with `cores`, the servers under test pinned apart from this process
    (which must run on `cores.load_and_backend`) and the backend, which it starts there."""
    sim = Sim(log_dir, slots=SLOTS, base_ms=SERVICE_MS)
    urls, servers = start_target(target, log_dir, sim, python, scenario.load)
    try:
        if cores is not None:
            for server in servers:
                if not isinstance(
                    server, OtlpSink
                ):  # the receiver runs beside the load, off the gateway's core
                    cores.pin_under_test(server.process.pid)
        schedule = poisson_schedule(CAPACITY_RPS * scenario.load, scenario.duration_s, seed=seed)
        load = run_grpc if target == "grpc" else run
        run_fast(load(urls, poisson_schedule(50, 0.5, seed=seed + 1)))  # warm the connections
        # The sink and the delay proxy stand for the network and a collector, not the gateway's work.
        pids = [server.process.pid for server in servers if not isinstance(server, OtlpSink | DelayProxy)]
        before_cpu, before_busy = sum(map(cpu_seconds, pids)), sim.reset()["busy_slot_s"]
        started = time.monotonic()
        with polling(urls[0] + "/status.json" if target == "status-polled" else None):
            outcomes = run_fast(load(urls, schedule))
        cpu_s = sum(map(cpu_seconds, pids)) - before_cpu
        elapsed_s = time.monotonic() - started
        after = sim.stats()
        busy_slot_s = after["busy_slot_s"] - before_busy
        gateways = [server for server in servers if isinstance(server, Gateway)]
        outcomes_seen = gateway_outcomes(gateways) if gateways else None
    finally:
        for server in servers:
            server.stop()
        sim.stop()
    summary = summarize(outcomes, scenario.duration_s, WARMUP_S, COOLDOWN_S)
    return {
        "target": target,
        "classes": {k: asdict(v) for k, v in summary.items()},
        "requests": len(outcomes),
        "cpu_ms_per_request": cpu_s * 1000 / len(outcomes) if servers else None,
        "backend_busy": busy_slot_s / (SLOTS * elapsed_s),
        "idle_gap_ms": after["idle_gap_ms"],
        "gateway_outcomes": outcomes_seen,
    }


def gateway_outcomes(gateways: list[Gateway]) -> dict[str, float]:
    """gateway_requests_total by priority and outcome, as the gateways counted them."""
    counts: dict[str, float] = {}
    for gateway in gateways:
        for family in text_string_to_metric_families(gateway.metrics()):
            for sample in family.samples:
                if sample.name == "gateway_requests_total":
                    key = f"{sample.labels['priority']}/{sample.labels['outcome']}"
                    counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(scenario: Scenario, results: list[dict[str, Any]]) -> str:
    rows = [
        f"### {scenario.name}: {scenario.load:g}x capacity ({CAPACITY_RPS * scenario.load:.0f} rps) for "
        f"{scenario.duration_s:g} s",
        "",
        "| target | class | sent | goodput/s | steady goodput/s | p50 ms | p99 ms | refusals "
        "| refusal p50 ms | refusal p99 ms | expired in queue | refusal p99 ms without them "
        "| with Retry-After | backend busy | slot idle gap p50/p99 ms | CPU ms/req |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for priority, raw in result["classes"].items():
            c = ClassSummary(**raw)
            refusals = ", ".join(f"{k}: {v}" for k, v in sorted(c.rejections.items())) or "-"
            share = "-" if c.retry_after_share is None else f"{c.retry_after_share:.0%}"
            cpu = result["cpu_ms_per_request"]
            gap = result["idle_gap_ms"]
            rows.append(
                f"| {result['target']} | {priority} | {c.sent} | {c.goodput_rps:.1f} "
                f"| {c.steady_goodput_rps:.1f} "
                f"| {_ms(c.p50_ms)} | {_ms(c.p99_ms)} | {refusals} | {_ms(c.rejection_p50_ms)} "
                f"| {_ms(c.rejection_p99_ms)} | {c.expired_in_queue or '-'} "
                f"| {_ms(c.arrival_rejection_p99_ms)} | {share} | {result['backend_busy']:.1%} "
                f"| {_ms(gap['p50'])}/{_ms(gap['p99'])} | {'-' if cpu is None else f'{cpu:.2f}'} |"
            )
    rows += [
        f"\n{result['target']} outcomes: {json.dumps(result['gateway_outcomes'])}"
        for result in results
        if result.get("gateway_outcomes")
    ]
    return "\n".join(rows)


def ratios(runs: list[list[dict[str, Any]]]) -> str:
    """Per run and at the median, the ratios the core targets are read by, for the targets present:
    each proxy's low-class refusal p99 at arrival to the floor's, and its steady goodput to HAProxy's."""
    per_run: dict[str, list[float]] = {}
    for results in runs:
        summaries = {
            r["target"]: {name: ClassSummary(**raw) for name, raw in r["classes"].items()} for r in results
        }
        floor = summaries.get("floor", {}).get("low")
        floor_p99 = floor.arrival_rejection_p99_ms if floor else None
        haproxy = summaries.get("haproxy")
        haproxy_goodput = sum(c.steady_goodput_rps for c in haproxy.values()) if haproxy else 0.0
        for target, classes in summaries.items():
            low = classes.get("low")
            if floor_p99 and target != "floor" and low and low.arrival_rejection_p99_ms is not None:
                ratio = low.arrival_rejection_p99_ms / floor_p99
                per_run.setdefault(f"{target} refusal p99 / floor", []).append(ratio)
            if haproxy_goodput > 0 and target not in ("haproxy", "floor"):  # the floor serves nothing
                goodput = sum(c.steady_goodput_rps for c in classes.values())
                per_run.setdefault(f"{target} steady goodput / haproxy", []).append(goodput / haproxy_goodput)
    lines = [f"Over {len(runs)} runs:"]
    for name, values in per_run.items():
        shown = ", ".join(f"{v:.2f}x" for v in values)
        lines.append(f"- {name}: {shown}; median {statistics.median(values):.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", default="light,saturate,overload")
    parser.add_argument("--targets", default="direct,passthrough,haproxy,gateway,floor")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each scenario's targets this many times in turn, and give the median of the "
        "per-run ratios that the targets allow (refusal latency to the floor's, goodput to HAProxy's)",
    )
    parser.add_argument(
        "--share-cores",
        action="store_true",
        help="run the servers under test on the same cores as the load generator and the backend "
        "(as runs with a redis target always do)",
    )
    parser.add_argument(
        "--gateway-python",
        default=sys.executable,
        help="the interpreter that runs the gateway targets (one with the project installed)",
    )
    args = parser.parse_args()
    targets = args.targets.split(",")
    if unknown := [t for t in targets if not is_target(t)]:
        parser.error(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(TARGETS)}, redisN")
    if {"haproxy", "floor", "instant-shed"} & set(targets) and shutil.which("haproxy") is None:
        parser.error("the haproxy, floor and instant-shed targets need HAProxy: apt-get install haproxy")
    cores = Cores.layout(targets, args.share_cores)
    if cores is not None:
        # Before any thread or server starts: they inherit it.
        os.sched_setaffinity(0, cores.load_and_backend)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-"))
    report: dict[str, Any] = {
        "machine": f"{os.cpu_count()} cores",
        "cores": "shared" if cores is None else cores.as_json(),
        "seed": args.seed,
        "gateway_python": args.gateway_python,
        "scenarios": {},
    }
    for name in args.scenarios.split(","):
        scenario = SCENARIOS[name]
        runs = []
        for _ in range(args.repeat):  # the targets in turn, so that the machine's moods fall on all
            results = [run_one(scenario, t, log_dir, args.seed, args.gateway_python, cores) for t in targets]
            runs.append(results)
            print(table(scenario, results), "\n", flush=True)
        report["scenarios"][name] = runs[0]
        if args.repeat > 1:
            report.setdefault("repeats", {})[name] = runs
            print(ratios(runs), "\n", flush=True)
    out = Path(__file__).parent / "results" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
