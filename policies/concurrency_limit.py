"""How many requests may an engine with continuous batching run at once? A limit found online.

Such an engine has no slots: it runs as many sequences as it is given, each step slower the more
run, and past its own limits (max-num-seqs, the KV cache) it queues or preempts inside, where the
gateway's admission no longer sees the wait. The control law, fed one `EngineSample` per scrape
of the engine's metrics:

- Congestion is the engine queueing inside, preempting, the clients' deadlines missed on it, or its
  first-token or inter-token latency above an objective the operator set. The clients' objective
  is their deadlines: of the requests that carried one and ended on the engine, no more than
  `late_objective` (half) may end past it. Half, not a small share, because some requests are
  longer than their budgets at any limit, and they must not pull it to the floor; the limit comes
  down when the engine runs most of its requests too slowly for what their clients asked.
  Queueing inside is `waiting` above zero for `waiting_scrapes` scrapes in a row, unless the
  requests it started meanwhile waited no longer than `queue_steps` inter-token latencies (a
  request that arrives between two steps waits for the next: no congestion).
- On congestion the limit comes down at once: by half the queue inside (the engine said how many
  it could not run; half, because its queue drains only as its sequences finish, and the next
  scrapes still see what the last limit sent), or in proportion to the latency over its
  objective, or to the requests in time against the share the objective asks; at least by
  `min_decrease` for latency, deadlines or preemption. The limit it comes down to is
  the ceiling after a cut by the queue (the engine runs that much), the limit it had after one by
  latency or deadlines.
- While anything waits inside, the limit never rises, but for one request waiting for the next
  step (with steps of a quarter second, a scrape catches the request just sent more often than
  not: it held the limit far below the engine's knee).
- Without congestion, and only while the limit binds (`limit_binds`: the gateway has work queued
  for the engine, uses every slot, or turns work away with the slots all but used), it goes up:
  by half the distance to the ceiling, or by `slow_start` times while no ceiling is known; at the
  ceiling, after `probe_every` calm scrapes, by a probe that doubles with each calm window (1, 2,
  4, ... at most a quarter of the limit) and is back to one after congestion, with the ceiling: a
  steady load sees the limit still, probing by one, and capacity that came back is found again in
  a few windows.
  A rise of `judged_rise` or more that brought no more throughput (`min_gain`) within
  `judge_scrapes` scrapes ends the climb there: the engine is full though it does not say so
  (smaller rises drown in the noise). The limit holds while a rise is being judged: the scrape
  right after it often catches the new sequences still in their prefill.
- Without demand the limit holds: an idle engine says nothing about how much it can take.
- A missing sample (the engine's metrics are stale) holds the limit where it was.
- The limit stays within [min_limit, max_limit], and slots are whole: `slots` rounds it down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class LimitConfig:
    min_limit: float = 1.0
    max_limit: float = 1024.0
    ttft_objective_s: float | None = None
    itl_objective_s: float | None = None
    late_objective: float = 0.5
    """The share of the requests with deadlines that may end on the engine past them."""
    waiting_scrapes: int = 2
    queue_steps: float = 2.0
    slow_start: float = 1.5
    min_decrease: float = 0.05
    probe_every: int = 5
    min_gain: float = 0.02
    judge_scrapes: int = 2
    """Scrapes a rise has to show more throughput (the first may catch its new sequences in prefill)."""
    judged_rise: float = 0.1


@dataclass(frozen=True, slots=True)
class EngineSample:
    """What one scrape says of the engine, over the interval since the previous one."""

    waiting: float
    """Requests queued inside the engine now."""
    preempted: float = 0.0
    """Preemptions during the interval."""
    ttft_s: float | None = None
    """Mean time to first token of the requests that got one in the interval (None: none did)."""
    itl_s: float | None = None
    """Mean inter-token latency over the interval."""
    throughput: float | None = None
    """Work done per second over the interval (generated tokens, or completions)."""
    queue_s: float | None = None
    """Mean time the requests the engine started in the interval waited inside it (None: unknown)."""
    late_share: float | None = None
    """Of the requests with a deadline that ended on the engine lately (enough of them to tell), the
    share that ended past it (None: too few since the last share told)."""


@dataclass(frozen=True, slots=True)
class LimitState:
    limit: float
    ceiling: float | None = None
    """The limit at the last congestion, raised by each calm probe; None until one came."""
    waiting_streak: int = 0
    calm: int = 0
    """Calm scrapes in a row at the ceiling."""
    probe: float = 1.0
    """The next probe above the ceiling."""
    rose_from: tuple[float, float, int] | None = None
    """(limit, throughput) before the last rise, to judge whether it brought more, and the scrapes
    since that did not show it yet."""
    cause: str = field(default="", compare=False)
    """Why the limit last moved, for the operator's log."""

    @property
    def slots(self) -> int:
        return max(1, math.floor(self.limit))


TURNED_AWAY = 0.05
"""The share of the arriving work refused that says the limit binds though nothing is queued: under
overload admission refuses at the door, and the queue is empty between hand-overs (at its floor a
limit saw no demand half the time, and stayed there)."""


