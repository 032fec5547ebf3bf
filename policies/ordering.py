"""Where does a request sit in its band's queue? Its ordering score, computed once at enqueue.

Lower scores leave first. The score is a plain number so that a heap in memory and a sorted set
in Redis order requests the same way.
"""

from __future__ import annotations

from enum import StrEnum


class Ordering(StrEnum):
    FIFO = "fifo"
    """First come, first served: the score is the arrival time."""
    EDF = "edf"
    """Earliest deadline first: the score is the time the request must leave the queue."""


def score(ordering: Ordering, arrival_at: float, leave_by_at: float) -> float:
    """The ordering score of a request that arrived at `arrival_at` and must leave by `leave_by_at`."""
    if ordering is Ordering.EDF:
        return leave_by_at
    return arrival_at
