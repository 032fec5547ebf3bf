"""How many hand-overs reach a band within a time, and how long until n have?

A band's request waits until `n` hand-overs (slot turnovers) have reached its band, its own
included. Rules this module keeps:
- A busy slot hands over first when its request ends, after its residual time R_i (the service
  distribution conditioned on that request's age), then after each fresh service time. A free slot
  hands over at once, then counts like a busy slot whose request has just started.
- More urgent work arrives as a Poisson stream U of hand-overs and takes them first: the band has
  max(free_slots, C(t) - U(t)) by time t, C counting the pool's hand-overs (the free slots' go before
  anything can arrive). Urgent work cannot take back a hand-over made before it came, so this
  understates the band's count, and unlike that count it can fall in t while no slot ends.
- While the expected count is at most LARGE_COUNT (LARGE_CLOCKED_COUNT for clock-like service, whose
  slots are cheap to count), C is counted exactly in structure:
  - service times of little spread (cv < LATTICE_CV) hand over like clocks, and a sum of such counts
    must not be smoothed into fractions: each slot's count comes from its tails P(R_i + T_k <= t)
    (T_k: k fresh service times, at NODES quantiles), and the slots' counts are convolved;
  - otherwise, in each group of slots (busy, free), the first hand-overs are an exact
    Poisson-binomial K, and the later ones, given K = k, Poisson (negative binomial when cv > 1)
    with k times the group's renewal mean per slot; none when K = 0, so one hand-over is never
    predicted before the soonest-finishing slot ends. (Per slot, not per completed slot: a little
    low while the first hand-overs are uncertain, but never falling as t grows.) A slot's renewal
    mean is the time left after its first hand-over over the mean service time, and where service
    times vary more than exponential ones (cv > 1) at least the renewal function (policies.renewals)
    averaged over that hand-over's time: a mix of short and long services counts far above t / mean
    while no long one has come. The average reads the hand-over at the upper ends of FIRST_NODES
    equal shares of its distribution (the last share counts none), so it never exceeds the exact one.
    The renewal function's excess is taken only while counted exactly, and only so far as to bring
    the mean to LARGE_COUNT: the normal beyond cannot show how skewed such a count is (its median
    far below its mean), and with the larger mean it read more than comes at moderate confidence.
  Beyond it, C is a normal of the same mean and variance (continuity-corrected), kept between what
  the first hand-overs alone give and the chance that any has come.
- Without urgent work every probability here is non-decreasing in the time and the free slots by
  construction (each slot's count only grows with t; a free slot adds a hand-over and a count),
  within each of the two regimes. At the switch to the normal a count may step: by about one where
  the count is near normal, by more where a few slots' counts are very skewed (a review saw 12 -> 1
  for one slot of lognormal sigma 2 service at confidence 0.99), the normal reading the lower.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from operator import mul
from statistics import NormalDist

from policies.handover_counts import (
    NEGLIGIBLE,
    ConvolvedCounts,
    Counts,
    MixedCounts,
    MixedGroup,
    NormalCounts,
    Pmf,
    Tails,
    convolve,
    poisson,
    poisson_binomial,
    rounded,
    trimmed,
    z_of,
)
from policies.service_times import FIRST_EDGE_S, Residual, ServiceTimes
from policies.steps import Steps, finished, known


@dataclass(frozen=True, slots=True)
class PoolState:
    """The slots of one model's pool, as the gateway sees them now."""

    ages_s: tuple[float, ...]
    """How long each busy slot's request has run (one entry per busy slot)."""
    free_slots: int
    """Slots free now: each hands over at once, then starts a fresh service."""
    urgent_rate_per_s: float = 0.0
    """More urgent work admitted per second, in hand-overs (Poisson); it takes hand-overs first."""
    busy_service: tuple[ServiceTimes | None, ...] = ()
    """Per busy slot, in `ages_s`'s order, the service times of its request's kind where they are
    known (policies.request_kinds): its residual time is read from them. None, or missing: the
    pool's. The slots' later services are the pool's: what comes next is of any kind."""


