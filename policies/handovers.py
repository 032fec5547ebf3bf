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
    low while the first hand-overs are uncertain, but never falling as t grows.)
  Beyond it, C is a normal of the same mean and variance (continuity-corrected), kept between what
  the first hand-overs alone give and the chance that any has come.
- Without urgent work every probability here is non-decreasing in the time and the free slots by
  construction (each slot's count only grows with t; a free slot adds a hand-over and a count),
  within each of the two regimes; at the switch to the normal a count may step by about one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate, pairwise
from statistics import NormalDist

from policies.service_times import FIRST_EDGE_S, Residual, ServiceTimes


@dataclass(frozen=True, slots=True)
class PoolState:
    """The slots of one model's pool, as the gateway sees them now."""

    ages_s: tuple[float, ...]
    """How long each busy slot's request has run (one entry per busy slot)."""
    free_slots: int
    """Slots free now: each hands over at once, then starts a fresh service."""
    urgent_rate_per_s: float = 0.0
    """More urgent work admitted per second, in hand-overs (Poisson); it takes hand-overs first."""


LATTICE_CV = 0.5
"""Below this coefficient of variation, service times are counted slot by slot (see the rules)."""
LARGE_COUNT = 64.0
"""Above this many expected hand-overs, C is taken as normal."""
LARGE_CLOCKED_COUNT = 1024.0
"""The same for clock-like service (a bound on the expected count: later hand-overs <= t / mean - 1/2)."""
NODES = 8
"""Quantiles of a sum of fresh service times used for a clock-like slot's later hand-overs."""
LONGEST_WAIT_S = 1e9
"""wait_for's answer when the count is not reached within it (urgent work takes every hand-over)."""
_BISECTIONS = 10
_NEGLIGIBLE = 1e-9
"""A slot's tail probability this close to 0 or 1 is taken as 0 or 1 (mostly the prior's faded tail)."""
_TRIMMED = 1e-10
"""Probabilities below this are dropped at the ends of a distribution."""
_Z_NODES = tuple(NormalDist().inv_cdf((q + 0.5) / NODES) for q in range(NODES))
# Three-point Gauss-Legendre on [0, 1], for the integral of a residual cdf.
_GAUSS_3 = ((0.5 - 0.5 * math.sqrt(0.6), 5 / 18), (0.5, 8 / 18), (0.5 + 0.5 * math.sqrt(0.6), 5 / 18))

Pmf = tuple[int, list[float]]
"""A distribution on the integers: the first value it may take, and the probabilities from there."""


def handovers_within(state: PoolState, service: ServiceTimes, within_s: float, confidence: float) -> int:
    """The largest n such that P(at least n hand-overs reach the band within `within_s`) >= confidence."""
    _check_confidence(confidence)
    return _Pool(state, service).at(max(within_s, 0.0)).most(confidence)


def wait_for(state: PoolState, service: ServiceTimes, handovers: float, confidence: float) -> float:
    """The smallest t with P(at least `handovers` hand-overs reach the band by t) >= confidence (0 for
    handovers <= 0; a fractional count rounds up). Bounded search; returns a finite value even for huge
    counts.

    It halves or doubles from the mean service time to a bracket, then bisects it to 1e-4 of its
    width; which times it tries depends on the count only through which of them reach it, so the
    answer never falls as the count grows. At most LONGEST_WAIT_S.
    """
    _check_confidence(confidence)
    if handovers <= 0:
        return 0.0
    if math.isinf(handovers):
        return LONGEST_WAIT_S
    needed = math.ceil(handovers)
    if needed <= state.free_slots:
        return 0.0
    pool = _Pool(state, service)
    if not pool.slots:
        return LONGEST_WAIT_S

    def reaches(t: float) -> bool:
        return pool.at(t).reach(needed) >= confidence

    bracket = _bracket(reaches, pool.mean_s)
    if bracket is None:
        return LONGEST_WAIT_S
    low, high = bracket
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        low, high = (low, middle) if reaches(middle) else (middle, high)
    return high


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), not {confidence}")


