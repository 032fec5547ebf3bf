"""Admission against HAProxy (issue 13): moderate load on few long slots, bursts, overload.

    python -m loadtests.admission                                   # every scenario: HAProxy and the gateway
    python -m loadtests.admission --scenarios burst --targets haproxy,gateway,redis1
    python -m loadtests.admission --quick                           # a smoke run of each scenario, < 90 s

Each scenario's open-loop Poisson arrival sequence (seeded) is replayed against each target, in front
of a fresh simulated backend whose service times are drawn from the same seed. Two classes, 20% high
and 80% low, each request's deadline sent as X-Request-Timeout-Ms; a class's queue-wait limit (the
gateway's max_wait_ms) is its deadline less 1.5 service times, and HAProxy's one `timeout queue` is
the low class's limit (HAProxy has one per backend; the high class relies on its priority).
- moderate: 4 slots x 800 ms (LLM-like), at 0.8x and 0.92x capacity, exponential and fixed service;
  deadlines 3 s (high) and 20 s (low), 100 s of arrivals (400-460 requests) per run.
- burst: 8 slots x 40 ms, bursts at 2x and 3x for 2 and 4 s, each followed by a lull at 0.5x long
  enough to serve its excess (1.25 x excess / spare capacity). A refused client comes back after its
  `retry-after-ms` (HAProxy's 503 on a queue timeout carries no advice: after a fixed 0.5 s), up to 5
  times, each retry marked `X-Retry-Attempt: k`; a return that would land past the horizon (10 s
  after the last arrival) is abandoned. Deadlines 250 ms and 1 s.
- long-tail: bursts as above on a chat pool whose requests run long or short (4 slots x 400 ms
  mean, the sim's `long-tail`: 90% take 100 ms, 10% take 3.1 s), bursts at 2x and 3x for 6 s, with
  clients that follow the advice; deadlines 2 s and 8 s. The requests holding the slots have
  longer left than the drain rate says, and a promise must read them.
- overload: 3x on 8 x 40 ms for 30 s, no retries, with `floor` (HAProxy's instant 429, as in
  loadtests.bench) added for the refusal latency.
Per scenario and target it prints, and saves as JSON under loadtests/results/: goodput (200s within
their deadline, per second of arrivals) and its ratio to HAProxy's, refusals (of first attempts) and
those of requests HAProxy served in time, predicted against actual queue wait from the gateway's
/metrics ("n/a" where the metric is absent), the share of admitted requests that expired in the
queue, the share of refused requests admitted (and served) on their first retry, retries per refused
request, each burst's share eventually served, the high class's p99 against HAProxy's and the
refusal p99 against the instant-429 floor. The JSON also keeps every attempt of every arrival (sent
at, status, latency, advice), to read a run's Retry-After request by request.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.tools.loadtest import client
from gateway.tools.loadtest.requests import Prepared
from gateway.tools.loadtest.workload import Arrival as KitArrival
from loadtests.bench import HAProxy
from loadtests.openloop import (
    INFER_BODY,
    INFER_PATH,
    Arrival,
    Outcome,
    TrafficClass,
    percentile,
    poisson_schedule,
    run,
    run_fast,
    summarize,
)
from tests.integration.servers import Gateway, Sim, gateway_config
from tests.redis_server import RedisServer

FIXED_BACKOFF_S = 0.5
"""When a refusal carries no advice (HAProxy's 503): the openai SDK's first backoff, without growth."""
WAIT_LIMIT_SERVICES = 1.5
"""A class's queue-wait limit is its deadline less this many service times (issue 13's measurement)."""


@dataclass(frozen=True, slots=True)
class Phase:
    load: float  # x capacity
    duration_s: float
    burst: bool = False


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    slots: int
    service_ms: float
    service_dist: str
    phases: tuple[Phase, ...]
    deadlines_ms: tuple[int, int]  # high, low
    retries: int = 0
    retry_horizon_s: float = 10.0
    warmup_s: float = 5.0
    cooldown_s: float = 2.0
    with_floor: bool = False

    @property
    def capacity_rps(self) -> float:
        return self.slots * 1000 / self.service_ms

    @property
    def duration_s(self) -> float:
        return sum(phase.duration_s for phase in self.phases)

    @property
    def mix(self) -> tuple[TrafficClass, TrafficClass]:
        high_ms, low_ms = self.deadlines_ms
        return TrafficClass("high", 0.2, high_ms), TrafficClass("low", 0.8, low_ms)

    def wait_limit_ms(self, deadline_ms: int) -> float:
        return deadline_ms - WAIT_LIMIT_SERVICES * self.service_ms

    def phase_starts_s(self) -> list[float]:
        return [0.0, *itertools.accumulate(phase.duration_s for phase in self.phases)][:-1]

    def schedule(self, seed: int) -> list[Arrival]:
        """One Poisson sequence per phase (memoryless, so the joins are exact), shifted to its start."""
        return [
            Arrival(start_s + a.at_s, a.priority, a.deadline_ms)
            for index, (phase, start_s) in enumerate(zip(self.phases, self.phase_starts_s(), strict=True))
            for a in poisson_schedule(
                self.capacity_rps * phase.load, phase.duration_s, self.mix, seed * 1000 + index
            )
        ]

    def bursts(self) -> list[tuple[float, float]]:
        """The [start, end) of each burst phase, in seconds from the first arrival."""
        starts = zip(self.phases, self.phase_starts_s(), strict=True)
        return [(start_s, start_s + phase.duration_s) for phase, start_s in starts if phase.burst]


def burst_train(
    bursts: Sequence[tuple[float, float]], lead_s: float, lull_load: float = 0.5
) -> tuple[Phase, ...]:
    """A lead-in at the lull's load, then each (load, seconds) burst followed by a lull that can serve
    its excess with a quarter to spare."""
    phases = [Phase(lull_load, lead_s)]
    for load, seconds in bursts:
        lull_s = 1.25 * (load - 1) * seconds / (1 - lull_load)
        phases += [Phase(load, seconds, burst=True), Phase(lull_load, lull_s)]
    return tuple(phases)


def scenarios(quick: bool) -> dict[str, list[Scenario]]:
    moderate_s, overload_s = (5.0, 3.0) if quick else (100.0, 30.0)
    variants = [(0.92, "exponential")] if quick else [(0.8, "exponential"), (0.92, "exponential")]
    if not quick:
        variants += [(0.8, "fixed"), (0.92, "fixed")]
    bursts = [(2.0, 2.0)] if quick else [(2.0, 2.0), (3.0, 2.0), (2.0, 4.0), (3.0, 4.0)]
    tail_bursts = [(2.0, 3.0)] if quick else [(2.0, 6.0), (3.0, 6.0)]
    warmup_s, cooldown_s = (0.5, 0.5) if quick else (5.0, 2.0)
    return {
        "moderate": [
            Scenario(
                f"moderate-{load:g}x-{dist}",
                4,
                800,
                dist,
                (Phase(load, moderate_s),),
                (3000, 20_000),
                warmup_s=warmup_s,
                cooldown_s=cooldown_s,
            )
            for load, dist in variants
        ],
        "burst": [
            Scenario(
                "burst",
                8,
                40,
                "fixed",
                burst_train(bursts, lead_s=1.0 if quick else 3.0),
                (250, 1000),
                retries=5,
                retry_horizon_s=3.0 if quick else 10.0,
                warmup_s=warmup_s,
                cooldown_s=cooldown_s,
            )
        ],
        "long-tail": [
            Scenario(
                "long-tail",
                4,
                400,
                "long-tail",
                burst_train(tail_bursts, lead_s=2.0 if quick else 5.0),
                (2000, 8000),
                retries=5,
                retry_horizon_s=5.0 if quick else 20.0,
                warmup_s=warmup_s,
                cooldown_s=cooldown_s,
            )
        ],
        "overload": [
            Scenario(
                "overload",
                8,
                40,
                "fixed",
                (Phase(3.0, overload_s),),
                (250, 1000),
                with_floor=True,
                warmup_s=warmup_s,
                cooldown_s=cooldown_s,
            )
        ],
    }


@dataclass(slots=True)
class Attempt:
    outcome: Outcome
    """openloop's outcome; its arrival is this attempt's own scheduled send, latency counts from it."""
    retry_after_ms: float | None
    should_retry: bool


@dataclass(slots=True)
class Journey:
    """One arrival and every attempt its client made."""

    arrival: Arrival
    attempts: list[Attempt] = field(default_factory=list)
    abandoned: bool = False
    """The advice would have brought it back past the horizon."""


async def replay(
    urls: Sequence[str],
    schedule: Sequence[Arrival],
    *,
    retries: int,
    horizon_s: float,
    timeout_factor: float = 3.0,
) -> list[Journey]:
    """Send `schedule` open-loop with the kit's client (gateway/tools/loadtest/client.py); a refused
    request (429, 503) comes back after its advice (FIXED_BACKOFF_S where it has none), `retries`
    times at most and never past `horizon_s` from the start, each retry to the next URL; an attempt
    gives up after `timeout_factor` x its deadline + 1 s."""
    prepared = [
        Prepared(
            INFER_PATH,
            INFER_BODY,
            {
                "Content-Type": "application/json",
                "X-Priority": arrival.priority,
                "X-Request-Timeout-Ms": str(arrival.deadline_ms),
            },
            False,
            arrival.deadline_ms / 1000,
        )
        for arrival in schedule
    ]
    sends = [KitArrival(arrival.at_s, index) for index, arrival in enumerate(schedule)]
    retrying = client.Retrying(retries, backoff_s=FIXED_BACKOFF_S, horizon_s=horizon_s)
    records, _ = await client.run(urls, sends, prepared, retrying=retrying, timeout_factor=timeout_factor)
    return [_journey(schedule[record.arrival.traffic], record) for record in records]


def _journey(arrival: Arrival, record: client.RequestRecord) -> Journey:
    journey = Journey(arrival, abandoned=record.abandoned)
    for index, answer in enumerate(record.attempts):
        # A retry's latency counts from its own send (its scheduled time, but for the loop's lag).
        sent = arrival if index == 0 else Arrival(answer.sent_s, arrival.priority, arrival.deadline_ms)
        latency_s = answer.ended_s - sent.at_s
        if answer.status is None:
            outcome = Outcome(sent, None, latency_s, error=answer.reason)
        else:
            expired = answer.reason in ("deadline_expired_in_queue", "no_server_available")
            outcome = Outcome(sent, answer.status, latency_s, answer.advised_s is not None, None, expired)
        advice_ms = None if answer.advised_s is None else answer.advised_s * 1000
        journey.attempts.append(Attempt(outcome, advice_ms, answer.retryable))
    return journey


def is_target(name: str) -> bool:
    return name in ("haproxy", "gateway") or (
        name.startswith("redis") and name.removeprefix("redis").isdigit()
    )


def start_target(
    target: str, scenario: Scenario, log_dir: Path, sim: Sim, python: str
) -> tuple[list[str], list[Any]]:
    """The URLs to load (in turn) and the servers to stop afterwards."""
    high_ms, low_ms = scenario.deadlines_ms
    if target in ("haproxy", "floor"):
        proxy = HAProxy(
            log_dir,
            sim.url,
            slots=scenario.slots,
            queue_timeout_ms=scenario.wait_limit_ms(low_ms),
            instant_429=target == "floor",
        )
        return [proxy.url], [proxy]
    classes = [
        {"name": "high", "max_wait_ms": scenario.wait_limit_ms(high_ms)},
        {"name": "low", "max_wait_ms": scenario.wait_limit_ms(low_ms)},
    ]
    config = gateway_config(
        [(sim.url, scenario.slots)],
        expected_service_ms=scenario.service_ms,
        priorities=classes,
        health={"interval_ms": 1000},
    )
    replicas, redis = 1, []
    if target.startswith("redis"):  # redis1, redis3: replicas sharing one Redis
        replicas, redis = int(target.removeprefix("redis")), [RedisServer()]
        config["store"] = {"kind": "redis", "url": redis[0].url, "replicas": replicas}
    servers: list[Any] = [*redis]
    try:
        for _ in range(replicas):
            servers.append(Gateway(log_dir, config, python=python))
            servers[-1].wait_ready()
    except BaseException:
        for server in reversed(servers):
            server.stop()
        raise
    return [g.url for g in servers if isinstance(g, Gateway)], servers


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass(slots=True)
class Scrape:
    families: set[str] = field(default_factory=set)
    samples: Samples = field(default_factory=dict)

    @classmethod
    def of(cls, gateways: Sequence[Gateway]) -> Scrape:
        """Every replica's /metrics, summed sample by sample."""
        scrape = cls()
        for gateway in gateways:
            for family in text_string_to_metric_families(gateway.metrics()):
                scrape.families.add(family.name)
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    scrape.samples[key] = scrape.samples.get(key, 0.0) + float(sample.value)
        return scrape

    def since(self, before: Scrape) -> Scrape:
        delta = {key: value - before.samples.get(key, 0.0) for key, value in self.samples.items()}
        return Scrape(self.families, delta)

    def total(self, name: str) -> float | None:
        """The sum of a counter's samples; None when the gateway does not export it."""
        if name.removesuffix("_total") not in self.families:
            return None
        return sum(value for (sample, _), value in self.samples.items() if sample == name)

    def histogram(self, name: str) -> dict[str, dict[str, float | None]] | None:
        """Per priority: count, mean and the p50 and p99 bucket bounds; None when the gateway lacks it."""
        if name not in self.families:
            return None
        buckets: dict[str, dict[float, float]] = {}
        sums: dict[str, float] = {}
        for (sample, label_items), value in self.samples.items():
            labels = dict(label_items)
            priority = labels.get("priority", "all")
            if sample == f"{name}_bucket":
                by_bound = buckets.setdefault(priority, {})
                by_bound[float(labels["le"])] = by_bound.get(float(labels["le"]), 0.0) + value
            elif sample == f"{name}_sum":
                sums[priority] = sums.get(priority, 0.0) + value
        stats: dict[str, dict[str, float | None]] = {}
        for priority, by_bound in sorted(buckets.items()):
            cumulative = sorted(by_bound.items())
            count = cumulative[-1][1]
            stats[priority] = {
                "count": count,
                "mean_s": sums.get(priority, 0.0) / count if count else None,
                "p50_le_s": _bucket_bound(cumulative, 0.5),
                "p99_le_s": _bucket_bound(cumulative, 0.99),
            }
        return stats


