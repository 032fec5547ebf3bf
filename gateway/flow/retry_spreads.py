"""Each band's return schedule, kept as state and fed to the pure policy (policies.return_schedule)."""

from __future__ import annotations

from policies.retry_after import RetryAfterConfig
from policies.return_schedule import ReturnSchedule, advise_return, empty_schedule
from policies.wait import Throughput


class ReturnSchedules:
    """One model's return schedules, one per band (policies.return_schedule).

    `rates_seen_s` and `settled_seen_s` are how far back the arrival-rate estimates and the
    settled-times rate remember: the returns the schedule sends are averaged alike, so that they
    can be told apart from fresh arrivals.
    """

    def __init__(
        self, bands: int, config: RetryAfterConfig, rates_seen_s: float = 2.0, settled_seen_s: float = 30.0
    ) -> None:
        self._config = config
        self._rates_seen_s = rates_seen_s
        self._settled_seen_s = settled_seen_s
        self._schedules: list[ReturnSchedule | None] = [None] * bands

    def advise(
        self,
        band: int,
        cost: float,
        excess_wait_s: float,
        throughput: Throughput,
        now: float,
        jitter_u: float,
    ) -> float:
        """Seconds until this refused request should come back; books its return.

        `excess_wait_s`: how much longer than allowed it would have waited (admission's);
        `jitter_u`: a uniform sample in [0, 1), drawn by the caller.
        """
        schedule = self._schedules[band] or empty_schedule(now, self._config, self._settled_seen_s)
        booking = advise_return(
            schedule, cost, excess_wait_s, throughput, band, now, jitter_u, self._config, self._rates_seen_s
        )
        self._schedules[band] = booking.schedule
        return booking.advice_s

    def schedule(self, band: int) -> ReturnSchedule | None:
        """The band's schedule as last booked (None before its first refusal)."""
        return self._schedules[band]
