"""Which tenant's flow goes next within a band? Start-time fair queuing on cost, by weight.

Flows are (model, band, tenant), each first come, first served. A flow's head (its oldest queued
request) gets, as it becomes the head, a start tag in virtual time (Goyal, Vin and Cheng's
start-time fair queuing, SFQ, the scheme VTC adapts to LLM serving): with v the band's virtual
time, F the flow's finish tag, c the cost of the request handed a slot and w the flow's weight,

    head's start = max(v, F)        F = start + c / w, once the head is handed a slot

and the band hands its next slot to the head with the lowest start tag (ties by arrival). v is the
start tag of the last request handed a slot. The rules this keeps:

- Work-conserving: a flow with nothing queued takes nothing; the others split its share at once.
- No credit for idleness: a flow that comes back after an idle spell starts at v, not at the finish
  tag it left with, so it cannot claim the service it did not ask for.
- Only work handed a slot moves a flow's clock. SFQ as published tags each request as it arrives;
  then a request that leaves the queue unserved (its allowance ran out, it was displaced, its
  client left) has taken its flow's turn all the same, and every request behind it waits a turn
  more. Under overload those leave mostly from the lighter flows, the ones that wait longest: with
  weights 8:1 and exponential service times, the weight-1 flow was handed 1.2% less work than its
  share, and its admitted requests expired more often (the simulator, 3 seeds). Tagged as heads,
  the tags are the same as long as nothing leaves unserved.
- With one flow, the order is plain first come, first served.
- The bound (SFQ's, on work handed slots): over any interval in which flows f and g are both
  continuously backlogged, the work each is handed, divided by its weight, differs by at most
  c_max(f) / w_f + c_max(g) / w_g, the largest costs each sends. It is a bound on hand-overs, so it
  holds whatever the slots' count and service times; the work *finished* lags it by what is in
  flight.

The tag is a plain number, the head's ordering score, so that a heap in memory and a sorted set in
Redis order heads the same way (the Redis store computes the same lines in its scripts,
atomically).

Admission reads the same clock (`work_ahead_in_turn`): a request joining a flow starts, once its
flow's queued work is handed out before it, at the flow's head's start tag plus that work by
weight (`joining_start`), and waits for the work handed out before that turn, not for everything
its band holds. A light tenant's request behind a heavy
tenant's backlog is served within its share, and is admitted on that. What the other flows have
queued is not all that goes first: while the request waits, their new arrivals are tagged from
from their own flows' tags, which may lie below its start tag, and are handed slots before it
(`arrivals_in_turn`). Counting only what was queued, a light-weight tenant under sustained
overload was admitted far into virtual time and then overtaken by the heavier flows' arrivals:
with weights 3:1 at 2.5x the pool's capacity it was handed 15% of the work, and its admitted
requests expired in the queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

TAG_COST_MAX = 1e9
"""Costs above it count as it in virtual time. A client's claim (a batch of 1e20 items) would move
the band's clock to where floats no longer tell costs of 1 apart: every tag after it would tie,
and fair queuing would fall back to first come, first served for every flow of the band."""


def head_start(virtual_time: float, flow_finish: float) -> float:
    """The start tag of the request that becomes the head of a flow whose finish tag is
    `flow_finish`, in a band whose virtual time is `virtual_time`."""
    return max(virtual_time, flow_finish)


def finish_after(start: float, cost: float, weight: float) -> float:
    """A flow's finish tag once a request of `cost` that started at `start` is handed a slot, on a
    flow of `weight` (> 0); a batch's followers each move it on from the one before."""
    if not weight > 0:
        raise ValueError(f"a flow's weight must be > 0, got {weight}")
    return start + min(max(cost, 0.0), TAG_COST_MAX) / weight


def joining_start(
    virtual_time: float, flow_finish: float, head: float | None, queued: float, weight: float
) -> float:
    """Where a request joining a flow now starts in virtual time, at the earliest: behind the
    flow's queued work (`queued`, its head's start tag `head`; None while nothing waits in it),
    each request tagged as it becomes the head, or at `head_start` when nothing waits.

    It is the flow's finish tag as SFQ tagged on arrival would hold it, less what left unserved.
    The work is not capped per request as `finish_after` caps it: this is a reading for admission,
    never a tag.
    """
    if head is None or queued <= 0:
        return head_start(virtual_time, flow_finish)
    return head + queued / weight


