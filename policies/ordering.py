"""Where does a request sit in its band's queue? Its ordering score, computed once at enqueue.

Lower scores leave first. The score is a plain number so that a heap in memory and a sorted set
in Redis order requests the same way.
"""

from __future__ import annotations

from enum import StrEnum


class Ordering(StrEnum):
    FIFO = "fifo"
    """First come, first served within each tenant's flow, the flows of a band sharing it by
    weight: the score is the request's start tag in fair queuing (policies.fairness). With one
    flow, plain arrival order."""
    EDF = "edf"
    """Earliest deadline first, across the band's flows: the score is the time the request must
    leave the queue."""