def _bracket(reaches: Callable[[float], bool], anchor_s: float) -> tuple[float, float] | None:
    """Times (t, 2 t) of which the first fails and the second reaches, from `anchor_s` on."""
    t = anchor_s
    if reaches(t):
        for _ in range(64):
            if not reaches(t / 2):
                return t / 2, t
            t /= 2
        return 0.0, t
    while t < LONGEST_WAIT_S:
        longer = min(2 * t, LONGEST_WAIT_S)
        if reaches(longer):
            return t, longer
        t = longer
    return None


class _Pool:
    """The slots of a pool against one service distribution, ready to be counted at several times."""

    def __init__(self, state: PoolState, service: ServiceTimes) -> None:
        self.mean_s = max(service.mean_s, FIRST_EDGE_S)
        self.cv = service.cv
        self.lattice = self.cv < LATTICE_CV
        self.busy = [service.residual(age) for age in state.ages_s]
        self.fresh = service.residual(0.0)
        self.free = max(state.free_slots, 0)
        self.slots = len(self.busy) + self.free
        self.urgent_rate_per_s = max(state.urgent_rate_per_s, 0.0)
        # A renewal process counts about s / mean + (cv^2 - 1) / 2 after s seconds; with cv above 1
        # only s / mean is taken, which such services exceed early on.
        self.later_shift_s = (min(self.cv, 1.0) ** 2 - 1) / 2 * self.mean_s
        self._sum_nodes: dict[int, list[float]] = {}
        if self.lattice:
            self._sum_nodes[1] = sorted(service.quantile((q + 0.5) / NODES) for q in range(NODES))

    def at(self, t: float) -> _Band:
        """What reaches the band within `t`."""
        busy_firsts = [_rounded(residual.cdf(t)) for residual in self.busy]
        fresh_first = _rounded(self.fresh.cdf(t))
        counts = (
            self._slot_counts(t, busy_firsts, fresh_first)
            if self.lattice
            else self._renewal_counts(t, busy_firsts, fresh_first)
        )
        return _Band(counts, self.free, self.urgent_rate_per_s * t)

    # -- clock-like service: slot by slot --------------------------------------------------------------

    def _slot_counts(self, t: float, busy_firsts: list[float], fresh_first: float) -> _Counts:
        later_bound = max(0.0, t / self.mean_s - 0.5)
        if self.free + (sum(busy_firsts) + self.free * fresh_first) * (1 + later_bound) > LARGE_CLOCKED_COUNT:
            return self._normal_slot_counts(t, busy_firsts, fresh_first)
        slots = [self._slot_pmf(r, t, first) for r, first in zip(self.busy, busy_firsts, strict=True)]
        if self.free:
            slots.extend([self._slot_pmf(self.fresh, t, fresh_first)] * self.free)
        return _ConvolvedCounts(self.free, slots)

    def _slot_pmf(self, residual: Residual, t: float, first: float) -> Pmf:
        """One slot's hand-overs within `t`, from its tails P(N >= k) = P(R + T_(k-1) <= t)."""
        tails = [first]
        while tails[-1] > 0.0:
            tails.append(min(tails[-1], self._later_tail(residual, t, len(tails))))
        return _trimmed((0, [1.0 - tails[0], *(a - b for a, b in pairwise(tails))]))

    def _later_tail(self, residual: Residual, t: float, services: int) -> float:
        """P(R + T <= t), T the sum of `services` fresh service times, averaged over T's quantiles."""
        nodes = self._nodes(services)
        if t <= nodes[0]:
            return 0.0
        soonest = residual.cdf(t - nodes[0])
        if soonest <= _NEGLIGIBLE:
            return 0.0
        latest = residual.cdf(t - nodes[-1])
        if latest >= 1.0 - _NEGLIGIBLE:
            return 1.0
        return (soonest + latest + residual.mean_cdf_before(t, nodes[1:-1]) * (NODES - 2)) / NODES

    def _nodes(self, services: int) -> list[float]:
        nodes = self._sum_nodes.get(services)
        if nodes is None:
            spread = self.cv * self.mean_s * math.sqrt(services)
            nodes = [max(0.0, services * self.mean_s + z * spread) for z in _Z_NODES]
            self._sum_nodes[services] = nodes
        return nodes

    def _normal_slot_counts(self, t: float, busy_firsts: list[float], fresh_first: float) -> _NormalCounts:
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
        completed = _poisson_binomial([*busy_firsts, *[fresh_first] * self.free])
        return _NormalCounts(mean, variance, self.free, _Tails(completed))

    # -- spread-out service: first hand-overs exactly, later ones by renewal ----------------------------

    def _later_mean(self, residual: Residual, span: float) -> float:
        """E[max(0, span - R)] / mean: with span = t + (cv^2 - 1) / 2 * mean, the renewal count after
        the first hand-over."""
        if span <= 0:
            return 0.0
        return span * sum(weight * residual.cdf(span * x) for x, weight in _GAUSS_3) / self.mean_s

    def _renewal_counts(self, t: float, busy_firsts: list[float], fresh_first: float) -> _Counts:
        # Busy and free slots are two groups, each with its own later hand-overs per completed slot
        # (the group's mean per slot), so that a free slot adds to the count and changes nothing else.
        span = t + self.later_shift_s
        dispersion = max(self.cv**2, 1.0)
        groups = []
        if self.busy:
            later = sum(self._later_mean(r, span) for r in self.busy) / len(self.busy)
            groups.append(_MixedGroup(_poisson_binomial(busy_firsts), later, dispersion))
        if self.free:
            completed = _poisson_binomial([fresh_first] * self.free)
            groups.append(_MixedGroup(completed, self._later_mean(self.fresh, span), dispersion))
        counts = _MixedCounts(self.free, groups)
        if counts.mean <= LARGE_COUNT:
            return counts
        completed = (0, [1.0])
        for group in groups:
            completed = _convolve(completed, group.completed, len(busy_firsts) + self.free)
        return _NormalCounts(counts.mean, counts.variance, self.free, _Tails(completed))