LATTICE_CV = 0.5
"""Below this coefficient of variation, service times are counted slot by slot (see the rules)."""
LARGE_COUNT = 64.0
"""Above this many expected hand-overs, C is taken as normal."""
LARGE_CLOCKED_COUNT = 1024.0
"""The same for clock-like service (a bound on the expected count: later hand-overs <= t / mean - 1/2)."""
NODES = 8
"""Quantiles of a sum of fresh service times used for a clock-like slot's later hand-overs."""
FIRST_NODES = 8
"""Shares of a slot's first hand-over time over which a spread-out slot's renewal function is read."""
LONGEST_WAIT_S = 1e9
"""wait_for's answer when the count is not reached within it (urgent work takes every hand-over)."""
_BISECTIONS = 10
_Z_NODES = tuple(NormalDist().inv_cdf((q + 0.5) / NODES) for q in range(NODES))
# Three-point Gauss-Legendre on [0, 1], for the integral of a residual cdf.
_GAUSS_3 = ((0.5 - 0.5 * math.sqrt(0.6), 5 / 18), (0.5, 8 / 18), (0.5 + 0.5 * math.sqrt(0.6), 5 / 18))


def handovers_within(state: PoolState, service: ServiceTimes, within_s: float, confidence: float) -> int:
    """The largest n such that P(at least n hand-overs reach the band within `within_s`) >= confidence."""
    return finished(handovers_within_steps(state, service, within_s, confidence))


def handovers_within_steps(
    state: PoolState, service: ServiceTimes, within_s: float, confidence: float
) -> Steps[int]:
    """handovers_within, a busy slot's count per step (clock-like service counts each slot apart, at
    tens to hundreds of microseconds each): a caller that must not stall (an event loop) runs it a
    step at a time. The pool is read as it is now; the steps' value is handovers_within's."""
    _check_confidence(confidence)
    return _most_within(_Pool(state, service), max(within_s, 0.0), confidence)


def _most_within(pool: _Pool, t: float, confidence: float) -> Steps[int]:
    band = yield from pool.at_steps(t)
    return (yield from band.most_steps(confidence))


def wait_for(state: PoolState, service: ServiceTimes, handovers: float, confidence: float) -> float:
    """The smallest t with P(at least `handovers` hand-overs reach the band by t) >= confidence (0 for
    handovers <= 0; a fractional count rounds up). Bounded search; returns a finite value even for huge
    counts.

    It halves or doubles from the mean service time to a bracket, then bisects it to 1e-4 of its
    width; which times it tries depends on the count only through which of them reach it, so the
    answer never falls as the count grows. At most LONGEST_WAIT_S.
    """
    return finished(wait_steps(state, service, handovers, confidence))


def wait_steps(state: PoolState, service: ServiceTimes, handovers: float, confidence: float) -> Steps[float]:
    """wait_for, one reading of the pool per step: the search reads it up to about twenty times, at
    up to a millisecond each, so a caller that must not stall that long (an event loop) runs it a
    step at a time. The pool is read as it is now; the steps' value is wait_for's."""
    _check_confidence(confidence)
    if handovers <= 0:
        return known(0.0)
    if math.isinf(handovers):
        return known(LONGEST_WAIT_S)
    needed = math.ceil(handovers)
    if needed <= state.free_slots:
        return known(0.0)
    pool = _Pool(state, service)
    if not pool.slots:
        return known(LONGEST_WAIT_S)
    return _search(pool, needed, confidence)


def _search(pool: _Pool, needed: int, confidence: float) -> Steps[float]:
    def reaches(t: float) -> bool:
        return pool.at(t).reach(needed) >= confidence

    bracket = yield from _bracket(reaches, pool.mean_s)
    if bracket is None:
        return LONGEST_WAIT_S
    low, high = bracket
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        low, high = (low, middle) if reaches(middle) else (middle, high)
        yield
    return high


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), not {confidence}")


