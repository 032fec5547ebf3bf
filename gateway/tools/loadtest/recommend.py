"""`--recommend`: config values for a target SLO from what a run measured, with the effect they predict.

From the run: the service time (Server-Timing's `upstream`: its mean, coefficient of variation and
p99) and the pool's slots per backend (the gateway's `gateway_backend_slots`, or given). For a target
arrival rate and a share of each class's requests to serve within its deadline (`--slo-share`):

- each class's `max_wait_ms`: its deadline less the p99 service time. A request that waited longer
  would be late whatever followed, so admission should not take it on.
- `replicas`: the fewest backends whose M/G/c estimate (policies.capacity) keeps the whole load
  under the utilization ceiling and P(wait > max_wait) within 1 - share for every class. The whole
  load, for every class: conservative, as strict priority gives urgent classes shorter waits.
- the most urgent class's `reserved_slots`: the fewest slots on which its own load alone meets its
  SLO, so that a flood of others cannot take them.

The prediction (each class's share within deadline, its p99 queue wait) is saved with the values;
a later run given it (`--compare`) reports the prediction beside what it measured.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.tools.loadtest.summary import percentile
from gateway.tools.loadtest.workload import Scenario
from policies.capacity import WaitEstimate, mgc

if TYPE_CHECKING:  # its client imports aiohttp, which every CLI start would pay for
    from gateway.tools.loadtest.client import RequestRecord

MAX_REPLICAS = 10_000
SERVICE_TAIL = 0.99
"""The service-time quantile a class's max wait leaves room for."""


class RecommendError(ValueError):
    """The run cannot ground a recommendation; the message says what is missing."""


@dataclass(frozen=True, slots=True)
class Pool:
    """What the run measured of the pool."""

    backends: int
    slots_per_backend: int
    service_mean_s: float
    service_cv: float
    service_p99_s: float


def measured_pool(
    records: Sequence[RequestRecord], scrapes: Sequence[Mapping[str, Any]], slots_per_backend: int | None
) -> Pool:
    """The service time from the answers' Server-Timing, the slots from the last scrape of the gateway."""
    service = [r.final.upstream_ms / 1000 for r in records if r.served and r.final.upstream_ms is not None]
    if len(service) < 20:
        raise RecommendError("needs at least 20 answers with Server-Timing (the gateway's `upstream`)")
    slots = _slots_by_backend(scrapes)
    if slots_per_backend is not None:
        backends, per_backend = max(1, len(slots)), slots_per_backend
    elif slots:
        backends, per_backend = len(slots), max(1, round(sum(slots.values()) / len(slots)))
    else:
        raise RecommendError(
            "needs the gateway's /metrics (gateway_backend_slots): --gateway-metrics URL where it is served "
            "apart (admin_listen), or --slots-per-backend"
        )
    mean = statistics.fmean(service)
    cv = statistics.pstdev(service) / mean if mean > 0 else 0.0
    p99 = percentile(service, SERVICE_TAIL)
    assert p99 is not None
    return Pool(backends, per_backend, mean, cv, p99)