def _bucket_bound(cumulative: list[tuple[float, float]], q: float) -> float | None:
    """The upper bound of the bucket holding the q-quantile of a cumulative histogram."""
    count = cumulative[-1][1]
    return next((le for le, seen in cumulative if count and seen >= q * count), None)


def in_time(outcome: Outcome) -> bool:
    return outcome.status == 200 and outcome.latency_s * 1000 <= outcome.arrival.deadline_ms


def refused(outcome: Outcome) -> bool:
    return outcome.status is not None and outcome.status != 200


def refused_at_arrival(outcome: Outcome) -> bool:
    """Refused before it queued: HAProxy refuses nothing at arrival, its 503s come after `timeout queue`."""
    return refused(outcome) and not outcome.expired_in_queue


def served(journey: Journey) -> bool:
    return any(in_time(attempt.outcome) for attempt in journey.attempts)


def measure(scenario: Scenario, journeys: Sequence[Journey]) -> dict[str, Any]:
    """What one target did with the scenario's arrivals; refusals and expiries count first attempts."""
    firsts = [journey.attempts[0].outcome for journey in journeys]
    every = [attempt.outcome for journey in journeys for attempt in journey.attempts]
    refusals = [o for o in firsts if refused(o)]
    admitted = [o for o in firsts if not refused_at_arrival(o)]
    high_ok_ms = [o.latency_s * 1000 for o in every if o.status == 200 and o.arrival.priority == "high"]
    classes = summarize(firsts, scenario.duration_s, scenario.warmup_s, scenario.cooldown_s)
    result: dict[str, Any] = {
        "requests": len(journeys),
        "attempts": len(every),
        "goodput_rps": sum(map(in_time, every)) / scenario.duration_s,
        "steady_goodput_rps": sum(c.steady_goodput_rps for c in classes.values()),
        "refused_share": len(refusals) / len(firsts) if firsts else None,
        "expired_of_admitted": sum(o.expired_in_queue for o in admitted) / len(admitted)
        if admitted
        else None,
        "high_p99_ms": percentile(high_ok_ms, 0.99),
        "refusal_p99_ms": percentile([o.latency_s * 1000 for o in refusals], 0.99),
        "arrival_refusal_p99_ms": percentile(
            [o.latency_s * 1000 for o in refusals if not o.expired_in_queue], 0.99
        ),
        "no_answer": sum(o.status is None for o in every),
        "classes": {priority: asdict(summary) for priority, summary in classes.items()},
    }
    if scenario.retries:
        result |= retry_measures(scenario, journeys)
    return result


