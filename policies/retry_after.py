"""When should a refused client come back? Retry-After from the queue's drain rate.

The advice is the time the queue needs to drain far enough for a request like this one to fit
(`excess_wait_s`), never less than one slot turnover of its band, stretched by a spread factor.

The spread is what makes the advice honest under sustained overload. There the queue refills as
fast as it drains, so advice that only counts the drain sends every refused client back into a
full queue, to be refused again. Arrivals for a band include the clients coming back: while the
band refuses, the spread grows by its arrivals per admission (integral control: that ratio raised
to elapsed / tau), and once it stops refusing it shrinks by its arrivals per hand-over, back
towards 1 when returns thin out. With N clients sharing a band that admits mu_b per second it
settles near N / mu_b, the time after which a returning client finds room. Jitter spreads the
returns; the clamp keeps the advice useful.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryAfterConfig:
    min_s: float = 0.01
    max_s: float = 60.0
    jitter: float = 0.1
    """Relative spread: the advice is scaled by a factor in [1 - jitter, 1 + jitter]."""
    adapt_tau_s: float = 5.0
    """How fast the spread follows the overload: by a factor e per tau_s at an overload of e."""


def retry_after_s(
    excess_wait_s: float,
    band_drain_rate_per_s: float,
    spread: float,
    jitter_u: float,
    config: RetryAfterConfig,
) -> float:
    """Seconds a refused client should wait before trying again.

    `excess_wait_s`: how much longer than allowed the request would have waited.
    `band_drain_rate_per_s`: the rate at which slots reach its band.
    `spread`: the band's current spread factor (`next_spread`), at least 1.
    `jitter_u`: a uniform sample in [0, 1), drawn by the caller.
    """
    turnover_s = 1.0 / band_drain_rate_per_s if band_drain_rate_per_s > 0 else config.max_s
    base_s = max(excess_wait_s, turnover_s) * max(1.0, spread)
    jittered = base_s * (1.0 + config.jitter * (2.0 * jitter_u - 1.0))
    return min(config.max_s, max(config.min_s, jittered))


def band_retry_load(offered_per_s: float, admitted_per_s: float, band_drain_rate_per_s: float) -> float:
    """The load the spread follows: arrivals per admission while the band refuses (more than 5% of
    its arrivals), else arrivals per hand-over it gets (below 1 once returns thin out)."""
    if offered_per_s > 1.05 * admitted_per_s:
        return offered_per_s / max(admitted_per_s, 1e-3 * offered_per_s)
    return offered_per_s / band_drain_rate_per_s if band_drain_rate_per_s > 0 else 1.0


def next_spread(
    previous: float,
    band_load: float,
    band_drain_rate_per_s: float,
    elapsed_s: float,
    config: RetryAfterConfig,
) -> float:
    """The band's spread factor after `elapsed_s` more seconds at `band_load`.

    `band_load`: from `band_retry_load` (arrivals, new and returning, per admission). The factor is
    multiplied by band_load ** (elapsed_s / adapt_tau_s), and kept between 1 and the factor that
    would push one turnover past `max_s`, so that it cannot wind up beyond any useful advice.
    """
    ceiling = max(1.0, config.max_s * band_drain_rate_per_s)
    load = max(band_load, 1e-3)  # an idle band shrinks the spread quickly, never by log(0)
    factor = previous * math.exp(math.log(load) * max(0.0, elapsed_s) / config.adapt_tau_s)
    return min(ceiling, max(1.0, factor))


def spread_after(
    previous: float,
    band_load: float,
    band_drain_rate_per_s: float,
    elapsed_s: float,
    seen_s: float,
    config: RetryAfterConfig,
) -> float:
    """`next_spread` over the `elapsed_s` since the band last refused, where `seen_s` is how far
    back the load estimates remember. A longer gap was a lull: nobody was refused in it, the
    refused clients' returns have thinned out, and the spread relaxes over all of it as for an idle
    band; the load seen now belongs to a new burst that has only begun. Taking that load to have
    held over the whole gap grew the spread by a burst's load for every idle second before the
    burst, burst after burst, up to the ceiling."""
    if elapsed_s > seen_s:
        return next_spread(previous, 0.0, band_drain_rate_per_s, elapsed_s, config)
    return next_spread(previous, band_load, band_drain_rate_per_s, elapsed_s, config)


def header_values(advice_s: float) -> tuple[str, str]:
    """`Retry-After` in whole seconds (at least 1, rounded up) and `retry-after-ms` (precise)."""
    whole_s = max(1, -int(-advice_s // 1))
    return str(whole_s), str(max(1, round(advice_s * 1000)))