def _slots_by_backend(scrapes: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Backend -> its slots, at the last scrape of the gateway (as report.json holds scrapes)."""
    for scrape in reversed(scrapes):
        if scrape["source"] == "gateway" and scrape["ok"]:
            values: Mapping[str, float] = scrape["values"]
            return {
                name: value for name, value in values.items() if name.startswith("gateway_backend_slots{")
            }
    return {}


def recommend(
    pool: Pool, scenario: Scenario, rate: float, target_rate: float, slo_share: float, ceiling: float
) -> dict[str, Any]:
    """The values for `target_rate` requests per second in the scenario's mix (its shares at `rate`)."""
    classes = _classes(scenario, rate)
    service_rate = 1.0 / pool.service_mean_s
    max_wait = {name: deadline - pool.service_p99_s for name, (deadline, _) in classes.items()}
    hopeless = sorted(name for name, wait in max_wait.items() if wait <= 0)
    if hopeless:
        raise RecommendError(
            f"class(es) {', '.join(hopeless)}: the deadline is below the p99 service time "
            f"({pool.service_p99_s * 1000:.0f} ms); no config meets it"
        )
    allowed = 1.0 - slo_share
    replicas, estimate = 0, None
    for replicas in range(1, MAX_REPLICAS + 1):
        estimate = mgc(target_rate, service_rate, replicas * pool.slots_per_backend, pool.service_cv)
        if estimate.utilization <= ceiling and all(
            estimate.wait_exceeded(wait) <= allowed for wait in max_wait.values()
        ):
            break
    assert estimate is not None
    urgent = min(classes, key=lambda name: classes[name][0])
    recommended: dict[str, Any] = {
        "target_rate_rps": target_rate,
        "slo_share": slo_share,
        "max_utilization": ceiling,
        "measured": {
            "service_mean_ms": round(pool.service_mean_s * 1000, 3),
            "service_cv": round(pool.service_cv, 3),
            "service_p99_ms": round(pool.service_p99_s * 1000, 3),
            "backends": pool.backends,
            "slots_per_backend": pool.slots_per_backend,
        },
        "replicas": replicas,
        "classes": {
            name: {
                "max_wait_ms": math.floor(max_wait[name] * 1000),
                "deadline_ms": round(deadline * 1000, 3),
                "rate_rps": round(share * target_rate, 3),
                **_predicted(estimate, max_wait[name]),
            }
            for name, (deadline, share) in classes.items()
        },
    }
    if len(classes) > 1:
        urgent_rate = classes[urgent][1] * target_rate
        recommended["classes"][urgent]["reserved_slots"] = _reserved(
            urgent_rate,
            service_rate,
            pool.service_cv,
            max_wait[urgent],
            allowed,
            replicas * pool.slots_per_backend,
        )
    return recommended


def _classes(scenario: Scenario, rate: float) -> dict[str, tuple[float, float]]:
    """Class -> (its tightest deadline in seconds, its share of the arrivals)."""
    rates = scenario.rates(rate)
    total = sum(rates)
    classes: dict[str, tuple[float, float]] = {}
    for traffic, entry_rate in zip(scenario.traffic, rates, strict=True):
        deadline, share = classes.get(traffic.group, (math.inf, 0.0))
        classes[traffic.group] = (min(deadline, traffic.deadline_ms / 1000), share + entry_rate / total)
    return classes


def _predicted(estimate: WaitEstimate, max_wait_s: float) -> dict[str, float]:
    """A class's share within deadline: it neither waits past its max wait nor meets a service time
    past the p99 its max wait leaves room for; and its p99 queue wait."""
    within = (1.0 - estimate.wait_exceeded(max_wait_s)) * SERVICE_TAIL
    return {
        "predicted_within_deadline": round(within, 4),
        "predicted_queue_p99_ms": round(estimate.wait_percentile(0.99) * 1000, 3),
    }


def _reserved(
    rate: float, service_rate: float, cv: float, max_wait_s: float, allowed: float, slots: int
) -> int:
    """The fewest slots on which the class's own load meets its SLO (at most the pool's)."""
    if rate <= 0:
        return 0
    for reserved in range(1, slots + 1):
        estimate = mgc(rate, service_rate, reserved, cv)
        if estimate.stable and estimate.wait_exceeded(max_wait_s) <= allowed:
            return reserved
    return slots


def compare(recommended: Mapping[str, Any], run: Mapping[str, Any]) -> dict[str, Any]:
    """Each class's predicted share within deadline and p99 queue wait beside this run's."""
    rows = {}
    for name, predicted in recommended["classes"].items():
        measured = run["by_class"].get(name)
        if measured is None:
            continue
        rows[name] = {
            "predicted_within_deadline": predicted["predicted_within_deadline"],
            "measured_within_deadline": measured["goodput_share"],
            "predicted_queue_p99_ms": predicted["predicted_queue_p99_ms"],
            "measured_queue_p99_ms": measured["queue_ms"]["p99"],
        }
    return {
        "target_rate_rps": recommended["target_rate_rps"],
        "offered_rps": run["rate_rps"],
        "classes": rows,
    }


def config_snippet(recommended: Mapping[str, Any], model: str) -> str:
    """The values as the gateway's YAML config writes them."""
    lines = ["priorities:"]
    for name, values in recommended["classes"].items():
        default = (
            "  # requests sent without X-Priority: name your default_priority" if name == "default" else ""
        )
        lines.append(f"  - name: {name}{default}")
        lines.append(f"    max_wait_ms: {values['max_wait_ms']}")
        if values.get("reserved_slots"):
            lines.append(f"    reserved_slots: {values['reserved_slots']}")
    measured = recommended["measured"]
    lines += [
        "models:",
        f"  - name: {model}",
        f"    backends:  # {recommended['replicas']} of them, "
        f"max_concurrency: {measured['slots_per_backend']} each",
    ]
    return "\n".join(lines)
