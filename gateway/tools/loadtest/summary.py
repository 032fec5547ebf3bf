"""A run's records, summed up: what the report says per class, per tenant and over time.

Goodput within deadline counts requests served (200) no later than their deadline after their
scheduled send, retries included; a request served later still counts in `served_eventually`. As a
rate (`goodput_rps`) it counts those answered while arrivals lasted, over that time: the pool's
steady rate, not inflated by a backlog drained after the last arrival.
Fairness between tenants is Jain's index of each tenant's goodput over its fair share: the
weighted max-min share of the goodput all tenants got, capped by what each offered (a tenant
asking less than its share is fair when it gets all it asked).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gateway.tools.loadtest.workload import Scenario

if TYPE_CHECKING:  # the client and the scrape import aiohttp, which every CLI start would pay for
    from gateway.tools.loadtest.client import RequestRecord
    from gateway.tools.loadtest.scrape import Scrape

GOOD_ENOUGH = 0.95
"""The share within deadline at which an offered rate counts as sustained (a sweep's knee)."""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank percentile: the smallest value with at least q of them at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value * 1000, 3)

    mean = sum(values) / len(values) if values else None
    return {"mean": rounded(mean)} | {
        f"p{round(q * 100)}": rounded(percentile(values, q)) for q in (0.5, 0.9, 0.99)
    }


def within_deadline(record: RequestRecord, deadline_s: float) -> bool:
    return record.served and record.latency_s <= deadline_s


def group_stats(
    records: Sequence[RequestRecord], deadline_of: Callable[[int], float], duration_s: float
) -> dict[str, Any]:
    """What one group of requests (a class, a tenant, the whole run) saw."""
    sent = len(records)
    served = [r for r in records if r.served]
    good = [r for r in served if r.latency_s <= deadline_of(r.arrival.traffic)]
    finals = Counter(r.final.reason for r in records if not r.served)
    firsts = Counter(r.attempts[0].reason for r in records if r.attempts[0].status != 200)
    retried = [r for r in records if len(r.attempts) > 1]
    refused_at_once = [a.ended_s - a.sent_s for r in records for a in r.attempts if a.advised_s is not None]
    advised, actual = _advice(records)
    streamed = [r.final for r in served if r.final.first_token_s is not None]
    return {
        "sent": sent,
        "offered_rps": round(sent / duration_s, 3),
        "answered": sum(any(a.status is not None for a in r.attempts) for r in records),
        "served": len(served),
        "within_deadline": len(good),
        "goodput_rps": round(sum(r.final.ended_s <= duration_s for r in good) / duration_s, 3),
        "goodput_share": _share(len(good), sent),
        "served_eventually": _share(len(served), sent),
        "latency_ms": _ms([r.latency_s for r in served]),
        "queue_ms": _ms([r.final.queue_ms / 1000 for r in served if r.final.queue_ms is not None]),
        "upstream_ms": _ms([r.final.upstream_ms / 1000 for r in served if r.final.upstream_ms is not None]),
        "ttft_ms": _ms([a.first_token_s - a.sent_s for a in streamed if a.first_token_s is not None]),
        "itl_ms": _ms([gap for a in streamed for gap in a.token_gaps_s]),
        "refused_by_reason": {reason: _share(n, sent) for reason, n in sorted(finals.items())},
        "first_attempt_refused_by_reason": {reason: _share(n, sent) for reason, n in sorted(firsts.items())},
        "refusal_ms": _ms(refused_at_once),
        "retried": len(retried),
        "abandoned": sum(r.abandoned for r in records),
        "first_retry_admitted": _share(sum(r.attempts[1].status == 200 for r in retried), len(retried)),
        "attempts_per_served": round(sum(len(r.attempts) for r in served) / len(served), 3)
        if served
        else None,
        "advised_wait_ms": _ms(advised),
        "actual_wait_ms": _ms(actual),
    }


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _advice(records: Iterable[RequestRecord]) -> tuple[list[float], list[float]]:
    """The first advice each refused request got, and, for those served after retrying, how long
    after that refusal the attempt that was served left (the wait the advice stood for)."""
    advised: list[float] = []
    actual: list[float] = []
    for record in records:
        first = record.attempts[0]
        if first.advised_s is None:
            continue
        advised.append(first.advised_s)
        if record.served and len(record.attempts) > 1:
            actual.append(record.final.sent_s - first.ended_s)
    return advised, actual


def fair_shares(demand: Mapping[str, float], weights: Mapping[str, float], total: float) -> dict[str, float]:
    """Weighted max-min fair division of `total` among tenants asking `demand` (water-filling)."""
    shares = dict.fromkeys(demand, 0.0)
    open_ = {t for t, d in demand.items() if d > 0 and weights.get(t, 1.0) > 0}
    left = total
    while open_ and left > 1e-12:
        weight = sum(weights.get(t, 1.0) for t in open_)
        step = left / weight
        capped = {t for t in open_ if demand[t] - shares[t] <= step * weights.get(t, 1.0)}
        if not capped:
            for t in open_:
                shares[t] += step * weights.get(t, 1.0)
            break
        for t in capped:
            left -= demand[t] - shares[t]
            shares[t] = demand[t]
        open_ -= capped
    return shares


def jain_index(got: Mapping[str, float], fair: Mapping[str, float]) -> float | None:
    """Jain's index of got/fair over tenants with a fair share: 1 when every one gets its share."""
    ratios = [got[t] / fair[t] for t in got if fair.get(t, 0.0) > 0]
    if not ratios:
        return None
    squares = sum(x * x for x in ratios)
    return round(sum(ratios) ** 2 / (len(ratios) * squares), 4) if squares else 0.0


def summarize(
    records: Sequence[RequestRecord],
    scenario: Scenario,
    rate: float,
    duration_s: float,
    scrapes: Sequence[Scrape] = (),
) -> dict[str, Any]:
    """One run (a fixed rate, or one step of a sweep), as report.json holds it."""
    traffic = scenario.traffic

    def deadline_of(index: int) -> float:
        return traffic[index].deadline_ms / 1000

    def grouped(key: Callable[[int], str]) -> dict[str, dict[str, Any]]:
        groups: dict[str, list[RequestRecord]] = {}
        for record in records:
            groups.setdefault(key(record.arrival.traffic), []).append(record)
        return {name: group_stats(mine, deadline_of, duration_s) for name, mine in sorted(groups.items())}

    by_tenant = grouped(lambda i: traffic[i].tenant_label)
    weights = {t.tenant_label: t.weight for t in reversed(traffic)}
    good = {name: float(stats["within_deadline"]) for name, stats in by_tenant.items()}
    asked = {name: float(stats["sent"]) for name, stats in by_tenant.items()}
    fair = fair_shares(asked, weights, sum(good.values()))
    lags = [r.lag_s for r in records]
    return {
        "rate_rps": rate,
        "duration_s": duration_s,
        "overall": group_stats(records, deadline_of, duration_s),
        "by_class": grouped(lambda i: traffic[i].group),
        "by_tenant": by_tenant,
        "by_traffic": grouped(lambda i: traffic[i].name),
        "fair_goodput_by_tenant": {t: round(v, 2) for t, v in fair.items()},
        "jain_index": jain_index(good, fair),
        "generator_lag_ms": {**_ms(lags), "max": round(max(lags, default=0.0) * 1000, 3)},
        "timeline": timeline(records, deadline_of, duration_s),
        "scrapes": [
            {"t_s": round(s.t_s, 3), "source": s.source, "ok": s.ok, "values": s.values} for s in scrapes
        ],
    }


def timeline(
    records: Sequence[RequestRecord], deadline_of: Callable[[int], float], duration_s: float
) -> list[dict[str, Any]]:
    """Per second of scheduled sends: sent, within deadline, late, refused at the first attempt,
    refused in the end by reason, and the mean advice given and waited."""
    seconds = max(1, math.ceil(duration_s))
    rows: list[dict[str, Any]] = [
        {
            "t_s": s,
            "sent": 0,
            "within_deadline": 0,
            "late": 0,
            "refused_first": 0,
            "refused": Counter(),
            "advised": [],
            "actual": [],
        }
        for s in range(seconds)
    ]
    for record in records:
        row = rows[min(seconds - 1, int(record.arrival.at_s))]
        row["sent"] += 1
        if record.served:
            row[
                "within_deadline" if within_deadline(record, deadline_of(record.arrival.traffic)) else "late"
            ] += 1
        else:
            row["refused"][record.final.reason] += 1
        first = record.attempts[0]
        row["refused_first"] += first.status != 200
        if first.advised_s is not None:
            row["advised"].append(first.advised_s)
            if record.served and len(record.attempts) > 1:
                row["actual"].append(record.final.sent_s - first.ended_s)
    for row in rows:
        row["refused"] = dict(row["refused"])
        for name in ("advised", "actual"):
            values = row.pop(name)
            row[f"{name}_wait_ms"] = round(1000 * sum(values) / len(values), 1) if values else None
    return rows


def knee(steps: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """A sweep's capacity: the most goodput within deadline any step reached (the plateau past
    saturation), and the highest offered rate still served within deadline at GOOD_ENOUGH."""
    goodputs = [step["overall"]["goodput_rps"] for step in steps]
    sustained = [
        step["overall"]["offered_rps"]
        for step in steps
        if (step["overall"]["goodput_share"] or 0.0) >= GOOD_ENOUGH
    ]
    return {
        "max_sustainable_rps": max(goodputs, default=None),
        "knee_offered_rps": max(sustained, default=None),
    }
