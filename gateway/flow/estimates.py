"""The measured speeds of one model's pool, kept as state and fed to the pure estimators."""

from __future__ import annotations

from dataclasses import replace

from gateway.settings import Estimation
from policies.estimators import ObservedRate, blend_rate, coefficient_of_variation, ewma, rate_jump
from policies.retry_after import RetryAfterConfig, band_retry_load, next_spread
from policies.wait import Throughput, band_drain_rate_per_s, pool_drain_rate_per_s

# Arrivals are counted per interval of this length and blended into the rates when it ends.
TICK_S = 0.05
# Deviations a counting interval must exceed the current level by to be taken as a step up.
JUMP_Z = 6.0


def rate_taus(config: Estimation) -> tuple[float, float]:
    """Time constants of the slow and the fast arrival-rate estimates."""
    return config.rate_window_s, config.rate_window_s / 4


class PoolEstimates:
    """Service time, drain rate and per-band arrival rates of one model.

    The drain rate is measured from the gaps between slot hand-overs while requests were waiting
    the whole time, bounded by slots / service time (policies.wait.pool_drain_rate_per_s); without a
    recent measurement it is that bound.

    Admitted rates feed the drain left to less urgent bands, so they are read as the larger of a
    slow and a fast estimate: quick to believe that urgent traffic rose (a low request admitted
    on a stale, low estimate would expire in the queue), slow to believe that it fell. A counting
    interval with far more admissions than the estimates explain (policies.estimators.rate_jump)
    sets both to its own rate at once: the onset of an overload is believed within ~50 ms.

    Reading the estimates is on every request's path, so the Throughput snapshot is rebuilt only
    when something in it changed.
    """

    def __init__(self, bands: int, expected_service_s: float, config: Estimation) -> None:
        self._config = config
        self._slow_tau_s, self._fast_tau_s = rate_taus(config)
        self.service_time_s = expected_service_s
        self.service_spread_s = 0.0
        """Standard deviation of the service time (EWMA of squared deviations)."""
        self._service_variance = 0.0
        self._service_samples = 0
        self._drain = ObservedRate(config.drain_window_s)
        self._drain_measured_at = float("-inf")
        self._offered_count = [0] * bands
        self._admitted_count = [0] * bands
        self._offered = [0.0] * bands
        self._admitted_slow = [0.0] * bands
        self._admitted_fast = [0.0] * bands
        self._tick_started_at: float | None = None
        self._snapshot: Throughput | None = None
        self._snapshot_key: tuple[int, bool] = (0, False)

    def record_offer(self, band: int, admitted: bool, now: float) -> None:
        self._roll(now)
        self._offered_count[band] += 1
        if admitted:
            self._admitted_count[band] += 1

    def record_service(self, service_s: float) -> None:
        weight = self._config.service_time_weight
        deviation = service_s - self.service_time_s
        self._service_variance = ewma(self._service_variance, deviation * deviation, weight)
        self.service_spread_s = self._service_variance**0.5
        self.service_time_s = ewma(self.service_time_s, service_s, weight)
        self._service_samples += 1
        self._snapshot = None

    @property
    def service_cv(self) -> float:
        weight = self._config.service_time_weight
        return coefficient_of_variation(
            self.service_time_s, self.service_spread_s, self._service_samples, weight
        )

    def record_handover_gap(self, gap_s: float, now: float) -> None:
        """One slot hand-over `gap_s` after the previous one, with requests waiting throughout."""
        self._drain = self._drain.observe(1.0, gap_s)
        self._drain_measured_at = now
        self._snapshot = None

    def throughput(self, slots: int, now: float) -> Throughput:
        self._roll(now)
        drain_fresh = now - self._drain_measured_at <= self._config.drain_stale_after_s
        key = (slots, drain_fresh)
        if self._snapshot is None or key != self._snapshot_key:
            seen = (self._drain.events, self._drain.observed_s) if drain_fresh else (0.0, 0.0)
            drain = pool_drain_rate_per_s(*seen, slots, self.service_time_s)
            self._snapshot = Throughput(
                service_time_s=self.service_time_s,
                drain_rate_per_s=drain,
                admitted_rate_by_band=tuple(map(max, self._admitted_slow, self._admitted_fast)),
                offered_rate_by_band=tuple(self._offered),
                service_spread_s=self.service_spread_s,
                service_cv=self.service_cv,
            )
            self._snapshot_key = key
        return self._snapshot

    def _roll(self, now: float) -> None:
        """Blend the counts of a finished counting interval into the rates."""
        if self._tick_started_at is None:
            self._tick_started_at = now
            return
        elapsed_s = now - self._tick_started_at
        if elapsed_s < TICK_S:
            return
        for band, (offered, admitted) in enumerate(
            zip(self._offered_count, self._admitted_count, strict=True)
        ):
            self._offered[band] = blend_rate(self._offered[band], offered, elapsed_s, self._slow_tau_s)
            level = max(self._admitted_slow[band], self._admitted_fast[band])
            jump = rate_jump(level, admitted, elapsed_s, JUMP_Z)
            self._admitted_slow[band] = blend_rate(
                self._admitted_slow[band], admitted, elapsed_s, self._slow_tau_s
            )
            self._admitted_fast[band] = blend_rate(
                self._admitted_fast[band], admitted, elapsed_s, self._fast_tau_s
            )
            if jump is not None:
                self._admitted_slow[band] = max(self._admitted_slow[band], jump)
                self._admitted_fast[band] = max(self._admitted_fast[band], jump)
            self._offered_count[band] = self._admitted_count[band] = 0
        self._tick_started_at = now
        self._snapshot = None


class RetrySpreads:
    """Each band's Retry-After spread factor, followed over time (policies.retry_after).

    Updated when advice is given: the load seen then is taken to have held since the last update,
    so a pause in refusals (the overload ended) shrinks the factor by the whole pause at once.
    """

    def __init__(self, bands: int, config: RetryAfterConfig) -> None:
        self._config = config
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
                self._factors[band] = next_spread(factor, load, drain, elapsed_s, self._config)
        self._updated_at = now
        return replace(flow, retry_spread_by_band=tuple(self._factors))