def retry_measures(scenario: Scenario, journeys: Sequence[Journey]) -> dict[str, Any]:
    """How the clients that were refused at first fared when they came back as advised."""
    first_refused = [j for j in journeys if refused(j.attempts[0].outcome)]
    first_retries = [j.attempts[1].outcome for j in first_refused if len(j.attempts) > 1]
    count = len(first_refused)

    def share(hits: int) -> float | None:
        return hits / count if count else None

    bursts = []
    for start_s, end_s in scenario.bursts():
        mine = [j for j in journeys if start_s <= j.arrival.at_s < end_s]
        bursts.append(sum(map(served, mine)) / len(mine) if mine else None)
    return {
        "refused_first": count,
        "first_retry_admitted": share(sum(not refused_at_arrival(o) for o in first_retries)),
        "first_retry_served": share(sum(map(in_time, first_retries))),
        "retries_per_refused": share(sum(len(j.attempts) - 1 for j in first_refused)),
        "refused_served_in_the_end": share(sum(map(served, first_refused))),
        "never_served": sum(not served(j) for j in journeys) / len(journeys) if journeys else None,
        "abandoned": sum(j.abandoned for j in journeys),
        "burst_served": bursts,
    }


def warmup_schedule(scenario: Scenario) -> list[Arrival]:
    """Two rounds of one request per slot over two service times: the connections are open, and the
    gateway has measured some service times, before the measured run."""
    step_s = scenario.service_ms / 1000 / scenario.slots
    low = scenario.mix[1]
    return [Arrival(i * step_s, low.priority, low.deadline_ms) for i in range(2 * scenario.slots)]


