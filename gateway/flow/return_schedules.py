"""Each band's return schedule, kept as state and fed to the pure policy (policies.return_schedule)."""

from __future__ import annotations

from gateway.queues.base import ALONE, SharedReturns
from policies.retry_after import RetryAfterConfig
from policies.return_schedule import (
    ReturnSchedule,
    advance,
    advise_return,
    empty_schedule,
    returning_elsewhere_per_s,
)
from policies.wait import Throughput


class ReturnSchedules:
    """One model's return schedules, one per band (policies.return_schedule).

    `rates_seen_s` and `settled_seen_s` are how far back the arrival-rate estimates and the
    settled-times rate remember: the returns the schedule sends are averaged alike, so that they
    can be told apart from fresh arrivals. Shared (`shared_as`), each booking counts the returns
    the queue's other replicas have promised, and publishes its own.
    """

    def __init__(
        self, bands: int, config: RetryAfterConfig, rates_seen_s: float = 2.0, settled_seen_s: float = 30.0
    ) -> None:
        self._config = config
        self._rates_seen_s = rates_seen_s
        self._settled_seen_s = settled_seen_s
        self._schedules: list[ReturnSchedule | None] = [None] * bands
        self._model = ""
        self._shared: SharedReturns = ALONE

    def shared_as(self, model: str, shared: SharedReturns) -> ReturnSchedules:
        """These schedules, as `model`'s among the replicas `shared` connects."""
        self._model, self._shared = model, shared
        return self

    def advise(
        self,
        band: int,
        cost: float,
        excess_wait_s: float,
        throughput: Throughput,
        now: float,
        jitter_u: float,
        *,
        drains: bool = True,
    ) -> float:
        """Seconds until this refused request should come back; books its return.

        `excess_wait_s`: how much longer than allowed it would have waited (admission's);
        `jitter_u`: a uniform sample in [0, 1), drawn by the caller; `drains`: whether that wait
        is the band's queue draining (policies.return_schedule.advise_return), not one of another
        kind (a cluster's backlog, bodies over their byte bound).
        """
        schedule = self._schedules[band] or empty_schedule(now, self._config, self._settled_seen_s)
        others = self._shared.elsewhere(self._model, band)
        config, rates_seen_s = self._config, self._rates_seen_s
        urgent = [self._settled_returning_per_s(b, now) for b in range(band)]
        booking = advise_return(
            schedule,
            cost,
            excess_wait_s,
            throughput,
            band,
            now,
            jitter_u,
            config,
            rates_seen_s,
            others,
            urgent,
            excess_drains_with_band=drains,
        )
        self._schedules[band] = booking.schedule
        self._shared.promise(self._model, band, booking.schedule)
        return booking.advice_s

    def _settled_returning_per_s(self, band: int, now: float) -> float:
        """The rate `band`'s returns fell due in settled times, every replica's, as of `now`: its
        settled arrivals hold them, and they will not come back fresh."""
        schedule = self._schedules[band]
        others = self._shared.elsewhere(self._model, band)
        tau_s = self._rates_seen_s
        mine = 0.0 if schedule is None else advance(schedule, now, tau_s).settled_returning.per_s or 0.0
        return mine + returning_elsewhere_per_s(others, now, tau_s, self._settled_seen_s)[1]

    def schedule(self, band: int) -> ReturnSchedule | None:
        """The band's schedule as last booked (None before its first refusal)."""
        return self._schedules[band]
