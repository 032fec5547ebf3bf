"""What do a model's service times look like, and how long will a request that has run `age` s still take?

Rules this module keeps:
- Recent service times are held in a histogram on fixed log-spaced bins: [0, FIRST_EDGE_S), then
  BINS_PER_OCTAVE bins per doubling up to LONGEST_S (about 2,100 s). Within a bin the mass is spread
  evenly, so the cdf is linear inside it. A time beyond LONGEST_S counts as LONGEST_S, a negative one
  as 0 (clock skew).
- Each new sample weighs 1 and every older one (1 - 1/memory) times what it weighed before, so the
  histogram remembers about `memory` samples. Recording is O(1): the newest sample weighs a growing
  scale, and all weights are divided by it once it grows large.
- Until samples come, the distribution is the prior: an exponential with the operator's expected
  service time, worth `prior_weight` samples, forgotten as a sample is.
- The residual time of a request that has run `age` seconds is the distribution conditioned on
  exceeding `age`. A request older than (nearly) all the mass is one we know nothing about: its
  residual is exponential with the mean service time, never "already done".
- Lookups are O(log bins): a bisection over the cumulative masses, rebuilt after a record when next
  asked. A `Residual` keeps the masses it was built from, so it stays one consistent snapshot.
- The renewal function (policies.renewals) is solved from the histogram when asked, and kept until
  the histogram has taken in a quarter of its memory in new samples: it costs about a millisecond
  and a half, and a few new samples barely move it.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from itertools import accumulate, pairwise

from policies.renewals import Renewals

FIRST_EDGE_S = 0.00025
BINS_PER_OCTAVE = 16
OCTAVES = 23
EDGES: tuple[float, ...] = (
    0.0,
    *(FIRST_EDGE_S * 2 ** (i / BINS_PER_OCTAVE) for i in range(OCTAVES * BINS_PER_OCTAVE + 1)),
)
"""Bin edges: bin j holds [EDGES[j], EDGES[j + 1])."""
LONGEST_S = EDGES[-1]
_LAST_BIN = len(EDGES) - 2
_INVERSE_WIDTHS: tuple[float, ...] = tuple(1.0 / (hi - lo) for lo, hi in pairwise(EDGES))
_RESCALE_AT = 1e100

UNKNOWN_SURVIVAL = 1e-9
"""Below this share of the mass left above its age, a request's residual is taken as unknown (exponential)."""


def _exponential_masses(mean_s: float, weight: float) -> list[float]:
    """The mass of an exponential distribution in each bin; the last bin takes the tail beyond it."""
    survivals = [math.exp(-edge / mean_s) for edge in EDGES]
    masses = [weight * (above - beyond) for above, beyond in pairwise(survivals)]
    masses[-1] += weight * survivals[-1]
    return masses


class Residual:
    """The remaining service time of a request that has run `age_s` seconds, on one snapshot."""

    __slots__ = ("_above", "_age_s", "_below_age", "_cumulative", "_unknown_mean_s")

    def __init__(self, cumulative: list[float], age_s: float, mean_s: float) -> None:
        self._cumulative = cumulative
        self._age_s = max(age_s, 0.0)
        self._below_age = _mass_below(cumulative, self._age_s)
        total = cumulative[-1]
        above = total - self._below_age
        self._above = above if above > total * UNKNOWN_SURVIVAL else 0.0
        self._unknown_mean_s = max(mean_s, FIRST_EDGE_S)

    def cdf(self, within_s: float) -> float:
        """P(the request ends within `within_s` more seconds)."""
        if within_s <= 0:
            return 0.0
        above = self._above
        if above == 0.0:
            return -math.expm1(-within_s / self._unknown_mean_s)
        t = self._age_s + within_s
        if t >= LONGEST_S:
            return 1.0
        # _mass_below, inlined: this is the innermost call of every count in policies.handovers.
        cumulative = self._cumulative
        j = bisect_right(EDGES, t) - 1
        below = cumulative[j]
        ended = (
            below + (cumulative[j + 1] - below) * (t - EDGES[j]) * _INVERSE_WIDTHS[j] - self._below_age
        ) / above
        return 1.0 if ended > 1.0 else ended if ended > 0.0 else 0.0

    def quantile(self, q: float) -> float:
        """The smallest remaining time within which the request ends with probability q, in [0, 1)."""
        q = min(max(q, 0.0), 1.0)
        if self._above == 0.0:
            return -self._unknown_mean_s * math.log1p(-q) if q < 1.0 else math.inf
        return max(0.0, _time_at_mass(self._cumulative, self._below_age + q * self._above) - self._age_s)

    def mean_cdf_before(self, t_s: float, offsets_s: list[float]) -> float:
        """The mean over `offsets_s` of cdf(t_s - offset): P(ends before t_s less a random delay)."""
        total = 0.0
        for offset in offsets_s:
            total += self.cdf(t_s - offset)
        return total / len(offsets_s)


def _time_at_mass(cumulative: list[float], target: float) -> float:
    """The smallest t with _mass_below(cumulative, t) >= target (the top of the mass past it)."""
    # A target a rounding above the total would land in an empty last bin, of no width in mass.
    target = min(target, cumulative[-1])
    j = bisect_left(cumulative, target)
    if j == 0:
        return 0.0
    j = min(j, len(cumulative) - 1) - 1
    share = (target - cumulative[j]) / (cumulative[j + 1] - cumulative[j])
    return EDGES[j] + (EDGES[j + 1] - EDGES[j]) * share


