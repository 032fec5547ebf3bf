"""What is the q-quantile of a bucketed distribution? Prometheus-style histogram quantiles.

Buckets are cumulative counts by upper bound (`le`), as a Prometheus histogram exposes them, or
their difference between two scrapes (the observations in between). Within a bucket observations
are taken as spread evenly, as PromQL's histogram_quantile does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping


def bucket_deltas(before: Mapping[float, float], after: Mapping[float, float]) -> dict[float, float] | None:
    """Observations per cumulative bucket between two readings; None if the counter was reset."""
    deltas: dict[float, float] = {}
    for bound, count in after.items():
        delta = count - before.get(bound, 0.0)
        if delta < 0:
            return None
        deltas[bound] = delta
    return deltas


def quantile(q: float, cumulative: Iterable[tuple[float, float]]) -> float | None:
    """The q-quantile (0 < q < 1) of cumulative (upper bound, count) buckets; None when empty.

    A quantile that falls in the +Inf bucket is reported as the largest finite bound.
    """
    buckets = sorted(cumulative)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
