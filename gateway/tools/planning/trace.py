"""Read a request trace CSV into the workload a capacity plan needs: arrival rate, service time, cv.

The CSV has a header row naming at least two columns; other columns are ignored, and so are
blank lines and lines starting with `#`:

- `arrival_s`: when the request arrived, in seconds, from any origin (epoch or since the start);
  rows may come in any order.
- `service_s`: how long the request held a slot (backend service time), in seconds.

The arrival rate is (n - 1) / (last arrival - first arrival); the service time is the mean of
`service_s` and its coefficient of variation its sample standard deviation over that mean.
"""

from __future__ import annotations

import csv
import itertools
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

COLUMNS = ("arrival_s", "service_s")


class TraceError(Exception):
    """The trace cannot be read or estimated from; the message names the file and the row."""


@dataclass(frozen=True, slots=True)
class Workload:
    """What arrives at a pool and how long each request holds a slot, in one time unit."""

    arrival_rate: float
    service_time: float
    service_cv: float
    """Standard deviation of the service time over its mean: 1 for exponential service."""

    @property
    def service_rate(self) -> float:
        return 1.0 / self.service_time


@dataclass(frozen=True, slots=True)
class TraceWorkload:
    workload: Workload
    path: str
    requests: int
    span_s: float
    arrival_cv: float
    """Standard deviation of the gaps between arrivals over their mean: about 1 for Poisson arrivals."""


def csv_rows(path: Path) -> csv.DictReader[str]:
    """The rows of the CSV trace at `path`, blank lines and `#` comments left out; a file that
    cannot be read is a TraceError naming it."""
    try:
        with path.open(newline="") as file:
            lines = [line for line in file if line.strip() and not line.lstrip().startswith("#")]
    except OSError as error:
        raise TraceError(f"trace {path}: cannot read it: {error.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"trace {path}: not a text file") from None
    return csv.DictReader(lines)


def read_trace(path: Path, unit_s: float = 1.0) -> TraceWorkload:
    """The workload estimated from the trace at `path`, in units of `unit_s` seconds."""
    reader = csv_rows(path)
    missing = [column for column in COLUMNS if column not in (reader.fieldnames or ())]
    if missing:
        raise TraceError(f"trace {path}: the header lacks column(s) {', '.join(missing)}")
    arrivals: list[float] = []
    services: list[float] = []
    for number, row in enumerate(reader, start=1):
        try:
            arrival, service = float(row["arrival_s"]), float(row["service_s"])
        except (TypeError, ValueError):
            raise TraceError(
                f"trace {path}: data row {number}: arrival_s and service_s must be numbers"
            ) from None
        if not (math.isfinite(arrival) and math.isfinite(service) and service >= 0):
            raise TraceError(f"trace {path}: data row {number}: needs finite times and service_s >= 0")
        arrivals.append(arrival)
        services.append(service)
    if len(arrivals) < 2:
        raise TraceError(f"trace {path}: needs at least 2 requests, has {len(arrivals)}")
    arrivals.sort()
    span_s = arrivals[-1] - arrivals[0]
    mean_service_s = statistics.fmean(services)
    if span_s <= 0:
        raise TraceError(f"trace {path}: every request arrived at the same time; no rate follows")
    if mean_service_s <= 0:
        raise TraceError(f"trace {path}: every service_s is 0; no service time follows")
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    workload = Workload(
        arrival_rate=(len(arrivals) - 1) / span_s * unit_s,
        service_time=mean_service_s / unit_s,
        service_cv=statistics.stdev(services) / mean_service_s,
    )
    arrival_cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    return TraceWorkload(workload, str(path), len(arrivals), span_s, arrival_cv)
