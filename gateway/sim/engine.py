"""SimEngine: execution slots with an unbounded FIFO behind them, and the counters a model server keeps.

Like Triton or vLLM, the engine never refuses work: whatever arrives waits for a slot. A slot is
freed the moment the computation ends, before the answer is written, which is also when a real
server frees its instance.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


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

    def batch_s(self, items: int) -> float:
        return (self.base_ms + self.per_item_ms * items) / 1000


@dataclass(slots=True)
class EngineStats:
    inflight: int = 0
    peak_inflight: int = 0
    running: int = 0
    completed: int = 0
    busy_slot_s: float = 0.0
    models: dict[str, ModelCounters] = field(default_factory=dict)
    idle_gaps_s: deque[float] = field(default_factory=lambda: deque(maxlen=20_000))
    """How long each slot sat idle before its next request: under overload, the hand-over cost
    of whatever sits in front of the engine."""


class SimEngine:
    def __init__(
        self, slots: int, service: ServiceModel, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.slots = slots
        self.service = service
        self.stats = EngineStats()
        self._waiting: deque[asyncio.Future[None]] = deque()
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

    async def acquire(self, model: str) -> float:
        """Wait for a slot (FIFO); returns the time the request arrived."""
        stats = self.stats
        arrived_at = self._clock()
        stats.inflight += 1
        stats.peak_inflight = max(stats.peak_inflight, stats.inflight)
        counters = self.counters(model)
        if stats.running < self.slots and not self._waiting:
            stats.running += 1
            # The slot idle the longest takes it (FIFO); only its gap since then is recorded.
            stats.idle_gaps_s.append(arrived_at - self._idle_since.popleft())
        else:
            counters.pending += 1
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done():
                    self._hand_over()  # the slot came with the cancellation: pass it on
                else:
                    self._waiting.remove(waiter)
                stats.inflight -= 1
                raise
            finally:
                counters.pending -= 1
        counters.running += 1
        counters.queue_duration_us += int((self._clock() - arrived_at) * 1e6)
        return arrived_at

    def release(self, model: str, arrived_at: float, started_at: float, items: int, ok: bool = True) -> None:
        """Free the slot of a request that started computing at `started_at`."""
        now = self._clock()
        stats = self.stats
        stats.inflight -= 1
        stats.completed += 1
        stats.busy_slot_s += now - started_at
        counters = self.counters(model)
        counters.running -= 1
        counters.exec_count += 1
        counters.request_duration_us += int((now - arrived_at) * 1e6)
        if ok:
            counters.request_success += 1
            counters.inference_count += items
        self._hand_over()

    def _hand_over(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self.stats.idle_gaps_s.append(0.0)
                return
        self.stats.running -= 1
        self._idle_since.append(self._clock())

    async def compute(self, model: str, seconds: float, items: int) -> None:
        """Hold a slot for `seconds` of simulated computation."""
        arrived_at = await self.acquire(model)
        started_at = self._clock()
        try:
            if seconds > 0:
                await asyncio.sleep(seconds)
        finally:
            self.release(model, arrived_at, started_at, items)
