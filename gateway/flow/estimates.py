"""The measured speeds of one model's pool, kept as state and fed to the pure estimators."""

from __future__ import annotations

from gateway.settings import Estimation
from policies.estimators import DecayingRate, ewma
from policies.wait import Throughput, drain_rate_from_slots


class PoolEstimates:
    """Service time, drain rate and per-band arrival rates of one model.

    The drain rate is measured from the gaps between slot hand-overs while requests were waiting
    the whole time; without a recent measurement it falls back to slots / service time.
    """

    def __init__(self, bands: int, expected_service_s: float, config: Estimation) -> None:
        self._config = config
        self.service_time_s = expected_service_s
        self._drain_gap_s: float | None = None
        self._drain_measured_at = float("-inf")
        self._admitted = [DecayingRate(config.rate_window_s)] * bands
        self._offered = [DecayingRate(config.rate_window_s)] * bands

    def record_offer(self, band: int, admitted: bool, now: float) -> None:
        self._offered[band] = self._offered[band].record(now)
        if admitted:
            self._admitted[band] = self._admitted[band].record(now)

    def record_service(self, service_s: float) -> None:
        self.service_time_s = ewma(self.service_time_s, service_s, self._config.service_time_weight)

    def record_handover_gap(self, gap_s: float, now: float) -> None:
        self._drain_gap_s = ewma(self._drain_gap_s, gap_s, self._config.drain_weight)
        self._drain_measured_at = now

    def drain_rate_per_s(self, slots: int, now: float) -> float:
        fresh = now - self._drain_measured_at <= self._config.drain_stale_after_s
        if fresh and self._drain_gap_s is not None and self._drain_gap_s > 0:
            return 1.0 / self._drain_gap_s
        return drain_rate_from_slots(slots, self.service_time_s)

    def throughput(self, slots: int, now: float) -> Throughput:
        return Throughput(
            service_time_s=self.service_time_s,
            drain_rate_per_s=self.drain_rate_per_s(slots, now),
            admitted_rate_by_band=tuple(r.at(now) for r in self._admitted),
            offered_rate_by_band=tuple(r.at(now) for r in self._offered),
        )