class _Band:
    """The hand-overs that reach the band within one time: max(free, C - U)."""

    def __init__(self, counts: _Counts, free: int, urgent_mean: float) -> None:
        self.counts = counts
        self.free = free
        self.urgent_mean = urgent_mean
        self._urgent: Pmf | None = None

    def reach(self, needed: int) -> float:
        """P(at least `needed` hand-overs reach the band)."""
        if needed <= self.free:
            return 1.0
        counts = self.counts
        if isinstance(counts, _NormalCounts):
            return counts.at_least(needed, self.urgent_mean)
        if self._urgent is None:
            self._urgent = _poisson(self.urgent_mean)
        start, urgent = self._urgent
        tails = counts.tails(needed + start + len(urgent) - 1)
        return sum(p * tails.at_least(needed + start + i) for i, p in enumerate(urgent))

    def most(self, confidence: float) -> int:
        """The largest count reached with at least `confidence` (the free slots' always is)."""
        counts = self.counts
        spread = math.sqrt(counts.variance + self.urgent_mean)
        guess = counts.mean - self.urgent_mean + 0.5 - _z(confidence) * spread
        limit = max(self.free, math.floor(guess) + 2)
        while self.reach(limit) >= confidence:  # the guess was low: count further
            limit = 2 * limit + 8
        low = self.free
        while limit - low > 1:
            middle = (low + limit) // 2
            low, limit = (middle, limit) if self.reach(middle) >= confidence else (low, middle)
        return low


# -- distributions of the pool's count ---------------------------------------------------------------------


class _Tails:
    """P(C >= c) for c up to one past the distribution's known part."""

    __slots__ = ("below", "offset")

    def __init__(self, pmf: Pmf) -> None:
        self.offset = pmf[0]
        self.below = list(accumulate(pmf[1]))

    def at_least(self, count: int) -> float:
        index = count - self.offset
        if index <= 0:
            return 1.0
        return max(0.0, 1.0 - self.below[min(index, len(self.below)) - 1])


