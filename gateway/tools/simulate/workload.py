"""What arrives at the simulated pool: Poisson streams or a CSV trace, with drawn service times.

Rules this module keeps:
- Every draw comes from the `random.Random` the caller passes, so a seed fixes the whole workload.
- A service model is given by its mean and coefficient of variation: exponential (cv 1), fixed
  (cv 0) or lognormal (any cv; sigma^2 = ln(1 + cv^2), so the mean is the one asked for). With
  `per_cost` the drawn time is per work unit and a request of cost k holds its slot k times as long.
- Arrivals come out in time order; a trace is sorted by `at_s` (stably, so ties keep file order).
- A trace CSV has a header naming `at_s` (required: seconds from any origin) and optionally `class`
  (a declared class name; default the first), `tenant` (default "default"), `cost` (work units,
  > 0; default 1) and `service_s` (seconds the request holds a slot, >= 0; drawn from the service
  model when absent). An empty optional cell takes the default; other columns, blank lines and
  lines starting with `#` are ignored. Anything else is a TraceError naming the file and the row.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from gateway.tools.planning.trace import TraceError, csv_rows

ServiceKind = Literal["exponential", "fixed", "lognormal"]
SERVICE_KINDS: tuple[ServiceKind, ...] = ("exponential", "fixed", "lognormal")
DEFAULT_TENANT = "default"
TRACE_COLUMNS = ("at_s", "class", "tenant", "cost", "service_s")


class Arrival(NamedTuple):
    """One request as the engine sees it.

    A named tuple rather than a frozen dataclass: millions are built per run, and a tuple is built
    and unpacked several times faster.
    """

    at_s: float
    band: int
    tenant: str
    cost: float
    service_s: float


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """How long a request holds its slot."""

    kind: ServiceKind = "exponential"
    mean_s: float = 0.1
    cv: float = 1.0
    """Standard deviation over mean; only lognormal takes another value than its kind's."""
    per_cost: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.mean_s < math.inf:
            raise ValueError(f"mean service time must be a finite number > 0, got {self.mean_s}")
        expected = {"exponential": 1.0, "fixed": 0.0}.get(self.kind)
        if expected is not None and self.cv != expected:
            raise ValueError(f"{self.kind} service times have cv {expected:g}; only lognormal takes --cv")
        if not 0 <= self.cv < math.inf:
            raise ValueError(f"cv must be a finite number >= 0, got {self.cv}")

    @property
    def variance_s2(self) -> float:
        """Variance of one draw (of one work unit's time with `per_cost`)."""
        return (self.cv * self.mean_s) ** 2

    def sampler(self, rng: random.Random) -> Callable[[float], float]:
        """A function from a request's cost to a fresh service time drawn with `rng`."""
        # One flat lambda per case: the generator calls it for every request.
        mean = self.mean_s
        if self.kind == "exponential":
            uniform, log = rng.random, math.log  # random.expovariate's formula, without its call
            if self.per_cost:
                return lambda cost: -log(1.0 - uniform()) * mean * cost
            return lambda cost: -log(1.0 - uniform()) * mean
        if self.kind == "fixed" or self.cv == 0:
            return (lambda cost: mean * cost) if self.per_cost else (lambda cost: mean)
        sigma = math.sqrt(math.log1p(self.cv**2))
        mu, lognormal = math.log(mean) - sigma * sigma / 2, rng.lognormvariate
        if self.per_cost:
            return lambda cost: lognormal(mu, sigma) * cost
        return lambda cost: lognormal(mu, sigma)


@dataclass(frozen=True, slots=True)
class TenantMix:
    """A tenant of a Poisson stream: its share of the arrivals and the cost of each request."""

    name: str = DEFAULT_TENANT
    share: float = 1.0
    cost: float = 1.0


