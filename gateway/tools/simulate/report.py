"""What a simulated run shows: queue waits, goodput and work shares per class and tenant.

Rules this module keeps:
- Every figure covers the measured part of the run only (after the warm-up, up to the horizon).
- Percentiles interpolate linearly between the closest ranks (numpy's default), over the waits of
  the served requests; with none served there is no wait to show (None, printed as "-").
- A tenant's work share is its share of the work handed slots in its band (what fair queuing
  splits by weight); its weight share is its weight over the weights of the band's tenants that
  were handed work or asked for it. The tenants' table gives each one's share of all work handed.
- Goodput counts the served requests done within their class's deadline (all served requests
  when the class has none), per second of the measured window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.tools.simulate.tally import FlowTally, Run

ALL_TENANTS = "(all)"


@dataclass(frozen=True, slots=True)
class Waits:
    mean_s: float
    p50_s: float
    p95_s: float
    p99_s: float


@dataclass(frozen=True, slots=True)
class FlowSummary:
    """One (class, tenant) flow, or a whole class with tenant ALL_TENANTS."""

    class_name: str
    tenant: str
    weight: float | None
    arrived: int
    served: int
    refused: int
    expired: int
    displaced: int
    on_time: int
    waits: Waits | None
    retry_after: Waits | None
    """The Retry-After told those refused at arrival."""
    goodput_per_s: float
    handed_work: float
    work_share: float
    """Of the work its band handed over (1 for a whole class)."""
    weight_share: float | None


@dataclass(frozen=True, slots=True)
class TenantShare:
    tenant: str
    weight: float
    handed_work: float
    share: float
    """Of all work handed over, every band together."""


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    slots: int
    window_s: float
    utilization: float
    """Slot time handed out in the window over the slots' time (can pass 1 by the last hand-overs'
    service running past the end)."""
    left_queued: int
    flows: tuple[FlowSummary, ...]
    """Per class, most urgent first: each tenant's flow, then the class as a whole."""
    tenants: tuple[TenantShare, ...]


