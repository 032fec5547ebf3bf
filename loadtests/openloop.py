"""Open-loop Poisson load: requests leave on a fixed schedule whatever the answers do. The
benchmarks' face of the one load generator, `inference-gateway loadtest`'s (gateway/tools/loadtest/).

Latency is measured from each request's scheduled time, not from when it was actually sent, so a
slow client or server cannot hide queueing (no coordinated omission). The same seed gives the
same arrival sequence for every target, so targets are compared on identical load.

    python -m loadtests.openloop --url http://127.0.0.1:8080 --rate 200 --duration 10
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from gateway.tools.loadtest import client
from gateway.tools.loadtest.client import run_fast as run_fast  # the benchmarks import it here
from gateway.tools.loadtest.requests import Prepared
from gateway.tools.loadtest.workload import Arrival as KitArrival
from gateway.tools.loadtest.workload import Scenario, Traffic, arrivals

INFER_PATH = "/v2/models/sim/infer"
INFER_BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
).encode()


@dataclass(frozen=True, slots=True)
class TrafficClass:
    priority: str
    share: float
    deadline_ms: int


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    priority: str
    deadline_ms: int


@dataclass(slots=True)
class Outcome:
    arrival: Arrival
    status: int | None  # None: no answer (timeout or connection error)
    latency_s: float
    retry_after: bool = False
    error: str | None = None
    expired_in_queue: bool = False
    """A refusal after waiting in the queue (see `expired_in_queue`)."""


_EXPIRED_IN_QUEUE = b'"deadline_expired_in_queue"'
_HAPROXY_QUEUE_TIMEOUT = client.NO_SERVER
_WAITED_REASONS = frozenset({"deadline_expired_in_queue", "no_server_available"})
"""The kit's reasons for a refusal after a wait (see `expired_in_queue`)."""


def expired_in_queue(status: int, body: bytes) -> bool:
    """Whether an answer is a refusal after a wait in the queue rather than at arrival: the
    gateway's `deadline_expired_in_queue`, or HAProxy's queue timeout (its 503, which it also
    sends with no server up: the benchmarks' backend always is)."""
    if status == 429:
        return _EXPIRED_IN_QUEUE in body
    return status == 503 and _HAPROXY_QUEUE_TIMEOUT in body


MIX = (TrafficClass("high", 0.2, 250), TrafficClass("low", 0.8, 1000))


def poisson_schedule(
    rate_rps: float, duration_s: float, mix: Sequence[TrafficClass] = MIX, seed: int = 1
) -> list[Arrival]:
    """Arrival times of a Poisson process at `rate_rps` for `duration_s`, each tagged with a class:
    the kit's arrivals (gateway/tools/loadtest/workload.py), one Poisson process per class."""
    scenario = Scenario(tuple(Traffic(c.priority, share=c.share, deadline_ms=c.deadline_ms) for c in mix))
    return [
        Arrival(a.at_s, mix[a.traffic].priority, mix[a.traffic].deadline_ms)
        for a in arrivals(scenario, rate_rps, duration_s, seed)
    ]


async def run(
    url: str | Sequence[str],
    schedule: Sequence[Arrival],
    *,
    path: str = INFER_PATH,
    body: bytes = INFER_BODY,
    timeout_factor: float = 3.0,
    request_for: Callable[[Arrival], tuple[bytes, dict[str, str]]] | None = None,
) -> list[Outcome]:
    """Send `schedule` to `url + path` with the kit's client (gateway/tools/loadtest/client.py); a
    request gives up after `timeout_factor` x its deadline + 1 s.

    With several URLs (gateway replicas) the requests go to them in turn, like a round-robin
    load balancer. `request_for` gives an arrival's body and headers, where they are not `body`
    and its class and deadline (X-Priority, X-Request-Timeout-Ms).
    """
    prepared = []
    for arrival in schedule:
        if request_for is None:
            data = body
            headers = {
                "Content-Type": "application/json",
                "X-Priority": arrival.priority,
                "X-Request-Timeout-Ms": str(arrival.deadline_ms),
            }
        else:
            data, headers = request_for(arrival)
        prepared.append(Prepared(path, data, headers, False, arrival.deadline_ms / 1000))
    sends = [KitArrival(a.at_s, index) for index, a in enumerate(schedule)]
    records, _ = await client.run(url, sends, prepared, timeout_factor=timeout_factor)
    return [outcome_of(schedule[record.arrival.traffic], record) for record in records]


