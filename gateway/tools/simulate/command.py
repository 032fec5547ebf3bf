"""`inference-gateway simulate`: its arguments, read into a workload and a pool, and its exit status.

Classes are given most urgent first (`--class high,share=0.2,max_wait_ms=250 --class low`), tenants
with their weights and quotas (`--tenant a,weight=3,quota=4,borrowing_limit=0`); with none given
there is one class and one tenant, both "default". Arrivals are Poisson (`--rate`, `--requests`) or
a CSV trace (`--trace`, columns in gateway/tools/simulate/workload.py). Bad input is a message on stderr
and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.programs.arguments import count, number
from gateway.tools.planning.trace import TraceError
from gateway.tools.simulate.report import render, summarize, summary_json
from gateway.tools.simulate.workload import (
    SERVICE_KINDS,
    Arrival,
    ServiceModel,
    TenantMix,
    poisson_arrivals,
    read_trace,
)
from policies.quotas import Quota

if TYPE_CHECKING:
    from gateway.tools.simulate.admitting import Admission
    from gateway.tools.simulate.engine import Progress

PROGRESS_FROM = 200_000
"""Runs of at least this many requests report their progress on stderr unless told not to."""


class SimulateInputError(Exception):
    """The arguments cannot be simulated; the message says why."""


@dataclass(frozen=True, slots=True)
class ClassOption:
    name: str
    share: float = 1.0
    max_wait_ms: float | None = None
    deadline_ms: float | None = None
    reserved_slots: int = 0


@dataclass(frozen=True, slots=True)
class TenantOption:
    name: str
    weight: float = 1.0
    share: float = 1.0
    cost: float = 1.0
    quota: float | None = None
    borrowing_limit: float | None = None
    lending_limit: float | None = None

    def as_quota(self) -> Quota | None:
        if self.quota is None:
            if self.borrowing_limit is not None or self.lending_limit is not None:
                raise SimulateInputError(f"tenant {self.name}: borrowing and lending limits need a quota")
            return None
        limits = (
            math.inf if limit is None else limit for limit in (self.borrowing_limit, self.lending_limit)
        )
        return Quota(self.quota, *limits)


def add_parser(commands: Any) -> None:
    """Add `simulate` to the CLI's subcommands."""
    parser = commands.add_parser(
        "simulate",
        help="discrete-event simulation of the gateway's queues, driven by its own policies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    given = parser.add_argument_group("arrivals: Poisson (--rate, --requests) or --trace")
    given.add_argument(
        "--rate", type=number(0.0, strict=True), help="Poisson arrivals per second, all classes"
    )
    given.add_argument("--requests", type=count(1), default=100_000, help="Poisson arrivals to simulate")
    given.add_argument("--trace", type=Path, help="CSV: at_s [, class, tenant, cost, service_s]")
    service = parser.add_argument_group("service times (drawn where the trace gives none)")
    service.add_argument("--service", choices=SERVICE_KINDS, default="exponential", help="distribution")
    service.add_argument("--service-ms", type=number(0.0, strict=True), default=100.0, help="mean")
    service.add_argument("--cv", type=number(0.0), help="lognormal's std deviation / mean (default 1)")
    service.add_argument(
        "--service-per-cost",
        action="store_true",
        help="the drawn time is per work unit (cost k: k times as long)",
    )
    pool = parser.add_argument_group("pool, classes and tenants")
    pool.add_argument("--slots", type=count(1), default=1, help="execution slots")
    pool.add_argument(
        "--class",
        dest="classes",
        action="append",
        type=_spec(
            ClassOption,
            {
                "share": _SHARE,
                "max_wait_ms": _POSITIVE,
                "deadline_ms": _POSITIVE,
                "reserved_slots": count(0),
            },
        ),
        metavar="NAME[,share=S][,max_wait_ms=M][,deadline_ms=D][,reserved_slots=R]",
        help="a priority class, most urgent first; max_wait_ms turns admission on for it",
    )
    pool.add_argument(
        "--tenant",
        dest="tenants",
        action="append",
        type=_spec(
            TenantOption,
            {
                "weight": _POSITIVE,
                "share": _SHARE,
                "cost": _POSITIVE,
                "quota": _SHARE,
                "borrowing_limit": _SHARE,
                "lending_limit": _SHARE,
            },
        ),
        metavar="NAME[,weight=W][,share=S][,cost=C][,quota=Q][,borrowing_limit=B][,lending_limit=L]",
        help="a tenant: fair-share weight, share of Poisson arrivals, cost of its Poisson requests, "
        "and its quota of work in flight with Kueue's borrowing and lending limits",
    )
    run_group = parser.add_argument_group("run")
    run_group.add_argument(
        "--warmup", type=count(0), default=0, help="first requests left out of the figures"
    )
    run_group.add_argument("--until-s", type=number(0.0, strict=True), help="stop at this simulated time")
    run_group.add_argument("--seed", type=int, default=0, help="seed of every draw (default 0)")
    run_group.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        help=f"progress on stderr every 10%% (default: for runs of {PROGRESS_FROM} requests or more)",
    )
    run_group.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.set_defaults(command=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: they bring the gateway's admission, which `inference-gateway sim` and the
    # other commands need not load at start (0.3 s a process).
    from gateway.tools.simulate.engine import Band, Setup, simulate

    """Simulate the parsed arguments and print the report; exit status 2 with a message on bad input."""
    try:
        classes = tuple(args.classes or (ClassOption("default"),))
        tenants = tuple(args.tenants or (TenantOption("default"),))
        _check_unique("class", [c.name for c in classes])
        _check_unique("tenant", [t.name for t in tenants])
        service = _service(args)
        quotas = {t.name: quota for t in tenants if (quota := t.as_quota()) is not None}
        arrivals, total, admission = _workload(args, classes, tenants, service)
        if args.warmup >= total:
            raise SimulateInputError(f"--warmup {args.warmup} leaves none of the {total} requests measured")
    except (SimulateInputError, TraceError) as error:
        print(f"inference-gateway simulate: {error}", file=sys.stderr)
        return 2
    weights = {tenant.name: tenant.weight for tenant in tenants}
    bands = tuple(Band(_seconds(c.max_wait_ms), _seconds(c.deadline_ms), c.reserved_slots) for c in classes)
    setup = Setup(args.slots, bands, weights, args.warmup, args.until_s, admission, quotas)
    show = args.progress if args.progress is not None else total >= PROGRESS_FROM
    every = max(1, total // 10)
    progress = _progress(total) if show else None
    result = simulate(arrivals, setup, seed=args.seed, progress=progress, progress_every=every)
    summary = summarize(result, [c.name for c in classes], weights, args.slots)
    print(json.dumps(summary_json(summary), indent=2) if args.json else render(summary))
    return 0


def _service(args: argparse.Namespace) -> ServiceModel:
    if args.cv is not None and args.service != "lognormal":
        raise SimulateInputError(f"--cv applies to lognormal service times; {args.service} has its own")
    cv = {"exponential": 1.0, "fixed": 0.0}.get(args.service, 1.0 if args.cv is None else args.cv)
    return ServiceModel(args.service, args.service_ms / 1000, cv, args.service_per_cost)


def _workload(
    args: argparse.Namespace,
    classes: tuple[ClassOption, ...],
    tenants: tuple[TenantOption, ...],
    service: ServiceModel,
) -> tuple[Iterable[Arrival], int, Admission | None]:
    """The arrivals, how many, and admission's settings (None when no class bounds its wait)."""
    from gateway.tools.simulate.admitting import Admission

    rng = random.Random(args.seed)
    limited = any(c.max_wait_ms is not None for c in classes)
    if args.trace is not None:
        if args.rate is not None:
            raise SimulateInputError("--trace gives the arrivals; drop --rate")
        trace = read_trace(args.trace, [c.name for c in classes], service, rng)
        if not limited:
            return trace, len(trace), None
        # The operator's expected service time: the trace's mean, as one would configure it.
        admission = Admission(max(statistics.fmean(a.service_s for a in trace), 1e-9))
        return trace, len(trace), admission
    if args.rate is None:
        raise SimulateInputError("give --rate (Poisson arrivals per second) or --trace FILE")
    shares = [c.share for c in classes]
    mix = [TenantMix(t.name, t.share, t.cost) for t in tenants]
    if sum(shares) <= 0 or sum(t.share for t in tenants) <= 0:
        raise SimulateInputError("the classes' and the tenants' shares must not all be 0")
    arrivals = poisson_arrivals(args.rate, args.requests, service, rng, class_shares=shares, tenants=mix)
    if not limited:
        return arrivals, args.requests, None
    tenant_share = sum(t.share for t in tenants)
    cost = sum(t.share * t.cost for t in tenants) / tenant_share
    admission = Admission(service.mean_s * (cost if service.per_cost else 1.0))
    return arrivals, args.requests, admission


def _progress(total: int) -> Progress:
    def report(done: int) -> None:
        print(f"simulate: {100 * done // total}% ({done}/{total} requests)", file=sys.stderr, flush=True)

    return report


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _check_unique(what: str, names: list[str]) -> None:
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise SimulateInputError(f"{what} {', '.join(repeated)} given more than once")


def _spec(kind: type[Any], fields: dict[str, Callable[[str], Any]]) -> Callable[[str], Any]:
    """A parser of NAME[,key=value...] into `kind`, each value read by its key's parser."""

    def parse(text: str) -> Any:
        name, *pairs = [part.strip() for part in text.split(",")]
        if not name or "=" in name:
            raise argparse.ArgumentTypeError(f"{text!r}: starts with a name, then key=value pairs")
        values: dict[str, Any] = {}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in fields:
                known = ", ".join(fields)
                raise argparse.ArgumentTypeError(f"{text!r}: unknown key {key!r} (known: {known})")
            values[key] = fields[key](value)
        return kind(name, **values)

    return parse


_POSITIVE = number(0.0, strict=True)
_SHARE = number(0.0)
