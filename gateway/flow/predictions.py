"""Admission's predictions from the state of the pool (policies.admission), at a bounded cost.

Reading the pool (policies.handovers) costs a few hundred microseconds to a few milliseconds, more
than the rest of a request's admission, so it is not done for every request:
- with a slot free and nothing queued ahead the request is granted at once, and the limit it
  carries (which binds only where the store's state has moved on since, another replica's request
  queued meanwhile) is the drain rate's normal approximation;
- otherwise a limit is reused for the same band, class wait, budget and confidence (the wait and
  budget each rounded down to a 1/64 step of its binary order, which can only tighten it) while the
  pool holds as many busy and free slots as when it was read, for a sixteenth of the allowed wait
  (10 ms at least, `reuse_s` at most): the requests in flight have aged by little against the time
  that matters;
- a limit that has aged past that is read again a step per turn of the event loop
  (policies.admission.work_limit_steps: a busy slot per turn where service is clock-like, a few
  turns otherwise), and serves until the new reading lands: under overload the readings come tens
  of times a second, and one whole would hold every request behind it for up to a millisecond or
  two. A limit twice as old, or read with other slot counts, is read at once, and so is a pool at
  light load;
- the calibrated confidence (one per flow) moves a little with every queued request of the flow
  that leaves the queue (under overload hundreds of times a second), so it is read on a grid: its
  miss probability rounded down to an eighth of a binary order (about 9%), which can only tighten
  it; a limit read at another point of the grid is another limit, read at once;
- the predicted wait, exported beside the actual one, is computed for at most one admitted request
  per band every `sample_s`, a reading of the pool per turn of the event loop;
- a refusal's wait from the state of the pool (where service times vary more than exponential
  ones, policies.admission.residual_beyond_mean) is read the same way, a reading per turn, and
  serves the band's refusals while the pool holds as many busy and free slots, for `sample_s`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from statistics import NormalDist

from gateway.flow.stepwise import StepRunner, run_stepwise
from policies.admission import (
    AdmissionConfig,
    AdmissionRequest,
    PoolWait,
    confident_wait_steps,
    max_work,
    offered_limit,
    residual_beyond_mean,
    work_limit,
    work_limit_steps,
)
from policies.rounding import rounded_down
from policies.wait import QueueStats, Throughput, work_to_drain

REUSE_S = 0.05
REUSE_SHARE = 1 / 16
SAMPLE_S = 1.0


def rounded_up_confidence(confidence: float) -> float:
    """`confidence` with its miss probability 1 - confidence rounded down to an eighth of its
    binary order: never below `confidence`, and the same for small moves of it."""
    miss = 1.0 - confidence
    if not 0.0 < miss < 1.0:
        return confidence
    return 1.0 - math.pow(2.0, math.floor(8 * math.log2(miss)) / 8)


@dataclass(frozen=True, slots=True)
class _HeldWait:
    read_at: float
    slots: tuple[int, int]
    wait: PoolWait


@dataclass(slots=True)
class _Limit:
    read_at: float
    slots: tuple[int, int]
    work: float
    refreshing: bool = False
    """A reading to replace it is under way."""


class Predictions:
    """One model's admission limits and predicted waits, reused or sampled as above."""

    def __init__(
        self,
        bands: int,
        config: AdmissionConfig,
        reuse_s: float = REUSE_S,
        sample_s: float = SAMPLE_S,
        run_steps: StepRunner[float] = run_stepwise,
    ) -> None:
        self._config = config
        self._reuse_s = reuse_s
        self._sample_s = sample_s
        self._run_steps = run_steps
        self._limits: dict[tuple[int, float, float | None, float], _Limit] = {}
        self._sampled_at = [-math.inf] * bands
        self._pool_waits: list[_HeldWait | None] = [None] * bands
        self._wait_asked_at: list[float | None] = [None] * bands
        """When a reading of the band's pool wait was started and has not landed (one that failed
        never does: another may start a `sample_s` later)."""

    def work_limit(
        self,
        request: AdmissionRequest,
        stats: QueueStats,
        throughput: Throughput,
        now: float,
        confidence: float,
    ) -> float:
        """policies.admission.work_limit, reused while it still holds (see the module)."""
        confidence = rounded_up_confidence(confidence)
        free = stats.free_for(request.band)
        if free > 0 and work_to_drain(stats, request.band, throughput.handover_cost) == 0:
            return max_work(request, throughput, self._config, NormalDist().inv_cdf(confidence))
        budget_s = None if request.budget_s is None else rounded_down(request.budget_s)
        max_wait_s = rounded_down(request.max_queue_wait_s)
        # Per confidence: each flow is calibrated on its own (gateway/flow/calibration.py).
        key = (request.band, max_wait_s, budget_s, confidence)
        slots = (len(stats.started_at), free)
        limit = self._limits.get(key)
        reuse_s = min(self._reuse_s, max(0.01, REUSE_SHARE * max_wait_s))
        if limit is not None and limit.slots == slots:
            age_s = now - limit.read_at
            if age_s <= reuse_s:
                return limit.work
            if age_s <= 2 * reuse_s:
                if not limit.refreshing:
                    limit.refreshing = True
                    rounded = replace(request, max_queue_wait_s=max_wait_s, budget_s=budget_s)
                    self._read_stepwise(key, limit, rounded, stats, throughput, now, confidence)
                # Not `limit`: a runner that lands at once has replaced it already.
                return self._limits.get(key, limit).work
        if len(self._limits) > 256:  # budgets vary per request: keep only what may still serve
            self._limits = {k: v for k, v in self._limits.items() if now - v.read_at <= 2 * self._reuse_s}
        rounded = replace(request, max_queue_wait_s=max_wait_s, budget_s=budget_s)
        work = work_limit(rounded, stats, throughput, now, confidence, self._config)
        self._limits[key] = _Limit(now, slots, work)
        return work

    def offered_limit(
        self,
        request: AdmissionRequest,
        stats: QueueStats,
        throughput: Throughput,
        external: float,
        now: float,
        confidence: float,
    ) -> float:
        """The work limit a store checks the request's offer against (with its
        policies.admission.offer_reach): `work_limit`, less the room its cost's rank keeps for
        others and the work the backends hold for others (`external`; policies.admission.offered_limit)."""
        limit = self.work_limit(request, stats, throughput, now, confidence)
        return offered_limit(limit, request, throughput, external)

    def _read_stepwise(
        self,
        key: tuple[int, float, float | None, float],
        held: _Limit,
        request: AdmissionRequest,
        stats: QueueStats,
        throughput: Throughput,
        now: float,
        confidence: float,
    ) -> None:
        """Read `request`'s limit again a step at a time; it replaces `held` when it lands, unless
        a reading made at once meanwhile (other slot counts, a stale or a looser limit) has."""
        steps = work_limit_steps(request, stats, throughput, now, confidence, self._config)

        def landed(work: float) -> None:
            if self._limits.get(key, held) is held:
                self._limits[key] = _Limit(now, held.slots, work)

        self._run_steps(steps, landed)

    def sample_wait(
        self,
        band: int,
        stats: QueueStats,
        throughput: Throughput,
        now: float,
        confidence: float,
        on_wait: Callable[[float], None],
    ) -> None:
        """If a request of `band` admitted now is this band's sample, compute its predicted wait, a
        reading of the pool per turn of the event loop (the search takes up to about twenty, which
        whole would stall every other request for milliseconds), and hand it to `on_wait`."""
        if now - self._sampled_at[band] < self._sample_s:
            return
        self._sampled_at[band] = now
        self._run_steps(confident_wait_steps(stats, throughput, band, now, confidence), on_wait)

    def pool_wait(
        self, band: int, stats: QueueStats, throughput: Throughput, now: float, confidence: float
    ) -> PoolWait | None:
        """The pool's confident wait for a refusal of `band`, where it tells more than the drain rate
        (see the module); None until one is read for the slots the pool holds now."""
        if not residual_beyond_mean(throughput):
            return None
        held = self._pool_waits[band]
        slots = (len(stats.started_at), stats.free_for(band))
        fresh = held is not None and held.slots == slots and now - held.read_at <= self._sample_s
        asked_at = self._wait_asked_at[band]
        if not fresh and (asked_at is None or now - asked_at > self._sample_s):
            self._wait_asked_at[band] = now

            work = work_to_drain(stats, band, throughput.handover_cost)

            def landed(wait_s: float) -> None:
                self._wait_asked_at[band] = None
                self._pool_waits[band] = _HeldWait(now, slots, PoolWait(work, wait_s))

            steps = confident_wait_steps(stats, throughput, band, now, rounded_up_confidence(confidence))
            self._run_steps(steps, landed)
        return held.wait if fresh and held is not None else None
