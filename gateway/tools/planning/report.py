"""The plan as people read it (a table, three answers and a legend) and as machines do (JSON)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from typing import Any

from gateway.tools.planning.plan import MAX_REPLICAS, Plan, Scenario
from policies.capacity import WaitEstimate


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data: times in `units.time`, rates per that unit, null for unbounded."""
    workload, targets, recommendation, burst = plan.workload, plan.targets, plan.recommendation, plan.burst
    trace = plan.trace
    data: dict[str, Any] = _null_for_unbounded(
        {
            "model": plan.model,
            "units": {"time": plan.unit, "rate": f"per {plan.unit}"},
            "inputs": {
                "arrival_rate": workload.arrival_rate,
                "service_time": workload.service_time,
                "service_rate": workload.service_rate,
                "service_cv": workload.service_cv,
                "slots_per_replica": plan.slots_per_replica,
                "target_mean_wait": targets.mean_wait,
                "target_p_wait": targets.p_wait,
                "max_utilization": targets.max_utilization,
                "percentile": plan.percentile,
                "current_replicas": plan.current,
                "trace": None
                if trace is None
                else {
                    "path": trace.path,
                    "requests": trace.requests,
                    "span_s": trace.span_s,
                    "arrival_cv": trace.arrival_cv,
                },
            },
            "recommendation": {
                **_scenario_json(plan, Scenario(recommendation.replicas, recommendation.estimate)),
                "bound_by": recommendation.bound_by,
                "met": recommendation.met,
            },
            "table": [
                {**_scenario_json(plan, row), "recommended": row.replicas == recommendation.replicas}
                for row in plan.rows
            ],
            "growth": {
                "factor": plan.growth,
                "before": _scenario_json(plan, plan.before),
                "after": _scenario_json(plan, plan.after),
            },
            "burst": {
                "interpretation": "burst_replicas replicas' worth of extra arrivals on the same replicas",
                "burst_replicas": burst.replicas,
                "extra_arrival_rate": burst.extra_arrival_rate,
                "during": _scenario_json(plan, burst.during),
                "backlog_growth_rate": burst.backlog_growth_rate,
                "drain_rate_after": burst.drain_rate_after,
                "replicas_needed": burst.needed.replicas,
                "replicas_needed_met": burst.needed.met,
                "with_added_replicas": _scenario_json(plan, burst.with_added),
            },
        }
    )
    return data


def _scenario_json(plan: Plan, scenario: Scenario) -> dict[str, Any]:
    estimate = scenario.estimate
    return {
        "replicas": scenario.replicas,
        "slots": estimate.servers,
        "utilization": estimate.utilization,
        "p_wait": estimate.p_wait,
        "mean_wait": estimate.mean_wait,
        "percentile_wait": estimate.wait_percentile(plan.percentile / 100),
    }