Verdicts = tuple[list[bool], list[bool]]
"""Per arrival, in schedule order: served in time at the first attempt; refused at the first attempt."""


def run_one(
    scenario: Scenario, target: str, log_dir: Path, seed: int, python: str
) -> tuple[dict[str, Any], Verdicts]:
    sim = Sim(
        log_dir,
        slots=scenario.slots,
        base_ms=scenario.service_ms,
        service_dist=scenario.service_dist,
        seed=seed,
    )
    try:
        urls, servers = start_target(target, scenario, log_dir, sim, python)
        try:
            gateways = [server for server in servers if isinstance(server, Gateway)]
            run_fast(run(urls, warmup_schedule(scenario)))
            before, busy_before_s = Scrape.of(gateways), sim.reset()["busy_slot_s"]
            started = time.monotonic()
            horizon_s = scenario.duration_s + scenario.retry_horizon_s
            journeys = run_fast(
                replay(urls, scenario.schedule(seed), retries=scenario.retries, horizon_s=horizon_s)
            )
            elapsed_s = time.monotonic() - started
            busy_slot_s = sim.stats()["busy_slot_s"] - busy_before_s
            seen = Scrape.of(gateways).since(before) if gateways else None
        finally:
            for server in reversed(servers):
                server.stop()
    finally:
        sim.stop()
    result = {"target": target, "elapsed_s": elapsed_s, **measure(scenario, journeys)}
    result["journeys"] = journey_log(journeys)
    result["backend_busy"] = busy_slot_s / (scenario.slots * elapsed_s)
    if seen is not None:
        result["gateway"] = {
            "predicted_wait": seen.histogram("gateway_admission_predicted_wait_seconds"),
            "queue_wait": seen.histogram("gateway_queue_wait_seconds"),
            "retries_counted": seen.total("gateway_retries_total"),
        }
    firsts = [journey.attempts[0].outcome for journey in journeys]
    return result, ([in_time(o) for o in firsts], [refused(o) for o in firsts])