def outcome_of(arrival: Arrival, record: client.RequestRecord) -> Outcome:
    """A kit record as the benchmarks' Outcome: its last answer, latency from the scheduled send."""
    answer = record.final
    if answer.status is None:
        return Outcome(arrival, None, record.latency_s, error=answer.reason)
    return Outcome(
        arrival,
        answer.status,
        record.latency_s,
        answer.advised_s is not None,
        expired_in_queue=answer.reason in _WAITED_REASONS,
    )


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(slots=True)
class ClassSummary:
    sent: int
    good: int
    goodput_rps: float
    steady_goodput_rps: float
    p50_ms: float | None
    p99_ms: float | None
    rejections: dict[str, int] = field(default_factory=dict)
    rejection_p50_ms: float | None = None
    rejection_p99_ms: float | None = None
    retry_after_share: float | None = None
    expired_in_queue: int = 0
    """Refusals after a wait in the queue: admissions that turned out wrong."""
    arrival_rejection_p99_ms: float | None = None
    """p99 of the other refusals: the cost of the refusal path itself."""


def summarize(
    outcomes: Sequence[Outcome], duration_s: float, warmup_s: float, cooldown_s: float
) -> dict[str, ClassSummary]:
    """Per class: goodput (200s within deadline) overall and over the steady window, latencies, refusals.

    Overall goodput divides by the time from the first arrival to the last answer (the drain after
    arrivals stop included); steady goodput counts arrivals in [warmup, duration - cooldown] only.
    """
    span_s = max(duration_s, max((o.arrival.at_s + o.latency_s for o in outcomes), default=duration_s))
    steady_s = duration_s - warmup_s - cooldown_s
    summary: dict[str, ClassSummary] = {}
    for priority in sorted({o.arrival.priority for o in outcomes}):
        mine = [o for o in outcomes if o.arrival.priority == priority]
        ok = [o for o in mine if o.status == 200]
        good = [o for o in ok if o.latency_s * 1000 <= o.arrival.deadline_ms]
        steady_good = [o for o in good if warmup_s <= o.arrival.at_s < duration_s - cooldown_s]
        refused = [o for o in mine if o.status != 200]
        rejections: dict[str, int] = {}
        for o in refused:
            key = str(o.status) if o.status is not None else (o.error or "error")
            rejections[key] = rejections.get(key, 0) + 1
        answered = [o for o in refused if o.status is not None]
        ok_ms = [o.latency_s * 1000 for o in ok]
        refused_ms = [o.latency_s * 1000 for o in answered]
        at_arrival_ms = [o.latency_s * 1000 for o in answered if not o.expired_in_queue]
        summary[priority] = ClassSummary(
            sent=len(mine),
            good=len(good),
            goodput_rps=len(good) / span_s,
            steady_goodput_rps=len(steady_good) / steady_s if steady_s > 0 else 0.0,
            p50_ms=percentile(ok_ms, 0.5),
            p99_ms=percentile(ok_ms, 0.99),
            rejections=rejections,
            rejection_p50_ms=percentile(refused_ms, 0.5),
            rejection_p99_ms=percentile(refused_ms, 0.99),
            retry_after_share=(sum(o.retry_after for o in answered) / len(answered)) if answered else None,
            expired_in_queue=sum(o.expired_in_queue for o in answered),
            arrival_rejection_p99_ms=percentile(at_arrival_ms, 0.99),
        )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", required=True)
    parser.add_argument("--rate", type=float, required=True, help="arrivals per second")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    schedule = poisson_schedule(args.rate, args.duration, seed=args.seed)
    outcomes = run_fast(run(args.url, schedule))
    for priority, stats in summarize(outcomes, args.duration, min(5.0, args.duration / 4), 1.0).items():
        print(priority, json.dumps(asdict(stats)))
    print(f"mean latency {statistics.mean(o.latency_s for o in outcomes) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