def _null_for_unbounded(value: Any) -> Any:
    """JSON has no infinity: an unbounded wait (or an overflowing rate) becomes null."""
    if isinstance(value, dict):
        return {key: _null_for_unbounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_null_for_unbounded(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def render(plan: Plan) -> str:
    """The plan for people: inputs, a table of replica counts, the three answers and a legend."""
    workload, unit = plan.workload, plan.unit
    lines = [
        f"Capacity plan, {plan.model}",
        f"  arrivals {_num(workload.arrival_rate)} per {unit}; service {_num(workload.service_time)} {unit} "
        f"per request ({_num(workload.service_rate)} per {unit} per slot), cv {_num(workload.service_cv)}; "
        f"{plan.slots_per_replica} slot(s) per replica",
        f"  offered load: {_num(workload.arrival_rate * workload.service_time)} slots busy on average",
    ]
    if plan.trace is not None:
        trace = plan.trace
        lines.append(
            f"  estimated from {trace.path}: {trace.requests} requests over {_num(trace.span_s)} s; "
            f"arrival gaps cv {_num(trace.arrival_cv)} (the model assumes Poisson arrivals, cv 1)"
        )
    lines += ["", *_table(plan), "", *_answers(plan), "", *_legend(plan)]
    return "\n".join(lines)


def _table(plan: Plan) -> list[str]:
    header = [
        "replicas",
        "slots",
        "utilization",
        "P(wait)",
        f"mean wait ({plan.unit})",
        f"{plan.pct_label} wait ({plan.unit})",
    ]
    marks = {plan.recommendation.replicas: ["recommended"]}
    if plan.current is not None:
        marks.setdefault(plan.current, []).append("current")
    marks.setdefault(plan.after.replicas, []).append(f"x{plan.growth:g}")
    cells = [
        [
            str(row.replicas),
            str(row.estimate.servers),
            _percent(row.estimate.utilization),
            _percent(row.estimate.p_wait),
            _num(row.estimate.mean_wait),
            _num(row.estimate.wait_percentile(plan.percentile / 100)),
        ]
        for row in plan.rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    lines = ["  " + "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    for row, cell in zip(plan.rows, cells, strict=True):
        note = f"  <- {', '.join(marks[row.replicas])}" if row.replicas in marks else ""
        pointer = ">" if row.replicas == plan.recommendation.replicas else " "
        lines.append(pointer + " " + "  ".join(c.rjust(w) for c, w in zip(cell, widths, strict=True)) + note)
    return lines


def _answers(plan: Plan) -> list[str]:
    paragraphs = [_replicas_answer(plan), _growth_answer(plan), _burst_answer(plan)]
    return [textwrap.fill(p, width=100, subsequent_indent="    ", break_on_hyphens=False) for p in paragraphs]


def _replicas_answer(plan: Plan) -> str:
    targets, rec = plan.targets, plan.recommendation
    wanted = []
    if targets.mean_wait is not None:
        wanted.append(f"mean wait <= {_num(targets.mean_wait)} {plan.unit}")
    if targets.p_wait is not None:
        wanted.append(f"P(wait) <= {_percent(targets.p_wait)}")
    wanted.append(f"utilization <= {_percent(targets.max_utilization)}")
    return (
        f"(a) Replicas for {' and '.join(wanted)}: {rec.replicas} ({rec.estimate.servers} slots): "
        f"{_summary(plan, rec.estimate)}. {_why(plan)}"
    )


def _growth_answer(plan: Plan) -> str:
    was, becomes = plan.before.estimate, plan.after.estimate

    def change(what: str, show: Callable[[float], str], before: float, after: float) -> str:
        return f"{what} {show(before)} -> {show(after)}"

    changes = [
        change("utilization", _percent, was.utilization, becomes.utilization),
        change("P(wait)", _percent, was.p_wait, becomes.p_wait),
        change("mean wait", _num, was.mean_wait, becomes.mean_wait) + f" {plan.unit}",
        change(f"{plan.pct_label} wait", _num, _p(plan, was), _p(plan, becomes)) + f" {plan.unit}",
    ]
    return (
        f"(b) Capacity x{plan.growth:g}, {_base(plan)} {plan.before.replicas} -> {plan.after.replicas} "
        f"replicas (rounded up): {', '.join(changes)}."
    )


def _burst_answer(plan: Plan) -> str:
    burst, unit, base = plan.burst, plan.unit, _base(plan)
    per_unit = f"per {unit}"
    total = plan.workload.arrival_rate + burst.extra_arrival_rate
    slot_rate = f"{_num(plan.workload.service_rate)} {per_unit}"
    size = (
        f"{burst.replicas} x {plan.slots_per_replica} slot(s) x {slot_rate} "
        f"= {_num(burst.extra_arrival_rate)} {per_unit} more, {_num(total)} {per_unit} in all"
    )
    during = burst.during.estimate
    if during.stable:
        effect = f"absorbed: {_summary(plan, during)} while it lasts."
    else:
        afterwards = (
            f"drains at {_num(burst.drain_rate_after)} {per_unit} once it ends"
            if burst.drain_rate_after > 0
            else "never drains: the pool is overloaded even without the burst"
        )
        effect = (
            f"utilization {_percent(during.utilization)}, no steady state: the backlog grows by "
            f"{_num(burst.backlog_growth_rate)} requests {per_unit} while it lasts and {afterwards}."
        )
    needed = burst.needed
    limit = "" if needed.met else f" (the limit: even {MAX_REPLICAS} miss the targets)"
    extra_needed = needed.replicas - burst.during.replicas
    added = burst.with_added
    return (
        f"(c) A {burst.replicas}-GPU burst, read as {burst.replicas} replicas' worth of extra arrivals "
        f"({size}) on the {base} {burst.during.replicas} replicas: {effect} Meeting the targets through it "
        f"takes {needed.replicas} replicas{limit}, {extra_needed:+d} on the {base} count. Read instead as "
        f"{burst.replicas} replicas added ({added.replicas}): {_summary(plan, added.estimate)}."
    )


def _base(plan: Plan) -> str:
    return "current" if plan.current is not None else "recommended"


def _why(plan: Plan) -> str:
    rec, fewer = plan.recommendation, plan.one_fewer
    if not rec.met:
        return f"No count up to {MAX_REPLICAS} replicas meets the targets; this is the limit."
    if fewer is None or rec.bound_by == "minimum":
        return "One replica is enough."
    estimate = fewer.estimate
    if rec.bound_by == "utilization":
        return (
            f"{_replicas(fewer.replicas)} would be {_percent(estimate.utilization)} busy, over the ceiling."
        )
    if rec.bound_by == "mean_wait":
        return f"{_replicas(fewer.replicas)} would wait {_num(estimate.mean_wait)} {plan.unit} on average."
    return f"{_replicas(fewer.replicas)} would make {_percent(estimate.p_wait)} of requests wait."


def _replicas(count: int) -> str:
    return f"{count} replica" if count == 1 else f"{count} replicas"


def _legend(plan: Plan) -> list[str]:
    plain = plan.workload.service_cv == 1.0
    stretch = "" if plain else f" x (1 + cv^2)/2 = {_num(plan.stretch)}"
    tail = "" if plain else f" / {_num(plan.stretch)}"
    lines = [
        "How to read this:",
        f"  model        {plan.model}",
        "               Poisson arrivals; servers = replicas x slots per replica, each serving",
        "               1 / service time requests per unit of time.",
        "  utilization  arrival rate / (servers x service rate); 100% or more has no steady state:",
        "               the queue grows without bound and waits read 'inf'.",
        "  P(wait)      Erlang C: the share of requests that find every slot busy and queue in the gateway.",
        f"  mean wait    Erlang C / (servers x service rate - arrival rate){stretch}: time in the queue",
        f"               before service starts, in {plan.unit} (service time comes on top).",
        f"  {plan.pct_label + ' wait':<12} the wait that {plan.percentile:g}% of requests stay under: "
        "P(wait > t) = P(wait) x",
        f"               exp(-t x (servers x service rate - arrival rate){tail}); "
        f"0 when no more than {100 - plan.percentile:g}% wait.",
    ]
    if stretch:
        lines += [
            "  cv           the service time's std deviation / mean. Allen-Cunneen scales the M/M/c wait",
            "               by (1 + cv^2)/2: exact for one slot (Pollaczek-Khinchine), approximate for more;",
            "               the percentile stretches the M/M/c exponential tail to that mean (approximate).",
        ]
    return lines


def _summary(plan: Plan, estimate: WaitEstimate) -> str:
    wait = f"mean wait {_num(estimate.mean_wait)} {plan.unit}"
    tail = f"{plan.pct_label} wait {_num(_p(plan, estimate))} {plan.unit}"
    return (
        f"utilization {_percent(estimate.utilization)}, P(wait) {_percent(estimate.p_wait)}, {wait}, {tail}"
    )


def _p(plan: Plan, estimate: WaitEstimate) -> float:
    return estimate.wait_percentile(plan.percentile / 100)


def _num(value: float) -> str:
    if math.isinf(value):
        return "inf"
    if value == 0:
        return "0"
    # Whole numbers from 1000 up read better than 1.019e+04; tiny waits keep their exponent.
    return f"{value:.0f}" if 1000 <= abs(value) < 1e15 else f"{value:.4g}"


def _percent(share: float) -> str:
    if share == 0:
        return "0%"
    return "<0.1%" if share < 0.001 else f"{share * 100:.1f}%"