def _bracket(reaches: Callable[[float], bool], anchor_s: float) -> Steps[tuple[float, float] | None]:
    """Times (t, 2 t) of which the first fails and the second reaches, from `anchor_s` on."""
    t = anchor_s
    reached = reaches(t)
    yield
    if reached:
        for _ in range(64):
            reached = reaches(t / 2)
            yield
            if not reached:
                return t / 2, t
            t /= 2
        return 0.0, t
    while t < LONGEST_WAIT_S:
        longer = min(2 * t, LONGEST_WAIT_S)
        reached = reaches(longer)
        yield
        if reached:
            return t, longer
        t = longer
    return None


def _busy_residuals(state: PoolState, service: ServiceTimes) -> list[Residual]:
    """Each busy slot's residual time: from its kind's service times where given, else the pool's."""
    own = state.busy_service
    residuals = []
    for i, age in enumerate(state.ages_s):
        times = own[i] if i < len(own) else None
        residuals.append((service if times is None else times).residual(age))
    return residuals


class _Pool:
    """The slots of a pool against one service distribution, ready to be counted at several times."""

    def __init__(self, state: PoolState, service: ServiceTimes) -> None:
        self.mean_s = max(service.mean_s, FIRST_EDGE_S)
        self.cv = service.cv
        self.lattice = self.cv < LATTICE_CV
        self.busy = _busy_residuals(state, service)
        self.fresh = service.residual(0.0)
        self.free = max(state.free_slots, 0)
        self.slots = len(self.busy) + self.free
        self.urgent_rate_per_s = max(state.urgent_rate_per_s, 0.0)
        # A renewal process counts about s / mean + (cv^2 - 1) / 2 after s seconds; with cv above 1
        # only s / mean is taken, which such services exceed early on.
        self.later_shift_s = (min(self.cv, 1.0) ** 2 - 1) / 2 * self.mean_s
        self._sum_nodes: dict[int, list[float]] = {}
        self.renewals = service.renewals() if self.cv > 1.0 else None
        self.busy_firsts_s = [s for r in self.busy for s in _first_nodes(r)] if self.renewals else []
        self.fresh_firsts_s = _first_nodes(self.fresh) if self.renewals else []
        if self.lattice:
            self._sum_nodes[1] = sorted(service.quantile((q + 0.5) / NODES) for q in range(NODES))

    def at(self, t: float) -> _Band:
        """What reaches the band within `t`."""
        return finished(self.at_steps(t))

    def at_steps(self, t: float) -> Steps[_Band]:
        """`at`: a step per busy slot where service is clock-like, none otherwise."""
        busy_firsts = [rounded(residual.cdf(t)) for residual in self.busy]
        fresh_first = rounded(self.fresh.cdf(t))
        if self.lattice:
            counts = yield from self._slot_counts(t, busy_firsts, fresh_first)
        else:
            counts = self._renewal_counts(t, busy_firsts, fresh_first)
        return _Band(counts, self.free, self.urgent_rate_per_s * t)

    # -- clock-like service: slot by slot --------------------------------------------------------------

    def _slot_counts(self, t: float, busy_firsts: list[float], fresh_first: float) -> Steps[Counts]:
        later_bound = max(0.0, t / self.mean_s - 0.5)
        if self.free + (sum(busy_firsts) + self.free * fresh_first) * (1 + later_bound) > LARGE_CLOCKED_COUNT:
            return self._normal_slot_counts(t, busy_firsts, fresh_first)
        slots: list[Pmf] = []
        for residual, first in zip(self.busy, busy_firsts, strict=True):
            slots.append(self._slot_pmf(residual, t, first))
            yield
        if self.free:
            slots.extend([self._slot_pmf(self.fresh, t, fresh_first)] * self.free)
        return ConvolvedCounts(self.free, slots)

    def _slot_pmf(self, residual: Residual, t: float, first: float) -> Pmf:
        """One slot's hand-overs within `t`, from its tails P(N >= k) = P(R + T_(k-1) <= t)."""
        # The tails that are certain (1) are skipped: over a long window they are most of them.
        certain = self._certain_services(residual, t) if first == 1.0 else 0
        tails = [first]
        while tails[-1] > 0.0:
            tails.append(min(tails[-1], self._later_tail(residual, t, certain + len(tails))))
        return trimmed((certain, [1.0 - tails[0], *(a - b for a, b in pairwise(tails))]))

    def _certain_services(self, residual: Residual, t: float) -> int:
        """The most fresh services k such that _later_tail gives 1 for every count up to k (0 when it
        does not for one). Beyond one service the latest node grows with k, so it bisects."""

        def certain(services: int) -> bool:
            return residual.cdf(t - self._nodes(services)[-1]) >= 1.0 - NEGLIGIBLE

        if not certain(1):
            return 0
        low, high = 1, math.floor(t / self.mean_s) + 1  # the latest node of `high` services is past t
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if certain(middle) else (low, middle)
        return low

    def _later_tail(self, residual: Residual, t: float, services: int) -> float:
        """P(R + T <= t), T the sum of `services` fresh service times, averaged over T's quantiles."""
        nodes = self._nodes(services)
        if t <= nodes[0]:
            return 0.0
        soonest = residual.cdf(t - nodes[0])
        if soonest <= NEGLIGIBLE:
            return 0.0
        latest = residual.cdf(t - nodes[-1])
        if latest >= 1.0 - NEGLIGIBLE:
            return 1.0
        return (soonest + latest + residual.mean_cdf_before(t, nodes[1:-1]) * (NODES - 2)) / NODES

    def _nodes(self, services: int) -> list[float]:
        nodes = self._sum_nodes.get(services)
        if nodes is None:
            spread = self.cv * self.mean_s * math.sqrt(services)
            nodes = [max(0.0, services * self.mean_s + z * spread) for z in _Z_NODES]
            self._sum_nodes[services] = nodes
        return nodes

    def _normal_slot_counts(self, t: float, busy_firsts: list[float], fresh_first: float) -> NormalCounts:
        mean, variance = float(self.free), 0.0
        groups = [(r, first, 1) for r, first in zip(self.busy, busy_firsts, strict=True)]
        for residual, first, copies in [*groups, (self.fresh, fresh_first, self.free)]:
            # A clock's count after s seconds is floor(s / mean): none before one mean, then, over
            # the phases the normal does not know, s / mean - 1/2.
            later = self._later_mean(residual, t - self.mean_s) + 0.5 * residual.cdf(t - self.mean_s)
            mean += copies * (first + later)
            # A clock-like slot's count is whole, at a phase the normal does not know: 1/12 more.
            unfinished = (1 - first) * later * (2 + later / first) if first > 0 else 0.0
            variance += copies * (first * (1 - first) + self.cv**2 * later + unfinished + 1 / 12)
        completed = poisson_binomial([*busy_firsts, *[fresh_first] * self.free])
        return NormalCounts(mean, variance, self.free, Tails(completed))

    # -- spread-out service: first hand-overs exactly, later ones by renewal ----------------------------

    def _later_mean(self, residual: Residual, span: float) -> float:
        """E[max(0, span - R)] / mean: with span = t + (cv^2 - 1) / 2 * mean, the renewal count after
        the first hand-over."""
        if span <= 0:
            return 0.0
        return span * sum(weight * residual.cdf(span * x) for x, weight in _GAUSS_3) / self.mean_s

    def _later_counts(
        self, residuals: list[Residual], firsts_s: list[float], span: float, t: float
    ) -> tuple[float, float]:
        """A group of spread-out slots' mean count per slot after its first hand-over, within `t`
        (see the rules): time over the mean, and at least the renewal function's where cv > 1."""
        linear = sum(self._later_mean(r, span) for r in residuals) / len(residuals)
        if self.renewals is None:
            return linear, linear
        renewal = self.renewals.total_after(firsts_s, t) / (len(residuals) * FIRST_NODES)
        return linear, max(linear, renewal)

    def _renewal_counts(self, t: float, busy_firsts: list[float], fresh_first: float) -> Counts:
        # Busy and free slots are two groups, each with its own later hand-overs per completed slot
        # (the group's mean per slot), so that a free slot adds to the count and changes nothing else.
        span = t + self.later_shift_s
        dispersion = max(self.cv**2, 1.0)
        firsts: list[Pmf] = []
        laters: list[tuple[float, float]] = []
        if self.busy:
            firsts.append(poisson_binomial(busy_firsts))
            laters.append(self._later_counts(self.busy, self.busy_firsts_s, span, t))
        if self.free:
            firsts.append(poisson_binomial([fresh_first] * self.free))
            laters.append(self._later_counts([self.fresh], self.fresh_firsts_s, span, t))

        def counts(later: list[float]) -> MixedCounts:
            groups = [MixedGroup(k, per_slot, dispersion) for k, per_slot in zip(firsts, later, strict=True)]
            return MixedCounts(self.free, groups)

        linear = counts([lin for lin, _ in laters])
        if linear.mean > LARGE_COUNT:
            # A count this large is read as a normal, which cannot show how skewed a long-or-short
            # pool's count is (its median far below its mean): the renewal function's larger mean
            # would read it above what comes. Time over the mean keeps it below.
            completed = (0, [1.0])
            for k in firsts:
                completed = convolve(completed, k, len(busy_firsts) + self.free)
            return NormalCounts(linear.mean, linear.variance, self.free, Tails(completed))
        if self.renewals is None:
            return linear
        renewal = counts([ren for _, ren in laters])
        if renewal.mean <= LARGE_COUNT:
            return renewal
        # Counted exactly up to LARGE_COUNT only: the renewal function's excess is taken in the
        # share that brings the mean there, so the mean neither falls nor passes it as t grows.
        share = (LARGE_COUNT - linear.mean) / (renewal.mean - linear.mean)
        return counts([lin + share * (ren - lin) for lin, ren in laters])