def limit_binds(queued: bool, free_slots: int, slots: int, offered_rate: float, admitted_rate: float) -> bool:
    """Whether the limit of `slots` holds work back (the demand `next_limit` climbs on): work is
    queued for the engine, no slot is free, or admission turns away more than TURNED_AWAY of the
    work offered while at most a tenth of the slots (at least one) are free. Turned-away work binds
    only while the slots are all but used: admission may refuse for reasons of its own (a long
    wait predicted) with slots to spare, and the limit must not climb then (a run climbed to 115
    on an engine whose knee is 16)."""
    if queued or free_slots <= 0:
        return True
    nearly_full = free_slots <= max(1, slots // 10)
    return nearly_full and offered_rate > 0 and admitted_rate < (1 - TURNED_AWAY) * offered_rate


def start(config: LimitConfig) -> LimitState:
    return LimitState(config.min_limit)


def next_limit(
    state: LimitState, sample: EngineSample | None, demand: bool, config: LimitConfig
) -> LimitState:
    """The limit after one scrape: `sample` (None when stale), `demand` when the limit bound."""
    if sample is None:
        return state
    between_steps = sample.queue_s is not None and sample.queue_s <= config.queue_steps * (
        sample.itl_s or 0.0
    )
    streak = state.waiting_streak + 1 if sample.waiting > 0 and not between_steps else 0
    cut = _congestion_cut(state.limit, sample, streak, config)
    if cut is not None:
        limit, by_queue, cause = cut
        limit = _clamp(limit, config)
        return LimitState(limit, ceiling=limit if by_queue else state.limit, cause=cause)
    state = replace(state, waiting_streak=streak)
    # One request between its send and the next step is what a scrape catches of any engine that
    # is not full; more, or a longer wait, is a queue.
    if not demand or (sample.waiting > 0 and not between_steps) or sample.waiting > 1:
        return replace(state, calm=0, rose_from=None)
    if state.rose_from is not None and sample.throughput is not None:
        before_limit, before, waited = state.rose_from
        if before > 0 and sample.throughput < before * (1 + config.min_gain):
            if waited + 1 < config.judge_scrapes:
                # The scrape right after a rise catches its new sequences in their prefill, not yet
                # generating: it is judged on the next one, and the limit holds meanwhile.
                return replace(state, rose_from=(before_limit, before, waited + 1))
            # The rise brought nothing: the engine is full at what it had.
            return LimitState(before_limit, ceiling=before_limit, cause="the last rise brought no throughput")
    rise = _rise(state, config)
    if rise is None:
        return replace(state, rose_from=None)
    limit, ceiling, calm, probe, cause = rise
    limit = _clamp(limit, config)
    # Judged only on whole slots: a rise within one slot changes nothing the engine sees.
    judged = math.floor(limit) >= max(state.slots + 1, state.slots * (1 + config.judged_rise))
    rose_from = (state.limit, sample.throughput, 0) if judged and sample.throughput is not None else None
    return LimitState(limit, ceiling, streak, calm, probe, rose_from, cause)


def _congestion_cut(
    limit: float, sample: EngineSample, streak: int, config: LimitConfig
) -> tuple[float, bool, str] | None:
    """(the lowered limit, whether by the queue inside, why) when the sample shows congestion."""
    floor = limit * (1 - config.min_decrease)
    cuts: list[tuple[float, bool, str]] = []
    if sample.preempted > 0:
        cuts.append((floor, False, f"{sample.preempted:g} preempted"))
    if streak >= config.waiting_scrapes:
        cuts.append((limit - max(1.0, sample.waiting / 2), True, f"{sample.waiting:g} waiting inside"))
    late = sample.late_share
    if late is not None and late > config.late_objective:
        in_time = (1 - late) / (1 - config.late_objective) if config.late_objective < 1 else 0.0
        cause = f"{late:.0%} of the deadlines missed"
        cuts.append((min(floor, limit * max(0.5, in_time)), False, cause))
    objectives = (
        ("first-token latency", sample.ttft_s, config.ttft_objective_s),
        ("inter-token latency", sample.itl_s, config.itl_objective_s),
    )
    for name, measured, objective in objectives:
        if measured is not None and objective is not None and measured > objective:
            cause = f"{name} {measured * 1000:.0f} ms over {objective * 1000:.0f} ms"
            cuts.append((min(floor, limit * max(0.5, objective / measured)), False, cause))
    return min(cuts) if cuts else None


def _rise(state: LimitState, config: LimitConfig) -> tuple[float, float | None, int, float, str] | None:
    """(limit, ceiling, calm, probe, why) after a calm scrape that had demand; None at the cap."""
    limit, ceiling, probe = state.limit, state.ceiling, state.probe
    if limit >= config.max_limit:
        return None
    if ceiling is None:
        return max(limit + 1, limit * config.slow_start), None, 0, probe, "slow start"
    if limit + 1 <= ceiling:
        return max(limit + 1, limit + (ceiling - limit) / 2), ceiling, 0, probe, "toward the last ceiling"
    calm = state.calm + 1
    if calm < config.probe_every:
        return limit, ceiling, calm, probe, state.cause
    raised = limit + probe
    return raised, max(ceiling, raised), 0, min(2 * probe, max(1.0, limit / 4)), "probing above the ceiling"


def _clamp(limit: float, config: LimitConfig) -> float:
    return min(config.max_limit, max(config.min_limit, limit))
