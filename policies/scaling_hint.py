"""What replica count should the autoscaler see? The planner's answer, held against flapping.

The answer is the smallest replica count whose queue meets the target wait at the measured load
(policies.capacity). It is published with the stabilization an HPA applies to scale-down: a higher
count shows at once, because a queue builds fast, while a lower one shows only after it has been
the answer for a whole window. Held at the source, one stable number reaches every consumer (HPA,
KEDA, dashboards).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from policies.capacity import Targets, replicas_for


def desired_replicas(
    arrival_rate_per_s: float,
    service_time_s: float,
    service_cv: float,
    slots_per_replica: int,
    targets: Targets,
    *,
    max_replicas: int = 10_000,
) -> int:
    """Replicas (each with `slots_per_replica` slots) that keep the queue within `targets`.

    At least one, and at most `max_replicas` when even that many would not meet them.
    """
    if service_time_s <= 0 or slots_per_replica < 1 or not math.isfinite(arrival_rate_per_s):
        return 1
    recommendation = replicas_for(
        max(0.0, arrival_rate_per_s),
        1.0 / service_time_s,
        targets,
        service_cv=max(0.0, service_cv),
        servers_per_replica=slots_per_replica,
        max_replicas=max_replicas,
    )
    return recommendation.replicas


def stabilized(history: Iterable[tuple[float, int]], now: float, window_s: float) -> int:
    """The highest answer of the last `window_s` seconds: scale-down waits out the window.

    `history` holds (time, answer) pairs; only those within the window count. 1 when none does.
    """
    return max((answer for at, answer in history if now - at <= window_s), default=1)
