"""The Redis store as /metrics shows it: how many of each script ran, and the seconds their round
trips took (a script's mean round trip is the second over the first): what a request costs
Redis, and what a Redis in another zone costs each request, read from a running replica; and the
probes of other replicas' beacons by verdict (gone: a dead replica's slots given back)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


class StoreCalls(Collector):
    """Counts kept in plain dicts on the hot path; families built only when scraped."""

    def __init__(self) -> None:
        self.runs: defaultdict[str, int] = defaultdict(int)
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.probes: defaultdict[str, int] = defaultdict(int)

    def record(self, script: str, seconds: float) -> None:
        self.runs[script] += 1
        self.seconds[script] += seconds

    def probed(self, verdict: str) -> None:
        self.probes[verdict] += 1

    def collect(self) -> Iterator[Metric]:
        runs = CounterMetricFamily(
            "gateway_redis_scripts",
            "Scripts this replica ran on Redis (one round trip each).",
            labels=["script"],
        )
        seconds = CounterMetricFamily(
            "gateway_redis_script_seconds",
            "Seconds this replica's scripts took, sent to answered (round trip and Redis's time).",
            labels=["script"],
        )
        probes = CounterMetricFamily(
            "gateway_replica_probes",
            "Probes of other replicas' beacons, by verdict (gone: proved dead, its slots given back; "
            "here: alive, cut off from Redis; unknown: no answer).",
            labels=["verdict"],
        )
        for script in sorted(self.runs):
            runs.add_metric([script], self.runs[script])
            seconds.add_metric([script], self.seconds[script])
        for verdict in ("gone", "here", "unknown"):
            probes.add_metric([verdict], self.probes[verdict])
        yield runs
        yield seconds
        yield probes

    def describe(self) -> Iterator[Metric]:
        return iter(())
