"""SimEngine: execution slots with an unbounded FIFO behind them, and the counters a model server keeps.

Like Triton or vLLM, the engine never refuses work: whatever arrives waits for a slot. A slot is
freed the moment the computation ends, before the answer is written, which is also when a real
server frees its instance.

A request's service time is its base part plus its per-item (or per-token) parts. The base part is
`base_ms` for every request (fixed), or drawn for each request with mean `base_ms` from a random
source the caller may seed: exponential, or long-tail (a chat pool's mix: 90% of requests take a
quarter of the mean, 10% take 7.75 means; cv 2.25, so that a request that has run a while is most
likely a long one). The per-item and per-token parts stay fixed whatever the distribution.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

ServiceDistribution = Literal["fixed", "exponential", "long-tail"]
SERVICE_DISTRIBUTIONS: tuple[ServiceDistribution, ...] = ("fixed", "exponential", "long-tail")
LONG_SHARE, SHORT_OF_MEAN, LONG_OF_MEAN = 0.1, 0.25, 7.75  # 0.9 x 0.25 + 0.1 x 7.75 = 1


@dataclass(slots=True)
class ModelCounters:
    """Per-model counters, named after the Triton metrics they feed."""

    request_success: int = 0
    inference_count: int = 0
    exec_count: int = 0
    queue_duration_us: int = 0
    request_duration_us: int = 0
    pending: int = 0
    running: int = 0


@dataclass(frozen=True, slots=True)
class ServiceModel:
    base_ms: float = 40.0
    per_item_ms: float = 0.0
    token_ms: float = 0.0
    distribution: ServiceDistribution = "fixed"
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)
    """Draws the exponential base parts; seed it for a reproducible sequence."""

    def base_s(self) -> float:
        """The base part of one request's service time: a fresh draw for each call unless fixed."""
        if self.distribution == "exponential" and self.base_ms > 0:
            return self.rng.expovariate(1000 / self.base_ms)
        if self.distribution == "long-tail":
            share = LONG_OF_MEAN if self.rng.random() < LONG_SHARE else SHORT_OF_MEAN
            return share * self.base_ms / 1000
        return self.base_ms / 1000

    def batch_s(self, items: int) -> float:
        if self.distribution == "fixed":
            return (self.base_ms + self.per_item_ms * items) / 1000
        return self.base_s() + self.per_item_ms * items / 1000


@dataclass(slots=True)
class EngineStats:
    inflight: int = 0
    peak_inflight: int = 0
    running: int = 0
    completed: int = 0
    stopped: int = 0
    """Requests stopped because their client went away (in stop-on-disconnect mode)."""
    busy_slot_s: float = 0.0
    models: dict[str, ModelCounters] = field(default_factory=dict)
    idle_gaps_s: deque[float] = field(default_factory=lambda: deque(maxlen=20_000))
    """How long each slot sat idle before its next request: under overload, the hand-over cost
    of whatever sits in front of the engine."""


class Job:
    """One request's hold on the engine: it waits for a slot, computes, and ends exactly once."""

    __slots__ = ("_wake", "arrived_at", "ended", "model", "started_at")

    def __init__(self, model: str, arrived_at: float) -> None:
        self.model = model
        self.arrived_at = arrived_at
        self.started_at: float | None = None
        self.ended = False
        self._wake: asyncio.Future[None] | None = None
        """What `run` awaits: the slot, then the end of the computation; `stop` resolves it early."""


class SimEngine:
    def __init__(
        self, slots: int, service: ServiceModel, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.slots = slots
        self.service = service
        self.stats = EngineStats()
        self._waiting: deque[Job] = deque()
        self._idle_since: deque[float] = deque([clock()] * slots)
        self._clock = clock

    def counters(self, model: str) -> ModelCounters:
        counters = self.stats.models.get(model)
        if counters is None:
            counters = self.stats.models[model] = ModelCounters()
        return counters

    def reset_peak(self) -> None:
        self.stats.peak_inflight = self.stats.inflight
        self.stats.idle_gaps_s.clear()

    def submit(self, model: str) -> Job:
        """A request arrives: it takes a free slot at once, or waits for one (FIFO)."""
        stats = self.stats
        job = Job(model, self._clock())
        stats.inflight += 1
        stats.peak_inflight = max(stats.peak_inflight, stats.inflight)
        if stats.running < self.slots and not self._waiting:
            stats.running += 1
            # The slot idle the longest takes it (FIFO); only its gap since then is recorded.
            stats.idle_gaps_s.append(job.arrived_at - self._idle_since.popleft())
            self._start(job)
        else:
            self.counters(model).pending += 1
            self._waiting.append(job)
        return job

    async def run(self, job: Job, seconds: float) -> bool:
        """Wait for the job's slot, then compute for `seconds`; False when it was stopped first."""
        loop = asyncio.get_running_loop()
        if job.started_at is None and not job.ended:
            job._wake = loop.create_future()
            await job._wake
        if seconds > 0 and not job.ended:
            job._wake = loop.create_future()
            timer = loop.call_later(seconds, _resolve, job._wake)
            try:
                await job._wake
            finally:
                timer.cancel()
        return not job.ended

    def end(self, job: Job, items: int, ok: bool = True) -> None:
        """The job is over (idempotent): its slot goes to the next waiting job."""
        if job.ended:
            return
        job.ended = True
        if job._wake is not None:
            _resolve(job._wake)
        stats = self.stats
        stats.inflight -= 1
        counters = self.counters(job.model)
        if job.started_at is None:  # it left while waiting inside
            self._waiting.remove(job)
            counters.pending -= 1
            return
        now = self._clock()
        stats.completed += 1
        stats.busy_slot_s += now - job.started_at
        counters.running -= 1
        counters.exec_count += 1
        counters.request_duration_us += int((now - job.arrived_at) * 1e6)
        if ok:
            counters.request_success += 1
            counters.inference_count += items
        self._hand_over()

    def stop(self, job: Job) -> None:
        """Its client went away and the engine stops computing it, as vLLM does: at once."""
        if not job.ended:
            self.stats.stopped += 1
            self.end(job, 0, ok=False)

    async def compute(self, model: str, seconds: float, items: int) -> None:
        """Hold a slot for `seconds` of simulated computation."""
        job = self.submit(model)
        try:
            await self.run(job, seconds)
        finally:
            self.end(job, items)

    def _start(self, job: Job) -> None:
        job.started_at = self._clock()
        counters = self.counters(job.model)
        counters.running += 1
        counters.queue_duration_us += int((job.started_at - job.arrived_at) * 1e6)
        if job._wake is not None:
            _resolve(job._wake)

    def _hand_over(self) -> None:
        if self._waiting:
            job = self._waiting.popleft()
            self.counters(job.model).pending -= 1
            self.stats.idle_gaps_s.append(0.0)
            self._start(job)
            return
        self.stats.running -= 1
        self._idle_since.append(self._clock())


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