def _attempt_row(attempt: Attempt) -> list[Any]:
    sent, status, latency_s = attempt.outcome.arrival.at_s, attempt.outcome.status, attempt.outcome.latency_s
    return [round(sent, 4), status, round(latency_s, 4), attempt.retry_after_ms]


def journey_log(journeys: Sequence[Journey]) -> list[dict[str, Any]]:
    """Each arrival's attempts as [sent at s, status, latency s, advice ms]: what the tables sum
    up, kept so that a run's Retry-After can be read request by request afterwards."""
    return [
        {
            "priority": journey.arrival.priority,
            "abandoned": journey.abandoned,
            "attempts": [_attempt_row(attempt) for attempt in journey.attempts],
        }
        for journey in journeys
    ]


def _ratio(mine: float | None, theirs: float | None) -> float | None:
    return mine / theirs if mine is not None and theirs else None


def compare(results: list[dict[str, Any]], verdicts: dict[str, Verdicts]) -> None:
    """Adds each target's ratios to HAProxy's (and to the floor's refusal p99), in place."""
    by_target = {r["target"]: r for r in results if "error" not in r}
    haproxy, floor = by_target.get("haproxy"), by_target.get("floor")
    for target, result in by_target.items():
        if target == "floor":
            continue
        if haproxy is not None:
            result["goodput_vs_haproxy"] = _ratio(result["goodput_rps"], haproxy["goodput_rps"])
            result["high_p99_vs_haproxy"] = _ratio(result["high_p99_ms"], haproxy["high_p99_ms"])
            haproxy_in_time, mine_refused = verdicts["haproxy"][0], verdicts[target][1]
            both = sum(h and m for h, m in zip(haproxy_in_time, mine_refused, strict=True))
            result["refused_haproxy_in_time"] = both
        if floor is not None and target != "haproxy":  # HAProxy's 503s come after its queue timeout
            result["refusal_p99_vs_floor"] = _ratio(result["refusal_p99_ms"], floor["refusal_p99_ms"])


