"""`inference-gateway plan`: its arguments, read into a workload and targets, and its exit status."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gateway.programs.arguments import count, number
from gateway.tools.planning import plan as plan_module
from gateway.tools.planning.plan import MAX_REPLICAS, build_plan
from gateway.tools.planning.report import plan_json, render
from gateway.tools.planning.trace import TraceError, TraceWorkload, Workload, read_trace
from policies.capacity import Targets

UNIT_S = {"ms": 0.001, "s": 1.0, "min": 60.0, "h": 3600.0}


class PlanInputError(Exception):
    """The arguments cannot be planned from; the message says why."""


def register(commands: Any) -> None:
    """Add `plan` to the CLI's subcommands."""
    plan = commands.add_parser(
        "plan",
        help="replicas needed for a target wait, from rates or a request trace",
        description=plan_module.__doc__,
        epilog=(
            "Every time and rate is in --time-unit (a rate is per that unit). A trace is a CSV with a\n"
            "header naming arrival_s (arrival time, seconds from any origin) and service_s (how long\n"
            "the request held a slot, seconds); other columns and lines starting with # are ignored."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    given = plan.add_argument_group("workload: rates, or --trace")
    given.add_argument("--arrival-rate", type=number(0.0), help="requests per time unit, over all replicas")
    service = given.add_mutually_exclusive_group()
    service.add_argument(
        "--service-time", type=number(0.0, strict=True), help="mean time a request holds a slot"
    )
    service.add_argument(
        "--service-rate", type=number(0.0, strict=True), help="requests per time unit per slot"
    )
    given.add_argument("--cv", type=number(0.0), help="service time's std deviation / mean (default 1)")
    given.add_argument("--trace", type=Path, help="CSV with columns arrival_s, service_s in seconds")
    goal = plan.add_argument_group("targets")
    goal.add_argument("--target-wait", type=number(0.0, strict=True), help="largest mean queue wait")
    goal.add_argument("--target-p-wait", type=number(0.0, 1.0, strict=True), help="largest P(wait), 0 to 1")
    goal.add_argument(
        "--ceiling", type=number(0.0, 1.0, strict=True), default=0.8, help="utilization ceiling"
    )
    plan.add_argument(
        "--slots-per-replica", type=count(1, MAX_REPLICAS), default=1, help="concurrent requests per replica"
    )
    plan.add_argument(
        "--replicas", type=count(1, MAX_REPLICAS), help="replicas running now (default: the recommendation)"
    )
    plan.add_argument(
        "--growth", type=number(0.0, 1000.0, strict=True), default=1.5, help="capacity factor in (b)"
    )
    plan.add_argument(
        "--burst-replicas", type=count(0, MAX_REPLICAS), default=50, help="burst size in (c), in replicas"
    )
    plan.add_argument(
        "--percentile", type=number(0.0, 99.999, strict=True), default=95.0, help="wait percentile shown"
    )
    plan.add_argument("--time-unit", choices=list(UNIT_S), default="s", help="unit of every time and rate")
    plan.add_argument("--json", action="store_true", help="print JSON instead of the table")
    plan.set_defaults(command=run)


def run(args: argparse.Namespace) -> int:
    """Print the plan for the parsed arguments; exit status 2 with a message on bad input."""
    try:
        workload, trace = _workload(args)
        plan = build_plan(
            workload,
            Targets(args.target_wait, args.target_p_wait, args.ceiling),
            trace=trace,
            slots_per_replica=args.slots_per_replica,
            percentile=args.percentile,
            unit=args.time_unit,
            current=args.replicas,
            growth=args.growth,
            burst_replicas=args.burst_replicas,
        )
    except (PlanInputError, TraceError) as error:
        print(f"inference-gateway plan: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan_json(plan), indent=2, allow_nan=False) if args.json else render(plan))
    return 0


def _workload(args: argparse.Namespace) -> tuple[Workload, TraceWorkload | None]:
    rate_flags = {
        "--arrival-rate": args.arrival_rate,
        "--service-time": args.service_time,
        "--service-rate": args.service_rate,
        "--cv": args.cv,
    }
    if args.trace is not None:
        mixed = [flag for flag, value in rate_flags.items() if value is not None]
        if mixed:
            raise PlanInputError(f"--trace gives the workload; drop {', '.join(mixed)}")
        trace = read_trace(args.trace, UNIT_S[args.time_unit])
        return trace.workload, trace
    if args.arrival_rate is None:
        raise PlanInputError("give --arrival-rate and --service-time (or --service-rate), or --trace FILE")
    if args.service_time is None and args.service_rate is None:
        raise PlanInputError("give --service-time or --service-rate with --arrival-rate")
    service_time = args.service_time if args.service_time is not None else 1.0 / args.service_rate
    return Workload(args.arrival_rate, service_time, 1.0 if args.cv is None else args.cv), None
