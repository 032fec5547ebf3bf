"""Which requests keep the room of a contended queue? Where costs differ, the cheaper ones.

Under overload a queue fills up to its work limit and then refuses whatever arrives next, long or
short alike, so the work it serves is a random sample of what arrived. Where the engine's capacity
is the limit, every long request admitted takes the place of several short ones: preferring the
cheaper requests serves more of them in the same time, and the long ones are told at once that they
do not fit, instead of the first requests that happen to arrive.

So the room of a queue (its work limit beyond the one hand-over every request needs) is shared by
rank: a request's rank is the share of the requests recently offered to its model and class that
cost less than it, and it may fill `1 - (1 - room_for_costliest) x rank` of the room. The cheapest
may fill all of it, the costliest `room_for_costliest` of it (1: cost-blind). An idle or lightly
loaded queue never reaches the smaller share, so the rank changes nothing until the queue is
contended; requests of one cost all rank 0, so uniform costs (KServe batches of one size, `cost:
requests`) are admitted exactly as before.

Fair share is kept: a flow's requests are checked against the work ahead of its own turn, and a flow
whose requests all rank high still keeps a queue (a shorter one), so it stays backlogged and is
served its weighted share.
"""

from __future__ import annotations

import bisect
from collections import deque


class CostRanks:
    """The costs of the last `window` requests offered, to rank a new one among them."""

    __slots__ = ("_arrived", "_sorted")

    def __init__(self, window: int = 256) -> None:
        self._arrived: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []

    def rank(self, cost: float) -> float:
        """The share of the recent requests that cost less than `cost` (0 before any came)."""
        if not self._sorted:
            return 0.0
        return bisect.bisect_left(self._sorted, cost) / len(self._sorted)

    def add(self, cost: float) -> None:
        if len(self._arrived) == self._arrived.maxlen:
            oldest = self._arrived[0]
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._arrived.append(cost)
        bisect.insort(self._sorted, cost)


def room_share(rank: float, room_for_costliest: float) -> float:
    """The share of a contended queue's room a request of `rank` may fill."""
    return 1.0 - (1.0 - room_for_costliest) * rank


def room_limit(limit: float, handover_cost: float, share: float) -> float:
    """The work limit `limit` with only `share` of its room beyond one hand-over: a request that
    needs no more than that hand-over (nothing queued ahead) is checked as before."""
    if limit <= handover_cost:
        return limit
    return handover_cost + (limit - handover_cost) * share