def _first_nodes(residual: Residual) -> list[float]:
    """The upper ends of FIRST_NODES equal shares of a slot's first hand-over time, the last left
    out: read as the hand-over times, they never overstate what comes after them."""
    return [residual.quantile(share / FIRST_NODES) for share in range(1, FIRST_NODES)]


class _Band:
    """The hand-overs that reach the band within one time: max(free, C - U)."""

    def __init__(self, counts: Counts, free: int, urgent_mean: float) -> None:
        self.counts = counts
        self.free = free
        self.urgent_mean = urgent_mean
        self._urgent: Pmf | None = None

    def reach(self, needed: int) -> float:
        """P(at least `needed` hand-overs reach the band)."""
        if needed <= self.free:
            return 1.0
        counts = self.counts
        if isinstance(counts, NormalCounts):
            return counts.at_least(needed, self.urgent_mean)
        start, urgent = self._urgent_pmf()
        tails = counts.tails(needed + start + len(urgent) - 1)
        reached: float = sum(map(mul, urgent, tails.run_at_least(needed + start, len(urgent))))
        return reached

    def _urgent_pmf(self) -> Pmf:
        if self._urgent is None:
            self._urgent = poisson(self.urgent_mean)
        return self._urgent

    def most(self, confidence: float) -> int:
        """The largest count reached with at least `confidence` (the free slots' always is)."""
        return finished(self.most_steps(confidence))

    def most_steps(self, confidence: float) -> Steps[int]:
        """`most`, the distribution its first guess reads counted a slot per step (the rest of the
        search mostly reads what that counted)."""
        counts = self.counts
        spread = math.sqrt(counts.variance + self.urgent_mean)
        guess = counts.mean - self.urgent_mean + 0.5 - z_of(confidence) * spread
        limit = max(self.free, math.floor(guess) + 2)
        if limit > self.free and not isinstance(counts, NormalCounts):
            start, urgent = self._urgent_pmf()
            yield from counts.tails_steps(limit + start + len(urgent) - 1)
        while self.reach(limit) >= confidence:  # the guess was low: count further
            limit = 2 * limit + 8
        low = self.free
        while limit - low > 1:
            middle = (low + limit) // 2
            low, limit = (middle, limit) if self.reach(middle) >= confidence else (low, middle)
        return low
