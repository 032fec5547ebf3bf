"""Which kind of request is it, for its service time: a model that serves short inferences and long
streams takes a different time for each, and one estimate for both blurs them.

Rules this module keeps:
- A kind is the route, whether the answer streams, and the cost's bucket (the power of two at or
  above it): requests of one kind take about as long as each other, and a kind's count stays
  small (a model sees a handful of routes and a few dozen buckets at most).
- A kind's own service times are read only once it has KIND_TRUSTED_SAMPLES of them; before, and
  for the empty kind (a batch of several, or a request whose kind is not told), the model's.
- A model keeps at most MAX_KINDS kinds; a new one beyond them is read as the model's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from policies.service_times import ServiceTimes

KIND_TRUSTED_SAMPLES = 8
MAX_KINDS = 64


def request_kind(route: str, stream: bool, cost: float) -> str:
    """The kind of a request on `route` (a short name: "infer", "chat/completions"), streamed or
    not, that costs `cost` work units: for example "chat/completions+stream:256"."""
    bucket = 1 if not cost > 1 else 2 ** math.ceil(math.log2(min(cost, 2.0**60)))
    return f"{route}{'+stream' if stream else ''}:{bucket}"


def service_of_kind(by_kind: Mapping[str, ServiceTimes], kind: str) -> ServiceTimes | None:
    """The service times of `kind`, when it has enough of its own; else None (read the model's)."""
    if not kind:
        return None
    times = by_kind.get(kind)
    return times if times is not None and times.samples >= KIND_TRUSTED_SAMPLES else None