def virtual_time_after(virtual_time: float, handed_start: float) -> float:
    """The band's virtual time once a request whose start tag is `handed_start` is handed a slot.

    It never goes back: a head tagged before the clock moved past its tag (a flow whose head a
    quota held back) does not rewind the clock for the heads tagged since.
    """
    return max(virtual_time, handed_start)


@dataclass(frozen=True, slots=True)
class FairTurns:
    """One band's fair-queuing state, as admission reads it."""

    virtual_time: float
    finish: Mapping[str, float] = field(default_factory=dict)
    """Where a request joining each flow now starts (`joining_start`)."""
    queued: Mapping[str, float] = field(default_factory=dict)
    """Each backlogged flow's queued work."""
    weights: Mapping[str, float] = field(default_factory=dict)
    """The weight of each flow admitted, queued or granted at once, backlogged or not (1 where not
    named: a flow the store has not seen)."""


def work_ahead_in_turn(
    virtual_time: float,
    own_finish: float,
    own_queued: float,
    others: Iterable[tuple[float, float]],
    slack: float,
) -> float:
    """The band's queued work handed slots before a request joining a flow whose queued work is
    `own_queued` and behind which it starts at `own_finish` (`joining_start`); `others` are the
    other backlogged flows' (queued work, weight).

    The request starts at S = max(v, own_finish). A flow g's queued requests take tags from v on,
    spaced by cost / w_g, so those with tags below S carry at most (S - v) * w_g of work, and one
    more request that straddles S: `slack`, the largest (or, as the stores pass it, the mean)
    request cost. With every queued tag at v or later (true of SFQ: the band hands out the lowest
    tag first), this is never less than the work with a lower tag when `slack` is the largest cost.
    """
    span = max(0.0, max(virtual_time, own_finish) - virtual_time)
    return own_queued + sum(min(work, span * weight + slack) for work, weight in others)


def turn_ahead(turns: FairTurns, tenant: str, slack: float) -> float:
    """`work_ahead_in_turn` for a request of `tenant` in the band `turns` describes."""
    others = ((work, turns.weights.get(name, 1.0)) for name, work in turns.queued.items() if name != tenant)
    own_finish = turns.finish.get(tenant, turns.virtual_time)
    return work_ahead_in_turn(turns.virtual_time, own_finish, turns.queued.get(tenant, 0.0), others, slack)


def arrivals_in_turn(turns: FairTurns, tenant: str, slack: float, reach: Mapping[str, float]) -> float:
    """The work the band's other flows will still queue ahead of a request of `tenant` joining now,
    beyond what they hold queued (which `turn_ahead` counts); `reach`: the most work each flow may
    send within the horizon asked about (tenant -> its rate times the horizon; policies.wait.arrival_reach).

    A flow g may send at most (S - v) * w_g + `slack` of work with tags below the request's start
    tag S (as in `work_ahead_in_turn`), and within the horizon at most what it holds queued plus its
    reach. The request is handed a slot within the horizon if the pool drains, by then, its own
    flow's work and each flow's smaller bound: past its turn nothing of g's goes first, and before
    it g cannot have sent more than it does by then. So admission, asking whether the request
    starts within its allowance, reads this at the allowance. A flow with no reach adds nothing;
    `turns` names the weight of every flow admitted (a flow it does not name weighs 1).
    """
    others = (
        (turns.queued.get(name, 0.0), turns.weights.get(name, 1.0), most)
        for name, most in reach.items()
        if name != tenant
    )
    return work_arriving_in_turn(
        turns.virtual_time, turns.finish.get(tenant, turns.virtual_time), others, slack
    )


def work_arriving_in_turn(
    virtual_time: float, own_finish: float, others: Iterable[tuple[float, float, float]], slack: float
) -> float:
    """`arrivals_in_turn` from the band's clock: `others` are the other flows' (queued work,
    weight, reach). A store computes it from its live state, atomically with the count of the work
    queued ahead (`work_ahead_in_turn`) it complements: each flow adds what its bound leaves beyond
    its queued work, so read from a view a few hand-overs old it swings with every hand-over and
    arrival of the heavier flows, and the requests admitted where it read low expire."""
    span = max(0.0, own_finish - virtual_time)
    extra = 0.0
    for queued, weight, most in others:
        if most <= 0:
            continue
        in_turn = span * weight + slack
        extra += max(0.0, min(in_turn, queued + most) - min(in_turn, queued))
    return extra


def shares(rates: Mapping[str, float]) -> dict[str, float]:
    """Each flow's share of the work `rates` hands out (0 for all when none is handed)."""
    total = sum(rates.values())
    return {name: rate / total if total > 0 else 0.0 for name, rate in rates.items()}