class _MixedGroup:
    """K + L for a group of slots: K completed (Poisson-binomial), L given K = k with mean k * later."""

    def __init__(self, completed: Pmf, later: float, dispersion: float) -> None:
        self.completed = completed
        self.later = later
        self.dispersion = dispersion
        offset, weights = completed
        k_mean = sum((offset + i) * w for i, w in enumerate(weights))
        k_variance = sum((offset + i - k_mean) ** 2 * w for i, w in enumerate(weights))
        self.mean = k_mean * (1 + later)
        self.variance = k_variance * (1 + later) ** 2 + k_mean * later * dispersion

    def pmf(self, upto: int) -> Pmf:
        """The group's count up to `upto` (exactly as far as it goes)."""
        offset, weights = self.completed
        most_completed = offset + len(weights) - 1
        start, later = self._later_pmf(most_completed) if most_completed else (0, [1.0])
        highest = most_completed + start + len(later) - 1  # beyond it the counts are negligible
        out = [0.0] * max(0, min(upto, highest) + 1)
        for i, weight in enumerate(weights):
            k = offset + i
            if k >= len(out):
                break
            start, later = self._later_pmf(k, len(out) - 1 - k) if k else (0, [1.0])
            first = k + start
            end = min(first + len(later), len(out))
            if first < end:
                out[first:end] = [o + weight * p for o, p in zip(out[first:end], later, strict=False)]
        return 0, out

    def _later_pmf(self, completed: int, upto: int | None = None) -> Pmf:
        mean = completed * self.later
        if self.dispersion <= 1.0:
            return _poisson(mean, upto)
        return _negative_binomial(mean / (self.dispersion - 1), 1 / self.dispersion)


class _MixedCounts:
    """free + the independent groups' counts."""

    def __init__(self, free: int, groups: list[_MixedGroup]) -> None:
        self.free = free
        self.groups = groups
        self.mean = free + sum(group.mean for group in groups)
        self.variance = sum(group.variance for group in groups)
        self._tails: _Tails | None = None
        self._tails_upto = -1

    def tails(self, upto: int) -> _Tails:
        """The distribution up to `upto` hand-overs (exactly as far as it goes)."""
        if self._tails is None or self._tails_upto < upto:
            total: Pmf = (self.free, [1.0])
            for group in self.groups:
                total = _convolve(total, group.pmf(upto - self.free), upto)
            self._tails, self._tails_upto = _Tails(total), upto
        return self._tails


class _ConvolvedCounts:
    """free + the sum of independent slots' counts."""

    def __init__(self, free: int, slots: list[Pmf]) -> None:
        self.free = free
        self.slots = slots
        self.mean, self.variance = float(free), 0.0
        for start, probabilities in slots:
            mean = sum((start + i) * p for i, p in enumerate(probabilities))
            self.mean += mean
            self.variance += sum((start + i - mean) ** 2 * p for i, p in enumerate(probabilities))
        self._tails: _Tails | None = None
        self._tails_upto = -1

    def tails(self, upto: int) -> _Tails:
        """The distribution up to `upto` hand-overs (exactly as far as it goes)."""
        if self._tails is None or self._tails_upto < upto:
            self._tails, self._tails_upto = self._count(upto), upto
        return self._tails

    def _count(self, upto: int) -> _Tails:
        total: Pmf = (self.free, [1.0])
        for slot in self.slots:
            total = _convolve(total, slot, upto)
        return _Tails(total)


@dataclass(frozen=True, slots=True)
class _NormalCounts:
    """A normal of the count's mean and variance, kept within what the first hand-overs allow."""

    mean: float
    variance: float
    free: int
    completed: _Tails
    """The slots' first hand-overs: at least these are made, and nothing more before one of them."""

    def at_least(self, count: int, urgent_mean: float) -> float:
        """P(C - U >= count) for a count above the free slots, U Poisson of `urgent_mean`,
        continuity-corrected."""
        spread = math.sqrt(self.variance + urgent_mean)
        excess = self.mean - urgent_mean - (count - 0.5)
        normal = (excess >= 0) * 1.0 if spread == 0 else 0.5 * math.erfc(-excess / (spread * math.sqrt(2)))
        floor = self.completed.at_least(count - self.free) if urgent_mean == 0 else 0.0
        return min(self.completed.at_least(1), max(floor, normal))


_Counts = _MixedCounts | _ConvolvedCounts | _NormalCounts


@lru_cache(maxsize=64)
def _z(confidence: float) -> float:
    return NormalDist().inv_cdf(confidence)