def poisson_arrivals(
    rate_per_s: float,
    count: int,
    service: ServiceModel,
    rng: random.Random,
    *,
    class_shares: Sequence[float] = (1.0,),
    tenants: Sequence[TenantMix] = (TenantMix(),),
    start_s: float = 0.0,
) -> Iterator[Arrival]:
    """`count` arrivals of a Poisson stream of `rate_per_s`, each of a class (band index) and a
    tenant drawn independently by their shares, from `start_s` on."""
    if not 0 < rate_per_s < math.inf:
        raise ValueError(f"arrival rate must be a finite number > 0, got {rate_per_s}")
    pick_band = _picker([float(share) for share in class_shares], rng)
    pick_tenant = _picker([tenant.share for tenant in tenants], rng)
    draw, uniform, log, gap_s = service.sampler(rng), rng.random, math.log, 1.0 / rate_per_s
    names, costs = [t.name for t in tenants], [t.cost for t in tenants]
    at = start_s
    if pick_band is None and pick_tenant is None:  # the common case, without a pick per request
        name, cost = names[0], costs[0]
        for _ in range(count):
            at -= log(1.0 - uniform()) * gap_s
            yield Arrival(at, 0, name, cost, draw(cost))
        return
    pick_band = pick_band or _first
    pick_tenant = pick_tenant or _first
    for _ in range(count):
        at -= log(1.0 - uniform()) * gap_s
        t = pick_tenant()
        cost = costs[t]
        yield Arrival(at, pick_band(), names[t], cost, draw(cost))


def merged(*streams: Iterable[Arrival]) -> Iterator[Arrival]:
    """The arrivals of several time-ordered streams as one time-ordered stream."""
    return heapq.merge(*streams, key=lambda arrival: arrival.at_s)


def _picker(shares: list[float], rng: random.Random) -> Callable[[], int] | None:
    """A draw of an index by `shares`; None when there is one choice."""
    if not shares or any(not 0 <= share < math.inf for share in shares) or sum(shares) <= 0:
        raise ValueError(f"shares must be finite, >= 0 and not all 0, got {shares}")
    if len(shares) == 1:
        return None
    bounds = list(itertools.accumulate(shares))
    total, uniform, last = bounds[-1], rng.random, len(shares) - 1
    # min(): a float sum may leave the last bound a hair under total * u's largest value.
    return lambda: min(bisect.bisect_right(bounds, uniform() * total), last)


def _first() -> int:
    return 0


def read_trace(
    path: Path, class_names: Sequence[str], service: ServiceModel, rng: random.Random
) -> list[Arrival]:
    """The arrivals of the trace at `path` (see the module), in time order; bands index
    `class_names`, the most urgent first."""
    reader = csv_rows(path)
    if "at_s" not in (reader.fieldnames or ()):
        raise TraceError(
            f"trace {path}: the header lacks the column at_s (optional: class, tenant, cost, service_s)"
        )
    bands = {name: index for index, name in enumerate(class_names)}
    draw = service.sampler(rng)
    arrivals = [
        _row(row, bands, draw, f"trace {path}: data row {number}") for number, row in enumerate(reader, 1)
    ]
    if not arrivals:
        raise TraceError(f"trace {path}: has no requests")
    arrivals.sort(key=lambda arrival: arrival.at_s)
    return arrivals


def _row(
    row: dict[str, str | None], bands: dict[str, int], draw: Callable[[float], float], where: str
) -> Arrival:
    if None in row:
        raise TraceError(f"{where}: more cells than the header names")
    at_s = _number(row, "at_s", where)
    if at_s is None:
        raise TraceError(f"{where}: at_s is empty")
    name = (row.get("class") or "").strip()
    if name and name not in bands:
        declared = ", ".join(bands) or "none"
        raise TraceError(
            f"{where}: class {name!r} is not declared (declared: {declared}); add --class {name}"
        )
    cost = _number(row, "cost", where)
    cost = 1.0 if cost is None else cost
    if cost <= 0:
        raise TraceError(f"{where}: cost must be > 0, got {cost:g}")
    service_s = _number(row, "service_s", where)
    if service_s is not None and service_s < 0:
        raise TraceError(f"{where}: service_s must be >= 0, got {service_s:g}")
    tenant = (row.get("tenant") or "").strip() or DEFAULT_TENANT
    return Arrival(
        at_s, bands[name] if name else 0, tenant, cost, draw(cost) if service_s is None else service_s
    )


def _number(row: dict[str, str | None], column: str, where: str) -> float | None:
    """The cell's finite number, or None when it is empty or the column absent."""
    text = (row.get(column) or "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{where}: {column} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise TraceError(f"{where}: {column} must be finite, got {text!r}")
    return value
