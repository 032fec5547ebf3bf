"""How is a count of hand-overs distributed? Exact and approximate count distributions for
policies.handovers: Poisson-binomial, convolutions truncated where they stop mattering, Poisson and
negative binomial pmfs around their mode, and a continuity-corrected normal kept within exact
bounds."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from statistics import NormalDist

from policies.steps import Steps, finished

Pmf = tuple[int, list[float]]
"""A distribution on the integers: the first value it may take, and the probabilities from there."""

NEGLIGIBLE = 1e-9
"""A slot's tail probability this close to 0 or 1 is taken as 0 or 1 (mostly the prior's faded tail)."""
TRIMMED = 1e-10
"""Probabilities below this are dropped at the ends of a distribution."""


class Tails:
    """P(C >= c) for c up to one past the distribution's known part (beyond it, as there)."""

    __slots__ = ("_above", "offset")

    def __init__(self, pmf: Pmf) -> None:
        self.offset = pmf[0]
        # _above[i] = P(C >= offset + i): 1 at the offset, then 1 less the mass below.
        self._above = [1.0, *(max(0.0, 1.0 - below) for below in accumulate(pmf[1]))]

    def at_least(self, count: int) -> float:
        above = self._above
        index = count - self.offset
        return 1.0 if index <= 0 else above[min(index, len(above) - 1)]

    def run_at_least(self, first: int, n: int) -> list[float]:
        """[at_least(first), ..., at_least(first + n - 1)], by slices (for sums over many counts)."""
        above, start = self._above, first - self.offset
        last = len(above) - 1
        ones = min(n, max(0, -start))
        known = above[max(0, start) : max(0, min(start + n, last + 1))]
        return [1.0] * ones + known + [above[last]] * (n - ones - len(known))


class MixedGroup:
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
            return poisson(mean, upto)
        return negative_binomial(mean / (self.dispersion - 1), 1 / self.dispersion)


class MixedCounts:
    """free + the independent groups' counts."""

    def __init__(self, free: int, groups: list[MixedGroup]) -> None:
        self.free = free
        self.groups = groups
        self.mean = free + sum(group.mean for group in groups)
        self.variance = sum(group.variance for group in groups)
        self._tails: Tails | None = None
        self._tails_upto = -1

    def tails(self, upto: int) -> Tails:
        """The distribution up to `upto` hand-overs (exactly as far as it goes)."""
        if self._tails is not None and self._tails_upto >= upto:
            return self._tails  # most calls (a search's): no generator to make
        return finished(self.tails_steps(upto))

    def tails_steps(self, upto: int) -> Steps[Tails]:
        """`tails`, a group per step."""
        if self._tails is None or self._tails_upto < upto:
            total: Pmf = (self.free, [1.0])
            for group in self.groups:
                total = convolve(total, group.pmf(upto - self.free), upto)
                yield
            self._tails, self._tails_upto = Tails(total), upto
        return self._tails


class ConvolvedCounts:
    """free + the sum of independent slots' counts."""

    def __init__(self, free: int, slots: list[Pmf]) -> None:
        self.free = free
        self.slots = slots
        self.mean, self.variance = float(free), 0.0
        for start, probabilities in slots:
            mean = sum((start + i) * p for i, p in enumerate(probabilities))
            self.mean += mean
            self.variance += sum((start + i - mean) ** 2 * p for i, p in enumerate(probabilities))
        self._tails: Tails | None = None
        self._tails_upto = -1

    def tails(self, upto: int) -> Tails:
        """The distribution up to `upto` hand-overs (exactly as far as it goes)."""
        if self._tails is not None and self._tails_upto >= upto:
            return self._tails  # most calls (a search's): no generator to make
        return finished(self.tails_steps(upto))

    def tails_steps(self, upto: int) -> Steps[Tails]:
        """`tails`, a slot's convolution per step."""
        if self._tails is None or self._tails_upto < upto:
            total: Pmf = (self.free, [1.0])
            for slot in self.slots:
                total = convolve(total, slot, upto)
                yield
            self._tails, self._tails_upto = Tails(total), upto
        return self._tails