def _rounded(p: float) -> float:
    """`p`, or 0 or 1 when negligibly far from them (a non-decreasing map: counts stay monotone)."""
    return 0.0 if p <= _NEGLIGIBLE else 1.0 if p >= 1.0 - _NEGLIGIBLE else p


def _poisson_binomial(probabilities: list[float]) -> Pmf:
    """The number of successes among independent trials of these probabilities."""
    certain, pmf = 0, [1.0]
    for p in probabilities:
        if p == 1.0:
            certain += 1
        elif p > 0.0:
            q = 1.0 - p
            pmf = [a * q + b * p for a, b in zip([*pmf, 0.0], [0.0, *pmf], strict=True)]
            while pmf[-1] < _TRIMMED:
                pmf.pop()
    return _trimmed((certain, pmf))


def _convolve(a: Pmf, b: Pmf, upto: int) -> Pmf:
    """The distribution of the sum, up to `upto`."""
    (a_start, a_probabilities), (b_start, b_probabilities) = a, b
    start = a_start + b_start
    size = max(0, min(len(a_probabilities) + len(b_probabilities) - 1, upto - start + 1))
    if len(a_probabilities) == 1:
        a_probabilities, b_probabilities = b_probabilities, a_probabilities
    if len(b_probabilities) == 1:  # one side's count is known: a shift
        weight = b_probabilities[0]
        return start, [p * weight for p in a_probabilities[:size]] if weight != 1.0 else a_probabilities[
            :size
        ]
    out = [0.0] * size
    for j, weight in enumerate(b_probabilities[:size]):
        end = min(j + len(a_probabilities), size)
        out[j:end] = [o + weight * p for o, p in zip(out[j:end], a_probabilities, strict=False)]
    return _trimmed((start, out), trailing=False)


def _trimmed(pmf: Pmf, *, trailing: bool = True) -> Pmf:
    """Without the negligible probabilities at its start (and end)."""
    start, probabilities = pmf
    first = 0
    while first < len(probabilities) - 1 and probabilities[first] < _TRIMMED:
        first += 1
    last = len(probabilities)
    while trailing and last > first + 1 and probabilities[last - 1] < _TRIMMED:
        last -= 1
    return start + first, probabilities[first:last]


def _poisson(mean: float, upto: int | None = None) -> Pmf:
    """A Poisson distribution's non-negligible probabilities (none beyond `upto`, the same below it)."""
    if mean <= 0:
        return 0, [1.0]
    if mean < 30:  # the common case, without logarithms: up from P(0)
        last = math.inf if upto is None else upto
        probabilities, p, j = [], math.exp(-mean), 0
        while (p >= _TRIMMED or j <= mean) and j <= last:
            probabilities.append(p)
            j += 1
            p *= mean / j
        return 0, probabilities
    mode = math.floor(mean)
    peak = math.exp(-mean + mode * math.log(mean) - math.lgamma(mode + 1))
    start, probabilities = _around_mode(mode, peak, lambda j: mean / (j + 1))
    return start, probabilities if upto is None else probabilities[: max(0, upto - start + 1)]


def _negative_binomial(size: float, success: float) -> Pmf:
    """Failures before `size` successes of probability `success` (size need not be whole)."""
    if size <= 0:
        return 0, [1.0]
    fail = 1.0 - success
    mode = math.floor((size - 1) * fail / success) if size > 1 else 0
    log_peak = math.lgamma(size + mode) - math.lgamma(size) - math.lgamma(mode + 1)
    peak = math.exp(log_peak + size * math.log(success) + mode * math.log(fail))
    return _around_mode(mode, peak, lambda j: (j + size) / (j + 1) * fail)


def _around_mode(mode: int, peak: float, ratio: Callable[[int], float]) -> Pmf:
    """The probabilities p(j + 1) = p(j) * ratio(j) from p(mode) = peak out to negligible ones."""
    cut = peak * _TRIMMED
    below: list[float] = []
    p, j = peak, mode
    while j > 0:
        j -= 1
        p /= ratio(j)
        if p < cut:
            break
        below.append(p)
    above: list[float] = []
    p, j = peak, mode
    while p >= cut:
        p *= ratio(j)
        j += 1
        above.append(p)
    return mode - len(below), [*reversed(below), peak, *above]