def _mass_below(cumulative: list[float], t: float) -> float:
    """The mass below `t`, linear within its bin."""
    if t <= 0:
        return 0.0
    if t >= LONGEST_S:
        return cumulative[-1]
    j = bisect_right(EDGES, t) - 1
    below = cumulative[j]
    return below + (cumulative[j + 1] - below) * (t - EDGES[j]) * _INVERSE_WIDTHS[j]


class ServiceTimes:
    """A decaying histogram of one model's service times, with an exponential prior (see the module rules)."""

    __slots__ = (
        "_cumulative",
        "_growth",
        "_masses",
        "_renewals",
        "_renewals_at",
        "_renewals_every",
        "_samples",
        "_scale",
        "_sum_s",
        "_sum_sq_s",
        "_weight",
    )

    def __init__(self, prior_mean_s: float, *, memory: float = 200.0, prior_weight: float = 1.0) -> None:
        if not (prior_mean_s > 0 and memory > 1 and prior_weight > 0):
            raise ValueError("prior_mean_s and prior_weight must be positive, memory above 1")
        self._growth = 1.0 / (1.0 - 1.0 / memory)
        self._scale = 1.0
        self._masses = _exponential_masses(prior_mean_s, prior_weight)
        self._weight = prior_weight
        self._sum_s = prior_weight * prior_mean_s
        self._sum_sq_s = prior_weight * 2.0 * prior_mean_s**2
        self._samples = 0
        self._cumulative: list[float] | None = None
        self._renewals: Renewals | None = None
        self._renewals_at = 0
        self._renewals_every = max(1, round(memory / 4))

    def record(self, service_s: float) -> None:
        """Count one observed service time; every earlier one weighs (1 - 1/memory) less."""
        if math.isnan(service_s):
            raise ValueError("a service time must be a number")
        x = min(max(service_s, 0.0), LONGEST_S)
        self._scale *= self._growth
        self._masses[min(bisect_right(EDGES, x) - 1, _LAST_BIN)] += self._scale
        self._weight += self._scale
        self._sum_s += self._scale * x
        self._sum_sq_s += self._scale * x * x
        self._samples += 1
        self._cumulative = None
        if self._scale > _RESCALE_AT:
            self._rescale()

    def _rescale(self) -> None:
        shrink = 1.0 / self._scale
        self._masses = [mass * shrink for mass in self._masses]
        self._weight *= shrink
        self._sum_s *= shrink
        self._sum_sq_s *= shrink
        self._scale = 1.0

    def _cumulative_masses(self) -> list[float]:
        if self._cumulative is None:
            self._cumulative = [0.0, *accumulate(self._masses)]
        return self._cumulative

    @property
    def samples(self) -> int:
        """Service times recorded so far."""
        return self._samples

    @property
    def mean_s(self) -> float:
        """The weighted mean service time (the prior's while few samples have come)."""
        return self._sum_s / self._weight

    @property
    def cv(self) -> float:
        """The coefficient of variation (spread over mean), the mean taken as at least FIRST_EDGE_S
        as the pool readings take it: service times of about 0 (a backend that answers from a
        cache, or at once with an error) leave a mean near 0 and no spread to speak of, not a cv in
        the thousands that would make every reading expect hand-overs to come in rare clumps."""
        mean = self.mean_s
        spread = math.sqrt(max(0.0, self._sum_sq_s / self._weight - mean * mean))
        return spread / max(mean, FIRST_EDGE_S)

    def cdf(self, t_s: float) -> float:
        """P(a service time <= t_s)."""
        cumulative = self._cumulative_masses()
        return min(1.0, _mass_below(cumulative, t_s) / cumulative[-1])

    def survival(self, t_s: float) -> float:
        """P(a service time > t_s), precise in the tail."""
        cumulative = self._cumulative_masses()
        return max(0.0, (cumulative[-1] - _mass_below(cumulative, t_s)) / cumulative[-1])

    def quantile(self, q: float) -> float:
        """The smallest t with cdf(t) >= q, for q in [0, 1]."""
        cumulative = self._cumulative_masses()
        return _time_at_mass(cumulative, min(max(q, 0.0), 1.0) * cumulative[-1])

    def renewals(self) -> Renewals:
        """The renewal function of these service times, solved again once a quarter of the
        histogram's memory has come in new samples since it last was."""
        if self._renewals is None or self._samples - self._renewals_at >= self._renewals_every:
            self._renewals = Renewals(self.cdf, max(self.mean_s, FIRST_EDGE_S))
            self._renewals_at = self._samples
        return self._renewals

    def residual(self, age_s: float) -> Residual:
        """The remaining service time of a request that has run `age_s` seconds, on today's histogram."""
        return Residual(self._cumulative_masses(), age_s, self.mean_s)

    def residual_cdf(self, age_s: float, within_s: float) -> float:
        """P(X <= age + within | X > age): a request that has run `age_s` ends within `within_s` more."""
        return self.residual(age_s).cdf(within_s)


SURELY_ENDED_QUANTILE = 0.999
SURELY_ENDED_MARGIN = 2.0


def surely_ended_s(kinds: Iterable[ServiceTimes]) -> float:
    """How long a request may still run on a backend that computes on after its client's connection
    closed (a `drain` backend), as measured: twice the 99.9th percentile of the slowest kind's
    service times. The prior's tail counts until samples replace it, so a model not yet measured
    gets a long bound, not a short one."""
    return SURELY_ENDED_MARGIN * max((k.quantile(SURELY_ENDED_QUANTILE) for k in kinds), default=0.0)