@dataclass(frozen=True, slots=True)
class NormalCounts:
    """A normal of the count's mean and variance, kept within what the first hand-overs allow."""

    mean: float
    variance: float
    free: int
    completed: Tails
    """The slots' first hand-overs: at least these are made, and nothing more before one of them."""

    def at_least(self, count: int, urgent_mean: float) -> float:
        """P(C - U >= count) for a count above the free slots, U Poisson of `urgent_mean`,
        continuity-corrected."""
        spread = math.sqrt(self.variance + urgent_mean)
        excess = self.mean - urgent_mean - (count - 0.5)
        normal = (excess >= 0) * 1.0 if spread == 0 else 0.5 * math.erfc(-excess / (spread * math.sqrt(2)))
        floor = self.completed.at_least(count - self.free) if urgent_mean == 0 else 0.0
        return min(self.completed.at_least(1), max(floor, normal))


Counts = MixedCounts | ConvolvedCounts | NormalCounts


@lru_cache(maxsize=64)
def z_of(confidence: float) -> float:
    return NormalDist().inv_cdf(confidence)


def rounded(p: float) -> float:
    """`p`, or 0 or 1 when negligibly far from them (a non-decreasing map: counts stay monotone)."""
    return 0.0 if p <= NEGLIGIBLE else 1.0 if p >= 1.0 - NEGLIGIBLE else p


def poisson_binomial(probabilities: list[float]) -> Pmf:
    """The number of successes among independent trials of these probabilities."""
    certain, pmf = 0, [1.0]
    for p in probabilities:
        if p == 1.0:
            certain += 1
        elif p > 0.0:
            q = 1.0 - p
            pmf = [a * q + b * p for a, b in zip([*pmf, 0.0], [0.0, *pmf], strict=True)]
            while pmf[-1] < TRIMMED:
                pmf.pop()
    return trimmed((certain, pmf))


def convolve(a: Pmf, b: Pmf, upto: int) -> Pmf:
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
    return trimmed((start, out), trailing=False)


def trimmed(pmf: Pmf, *, trailing: bool = True) -> Pmf:
    """Without the negligible probabilities at its start (and end)."""
    start, probabilities = pmf
    first = 0
    while first < len(probabilities) - 1 and probabilities[first] < TRIMMED:
        first += 1
    last = len(probabilities)
    while trailing and last > first + 1 and probabilities[last - 1] < TRIMMED:
        last -= 1
    return start + first, probabilities[first:last]


def poisson(mean: float, upto: int | None = None) -> Pmf:
    """A Poisson distribution's non-negligible probabilities (none beyond `upto`, the same below it)."""
    if mean <= 0:
        return 0, [1.0]
    if mean < 30:  # the common case, without logarithms: up from P(0)
        last = math.inf if upto is None else upto
        probabilities, p, j = [], math.exp(-mean), 0
        while (p >= TRIMMED or j <= mean) and j <= last:
            probabilities.append(p)
            j += 1
            p *= mean / j
        return 0, probabilities
    mode = math.floor(mean)
    peak = math.exp(-mean + mode * math.log(mean) - math.lgamma(mode + 1))
    start, probabilities = around_mode(mode, peak, lambda j: mean / (j + 1))
    return start, probabilities if upto is None else probabilities[: max(0, upto - start + 1)]


def negative_binomial(size: float, success: float) -> Pmf:
    """Failures before `size` successes of probability `success` (size need not be whole)."""
    if size <= 0:
        return 0, [1.0]
    fail = 1.0 - success
    mode = math.floor((size - 1) * fail / success) if size > 1 else 0
    log_peak = math.lgamma(size + mode) - math.lgamma(size) - math.lgamma(mode + 1)
    peak = math.exp(log_peak + size * math.log(success) + mode * math.log(fail))
    return around_mode(mode, peak, lambda j: (j + size) / (j + 1) * fail)


def around_mode(mode: int, peak: float, ratio: Callable[[int], float]) -> Pmf:
    """The probabilities p(j + 1) = p(j) * ratio(j) from p(mode) = peak out to negligible ones."""
    cut = peak * TRIMMED
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