def _f(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _mean_cell(histogram: dict[str, dict[str, float | None]] | None, priority: str) -> str:
    if histogram is None:
        return "n/a"  # the gateway does not export it: never a made-up 0
    mean_s = histogram.get(priority, {}).get("mean_s")
    return "none" if mean_s is None else f"{mean_s:.3f}"


def _wait_cell(result: dict[str, Any]) -> str:
    """Per class, the predicted and the actual mean queue wait in seconds."""
    seen = result.get("gateway")
    if seen is None:
        return "-"
    predicted, actual = seen["predicted_wait"], seen["queue_wait"]
    return ", ".join(
        f"{priority} {_mean_cell(predicted, priority)} / {_mean_cell(actual, priority)}"
        for priority in ("high", "low")
    )


def describe(scenario: Scenario) -> str:
    phases = " -> ".join(f"{p.load:g}x {p.duration_s:g}s" for p in scenario.phases)
    high_ms, low_ms = scenario.deadlines_ms
    return (
        f"{scenario.slots} slots x {scenario.service_ms:g} ms {scenario.service_dist} "
        f"({scenario.capacity_rps:g} rps); {phases}; deadlines {high_ms}/{low_ms} ms, queue-wait limits "
        f"{scenario.wait_limit_ms(high_ms):g}/{scenario.wait_limit_ms(low_ms):g} ms"
        + (f"; up to {scenario.retries} retries as advised" if scenario.retries else "")
    )


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


MAIN_COLUMNS = (
    "target", "requests", "goodput/s", "vs HAProxy", "steady goodput/s", "refused",
    "of them HAProxy served in time", "expired of admitted", "high p99 ms", "vs HAProxy",
    "refusal p99 ms (at arrival)", "vs floor", "wait predicted / actual, mean s", "backend busy",
)  # fmt: skip
RETRY_COLUMNS = (
    "target", "refused at first", "admitted on 1st retry", "served on 1st retry", "retries per refused",
    "refused, served in the end", "never served", "each burst served", "abandoned at horizon",
    "retries the gateway counted",
)  # fmt: skip


def _main_row(r: dict[str, Any]) -> str:
    if "error" in r:
        return _row([r["target"], f"error: {r['error']}"])
    refused_in_time = r.get("refused_haproxy_in_time")
    return _row(
        [
            r["target"],
            r["requests"],
            _f(r["goodput_rps"]),
            _f(r.get("goodput_vs_haproxy"), ".3f", "x"),
            _f(r["steady_goodput_rps"]),
            _f(r["refused_share"], ".2%"),
            "-" if refused_in_time is None else refused_in_time,
            _f(r["expired_of_admitted"], ".2%"),
            _f(r["high_p99_ms"]),
            _f(r.get("high_p99_vs_haproxy"), ".2f", "x"),
            f"{_f(r['refusal_p99_ms'])} ({_f(r['arrival_refusal_p99_ms'])})",
            _f(r.get("refusal_p99_vs_floor"), ".2f", "x"),
            _wait_cell(r),
            _f(r["backend_busy"], ".1%"),
        ]
    )


def _count(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def _retry_row(r: dict[str, Any]) -> str:
    seen = r.get("gateway")
    counted = "-" if seen is None else _count(seen["retries_counted"])
    return _row(
        [
            r["target"],
            r["refused_first"],
            _f(r["first_retry_admitted"], ".1%"),
            _f(r["first_retry_served"], ".1%"),
            _f(r["retries_per_refused"], ".2f"),
            _f(r["refused_served_in_the_end"], ".1%"),
            _f(r["never_served"], ".1%"),
            ", ".join(_f(share, ".0%") for share in r["burst_served"]),
            r["abandoned"],
            counted,
        ]
    )


def tables(scenario: Scenario, results: list[dict[str, Any]]) -> str:
    rows = [
        f"### {scenario.name}: {describe(scenario)}",
        "",
        _row(MAIN_COLUMNS),
        _row(["---"] * len(MAIN_COLUMNS)),
    ]
    rows += [_main_row(r) for r in results]
    if scenario.retries:
        rows += ["", _row(RETRY_COLUMNS), _row(["---"] * len(RETRY_COLUMNS))]
        rows += [_retry_row(r) for r in results if "error" not in r and r["target"] != "floor"]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", default="moderate,burst,long-tail,overload")
    parser.add_argument("--targets", default="haproxy,gateway", help="haproxy, gateway, redisN")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a few seconds of each scenario: a smoke run")
    parser.add_argument(
        "--gateway-python",
        default=sys.executable,
        help="the interpreter that runs the gateway targets (one with the project installed)",
    )
    args = parser.parse_args()
    groups = scenarios(args.quick)
    targets = args.targets.split(",")
    if unknown := [t for t in targets if not is_target(t)]:
        parser.error(f"unknown target(s) {', '.join(unknown)}; known: haproxy, gateway, redisN")
    if unknown := [s for s in args.scenarios.split(",") if s not in groups]:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(groups)}")
    chosen = [scenario for name in args.scenarios.split(",") for scenario in groups[name]]
    if shutil.which("haproxy") is None and ("haproxy" in targets or any(s.with_floor for s in chosen)):
        parser.error(
            "the haproxy target and the overload scenario's floor need HAProxy: apt-get install haproxy"
        )
    log_dir = Path(tempfile.mkdtemp(prefix="admission-"))
    out = Path(__file__).parent / "results" / f"admission-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    report: dict[str, Any] = {"machine": f"{os.cpu_count()} cores", "seed": args.seed, "quick": args.quick}
    report["scenarios"] = {}
    started = time.monotonic()
    for scenario in chosen:
        results: list[dict[str, Any]] = []
        verdicts: dict[str, Verdicts] = {}
        for target in [*targets, *(["floor"] if scenario.with_floor else [])]:
            try:
                result, verdicts[target] = run_one(scenario, target, log_dir, args.seed, args.gateway_python)
            except Exception as error:  # one target's failure must not lose the others' results
                result = {"target": target, "error": f"{type(error).__name__}: {str(error)[:300]}"}
            results.append(result)
        compare(results, verdicts)
        report["scenarios"][scenario.name] = {"setup": describe(scenario), "results": results}
        out.write_text(json.dumps(report, indent=1))
        print(tables(scenario, results), "\n", flush=True)
    print(f"saved {out} after {time.monotonic() - started:.0f} s (server logs in {log_dir})")


if __name__ == "__main__":
    main()
