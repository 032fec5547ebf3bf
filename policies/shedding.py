"""What must be shed while the cluster cannot grow? Classes refused at arrival during a backlog.

When the ClusterQueue that admits the serving fleet is backlogged (Kueue reports many pending
workloads, or a long admission wait), new replicas will not come soon, so queueing for them is
pointless: the least urgent classes are refused at arrival, more of them the deeper the backlog,
and never the most urgent one. Their Retry-After grows by the reported admission wait, the time
the cluster itself says capacity takes to arrive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClusterBacklog:
    pending_workloads: float
    admission_wait_p95_s: float | None


@dataclass(frozen=True, slots=True)
class BacklogLimits:
    pending_workloads: float
    admission_wait_p95_s: float


def severity(backlog: ClusterBacklog, limits: BacklogLimits) -> float:
    """How far past its limits the backlog is: above 1 it counts as backlogged."""
    level = backlog.pending_workloads / limits.pending_workloads
    if backlog.admission_wait_p95_s is not None:
        level = max(level, backlog.admission_wait_p95_s / limits.admission_wait_p95_s)
    return level


def first_shed_band(backlog: ClusterBacklog | None, limits: BacklogLimits, bands: int) -> int | None:
    """The most urgent band refused at arrival (it and all less urgent ones), or None.

    One band per whole step past the limit: just past it the least urgent band, past twice the
    limit the two least urgent, and so on, but band 0 always stays open.
    """
    if backlog is None:
        return None
    level = severity(backlog, limits)
    if not level > 1.0:  # NaN too: a reading that says nothing sheds nothing
        return None
    shed = bands - 1 if math.isinf(level) else min(bands - 1, math.ceil(level - 1.0))
    return bands - shed if shed > 0 else None


def shed_excess_wait_s(queue_excess_s: float, backlog: ClusterBacklog) -> float:
    """How much longer than allowed a shed request would wait: the queue's excess (none where it
    would fit the queue) and then the cluster's admission wait."""
    return max(0.0, queue_excess_s) + (backlog.admission_wait_p95_s or 0.0)