def percentile(ordered: Sequence[float], q: float) -> float:
    """The `q` quantile (0..1) of `ordered` (sorted, not empty), interpolating between ranks."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def waits_of(waits_s: Sequence[float]) -> Waits | None:
    if not waits_s:
        return None
    ordered = sorted(waits_s)
    mean = math.fsum(ordered) / len(ordered)
    return Waits(mean, percentile(ordered, 0.5), percentile(ordered, 0.95), percentile(ordered, 0.99))


def summarize(run: Run, class_names: Sequence[str], weights: Mapping[str, float], slots: int) -> Summary:
    """The figures of `run`; bands index `class_names`; a tenant not in `weights` has weight 1."""
    window_s = run.measured_to_s - run.measured_from_s
    rows: list[FlowSummary] = []
    for band, class_name in enumerate(class_names):
        flows = sorted(((t, tally) for (b, t), tally in run.tallies.items() if b == band), key=lambda f: f[0])
        band_work = sum(tally.handed_work for _, tally in flows)
        active = {tenant for tenant, tally in flows if tally.handed_work > 0 or tally.arrived > 0}
        band_weight = sum(weights.get(tenant, 1.0) for tenant in active)
        for tenant, tally in flows:
            weight = weights.get(tenant, 1.0)
            weight_share = weight / band_weight if tenant in active else None
            rows.append(_row(class_name, tenant, weight, [tally], band_work, weight_share, window_s))
        if len(flows) > 1:
            tallies = [tally for _, tally in flows]
            rows.append(_row(class_name, ALL_TENANTS, None, tallies, band_work, None, window_s))
    handed: dict[str, float] = {}
    for (_, tenant), tally in run.tallies.items():
        handed[tenant] = handed.get(tenant, 0.0) + tally.handed_work
    total = sum(handed.values())
    tenants = tuple(
        TenantShare(tenant, weights.get(tenant, 1.0), work, work / total if total else 0.0)
        for tenant, work in sorted(handed.items())
    )
    busy_s = sum(tally.busy_s for tally in run.tallies.values())
    utilization = busy_s / (slots * window_s) if window_s > 0 else 0.0
    return Summary(run.requests, slots, window_s, utilization, run.left_queued, tuple(rows), tenants)


def _row(
    class_name: str,
    tenant: str,
    weight: float | None,
    tallies: list[FlowTally],
    band_work: float,
    weight_share: float | None,
    window_s: float,
) -> FlowSummary:
    on_time = sum(t.on_time for t in tallies)
    handed = sum(t.handed_work for t in tallies)
    waits = tallies[0].waits_s if len(tallies) == 1 else [w for t in tallies for w in t.waits_s]
    return FlowSummary(
        class_name=class_name,
        tenant=tenant,
        weight=weight,
        arrived=sum(t.arrived for t in tallies),
        served=sum(t.served for t in tallies),
        refused=sum(t.refused for t in tallies),
        expired=sum(t.expired for t in tallies),
        displaced=sum(t.displaced for t in tallies),
        on_time=on_time,
        waits=waits_of(waits),
        retry_after=waits_of([r for t in tallies for r in t.retry_after_s]),
        goodput_per_s=on_time / window_s if window_s > 0 else 0.0,
        handed_work=handed,
        work_share=handed / band_work if band_work else 0.0,
        weight_share=weight_share,
    )


_HEADER = (
    "class", "tenant", "weight", "arrived", "served", "refused", "expired", "displaced",
    "mean ms", "p50 ms", "p95 ms", "p99 ms", "retry-after p50 ms",
    "goodput/s", "on time", "work share", "weight share",
)  # fmt: skip


def render(summary: Summary) -> str:
    """The summary as a table people read."""
    lines = [
        f"simulated {summary.requests} requests on {summary.slots} slot(s); measured window "
        f"{summary.window_s:.3f} s, utilization {summary.utilization:.1%}, "
        f"{summary.left_queued} left queued at the end",
        "",
    ]
    table = [list(_HEADER)] + [_cells(row) for row in summary.flows]
    widths = [max(len(row[i]) for row in table) for i in range(len(_HEADER))]
    lines += [
        "  ".join(
            cell.ljust(width) if column < 2 else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in table
    ]
    lines += ["", "work handed over, all classes:"]
    lines += [
        f"  {t.tenant}: weight {t.weight:g}, {t.handed_work:g} work units, {t.share:.1%}"
        for t in summary.tenants
    ]
    lines.append("(waits are queue waits, before a slot; work share is of the band's work handed over)")
    return "\n".join(lines)


def _cells(row: FlowSummary) -> list[str]:
    waits = row.waits
    times = (
        ["-"] * 4
        if waits is None
        else [f"{1000 * s:.1f}" for s in (waits.mean_s, waits.p50_s, waits.p95_s, waits.p99_s)]
    )
    on_time = f"{row.on_time / row.served:.1%}" if row.served else "-"
    return [
        row.class_name,
        row.tenant,
        "" if row.weight is None else f"{row.weight:g}",
        str(row.arrived),
        str(row.served),
        str(row.refused),
        str(row.expired),
        str(row.displaced),
        *times,
        "-" if row.retry_after is None else f"{1000 * row.retry_after.p50_s:.0f}",
        f"{row.goodput_per_s:.2f}",
        on_time,
        f"{row.work_share:.1%}",
        "" if row.weight_share is None else f"{row.weight_share:.1%}",
    ]


def summary_json(summary: Summary) -> dict[str, Any]:
    """The summary as JSON-ready data, times in seconds."""
    return {
        "requests": summary.requests,
        "slots": summary.slots,
        "window_s": summary.window_s,
        "utilization": summary.utilization,
        "left_queued": summary.left_queued,
        "flows": [
            {
                "class": row.class_name,
                "tenant": row.tenant,
                "weight": row.weight,
                "arrived": row.arrived,
                "served": row.served,
                "refused": row.refused,
                "expired": row.expired,
                "displaced": row.displaced,
                "on_time": row.on_time,
                "wait_s": _percentiles(row.waits),
                "retry_after_s": _percentiles(row.retry_after),
                "goodput_per_s": row.goodput_per_s,
                "handed_work": row.handed_work,
                "work_share": row.work_share,
                "weight_share": row.weight_share,
            }
            for row in summary.flows
        ],
        "tenants": [
            {"tenant": t.tenant, "weight": t.weight, "handed_work": t.handed_work, "share": t.share}
            for t in summary.tenants
        ],
    }


def _percentiles(waits: Waits | None) -> dict[str, float] | None:
    if waits is None:
        return None
    return {"mean": waits.mean_s, "p50": waits.p50_s, "p95": waits.p95_s, "p99": waits.p99_s}
