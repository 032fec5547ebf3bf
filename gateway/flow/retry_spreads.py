"""Each band's Retry-After spread factor, kept as state and fed to the pure policy."""

from __future__ import annotations

from dataclasses import replace

from policies.retry_after import RetryAfterConfig, band_retry_load, spread_after
from policies.wait import Throughput, band_drain_rate_per_s


class RetrySpreads:
    """Each band's Retry-After spread factor, followed over time (policies.retry_after).

    Updated when advice is given: the load seen then is taken to have held since the last update,
    unless that is longer ago than the rate estimates remember (`seen_s`): then the time between
    was a lull, and a new burst begins (policies.retry_after.spread_after).
    """

    def __init__(self, bands: int, config: RetryAfterConfig, seen_s: float) -> None:
        self._config = config
        self._seen_s = seen_s
        self._factors = [1.0] * bands
        self._updated_at: float | None = None

    def follow(self, flow: Throughput, now: float) -> Throughput:
        """`flow` with the bands' spread factors brought up to `now`."""
        if self._updated_at is not None:
            elapsed_s = now - self._updated_at
            for band, factor in enumerate(self._factors):
                drain = band_drain_rate_per_s(flow, band)
                offered, admitted = flow.offered_rate_by_band[band], flow.admitted_rate_by_band[band]
                load = band_retry_load(offered, admitted, drain)
                self._factors[band] = spread_after(factor, load, drain, elapsed_s, self._seen_s, self._config)
        self._updated_at = now
        return replace(flow, retry_spread_by_band=tuple(self._factors))
