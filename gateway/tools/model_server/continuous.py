"""A continuous-batching engine, in the manner of vLLM's V1 scheduler, for the simulator.

There are no slots. Up to `max_num_seqs` sequences run together; every step each running sequence
makes one token, and a step takes longer the more run and the more context they hold:

    step_s = step_ms x (1 + step_growth x (running - 1) / (max_num_seqs - 1))
             + context_ms_per_1k x (tokens held in the KV cache) / 1000
             + prefill_ms_per_1k x (prompt tokens prefilled in this step) / 1000

A sequence holds prompt + generated tokens in a KV cache of `kv_tokens`. A waiting sequence starts
only while running < max_num_seqs and its tokens fit; its first step prefills its prompt and makes
its first token. When the running sequences' next tokens no longer fit, the engine preempts (by
recompute, as vLLM does): the sequence that started last (under `priority`, the least urgent, then
the one that started last) gives up its KV cache and waits again at the head of the queue; it
prefills prompt and generated tokens again when it restarts. The waiting queue is FIFO, or under
`priority` ordered by the request's `priority` field, lower first, as vLLM's
`--scheduling-policy priority`. A sequence whose client leaves is aborted at once.

`ContinuousBatch` is the scheduler alone: the caller feeds it time (`begin_step`, `end_step`) and
it never sleeps, so its tests run in virtual time. `ContinuousEngine` drives it on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from gateway.tools.model_server.engine import EngineStats

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")
_UNOBSERVED = 100_000  # latencies kept for the next scrape; a sim nobody scrapes stays bounded


@dataclass(frozen=True, slots=True)
class ContinuousSpec:
    max_num_seqs: int = 64
    step_ms: float = 20.0
    """One decode step with one sequence running."""
    step_growth: float = 1.0
    """What the step gains, as a fraction of step_ms, with max_num_seqs running (1: it doubles)."""
    context_ms_per_1k: float = 0.0
    """Added to every step per 1000 tokens held in the KV cache."""
    prefill_ms_per_1k: float = 10.0
    """Added to a step per 1000 prompt tokens it prefills."""
    kv_tokens: int = 1 << 20
    scheduling: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.kv_tokens < 1 or min(self.step_ms, self.step_growth) < 0:
            raise ValueError(
                "max_num_seqs and kv_tokens must be positive, step_ms and step_growth not negative"
            )
        if min(self.context_ms_per_1k, self.prefill_ms_per_1k) < 0:
            raise ValueError("context_ms_per_1k and prefill_ms_per_1k must not be negative")

    def step_s(self, running: int, context_tokens: int, prefill_tokens: int) -> float:
        crowd = (running - 1) / (self.max_num_seqs - 1) if self.max_num_seqs > 1 else 0.0
        return (
            self.step_ms * (1 + self.step_growth * max(0.0, crowd))
            + self.context_ms_per_1k * context_tokens / 1000
            + self.prefill_ms_per_1k * prefill_tokens / 1000
        ) / 1000


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's generation: `output_tokens` tokens after a prompt of `prompt_tokens`."""

    model: str
    prompt_tokens: int
    output_tokens: int
    arrived_at: float
    priority: int = 0
    generated: int = 0
    started_at: float | None = None
    """When it last started running (None while it waits)."""
    first_token_at: float | None = None
    last_token_at: float | None = None
    preempted: bool = False
    ended: bool = False
    on_progress: Callable[[], None] | None = field(default=None, repr=False)
    """Called after each step that made it a token, and when it ends."""

    @property
    def held_tokens(self) -> int:
        """What it holds in the KV cache while it runs."""
        return self.prompt_tokens + self.generated

    @property
    def finished(self) -> bool:
        return self.generated >= self.output_tokens


@dataclass(slots=True)
class StepCounters:
    """What the scheduler counts, for vLLM's metrics (gateway.tools.model_server.vllm_metrics)."""

    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=_UNOBSERVED))
    """First-token latencies not yet observed (the metrics take and clear them)."""
    itl_s: deque[float] = field(default_factory=lambda: deque(maxlen=_UNOBSERVED))
    queue_s: deque[float] = field(default_factory=lambda: deque(maxlen=_UNOBSERVED))
    """How long each sequence waited inside before it first ran."""


class ContinuousBatch:
    """The scheduler: waiting and running sequences, and one step at a time."""

    def __init__(self, spec: ContinuousSpec, stats: EngineStats | None = None) -> None:
        self.spec = spec
        self.stats = stats if stats is not None else EngineStats()
        self.counters = StepCounters()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.kv_used = 0
        self._prefill = 0
        self._step_started: list[Sequence] = []

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def submit(self, sequence: Sequence) -> None:
        stats = self.stats
        stats.inflight += 1
        stats.peak_inflight = max(stats.peak_inflight, stats.inflight)
        self._enqueue(sequence, at_head=False)

    def abort(self, sequence: Sequence) -> None:
        """Its client left: it stops at once, wherever it is (idempotent)."""
        if sequence.ended:
            return
        self.stats.stopped += 1
        self._end(sequence, ok=False)

    def begin_step(self, now: float) -> float:
        """Schedule the next step (start what fits, preempt what no longer does); its duration."""
        self._admit(now)
        while self.running and self.kv_used + len(self.running) > self.spec.kv_tokens:
            self._preempt(self._victim())
        self.stats.running = len(self.running)
        return self.spec.step_s(len(self.running), self.kv_used, self._prefill)

    def end_step(self, now: float) -> None:
        """The step is over: every running sequence has one more token; the finished leave."""
        self._prefill = 0
        counters = self.counters
        for sequence in list(self.running):
            sequence.generated += 1
            self.kv_used += 1
            counters.generation_tokens += 1
            if sequence.first_token_at is None:
                sequence.first_token_at = now
                counters.ttft_s.append(now - sequence.arrived_at)
            elif sequence.last_token_at is not None:
                counters.itl_s.append(now - sequence.last_token_at)
            sequence.last_token_at = now
            if sequence.finished:
                counters.finished += 1
                self._end(sequence, ok=True)
            elif sequence.on_progress is not None:
                sequence.on_progress()
        self.stats.running = len(self.running)

    def _admit(self, now: float) -> None:
        spec = self.spec
        while self.waiting and len(self.running) < spec.max_num_seqs:
            head = self.waiting[0]
            if self.kv_used + head.held_tokens + 1 > spec.kv_tokens and self.running:
                return  # it waits for room; alone it starts anyway (vLLM refuses what can never fit)
            self.waiting.popleft()
            if head.generated == 0 and head.first_token_at is None and not head.preempted:
                self.counters.prompt_tokens += head.prompt_tokens
                self.counters.queue_s.append(now - head.arrived_at)
            head.started_at = now
            self.running.append(head)
            self.kv_used += head.held_tokens
            self._prefill += head.held_tokens

    def _victim(self) -> Sequence:
        if self.spec.scheduling == "priority":
            return max(self.running, key=lambda s: (s.priority, s.started_at or 0.0))
        return self.running[-1]

    def _preempt(self, sequence: Sequence) -> None:
        self.running.remove(sequence)
        self.kv_used -= sequence.held_tokens
        self._prefill -= min(self._prefill, sequence.held_tokens)
        sequence.started_at = None
        sequence.preempted = True
        self.counters.preemptions += 1
        self._enqueue(sequence, at_head=True)

    def _enqueue(self, sequence: Sequence, *, at_head: bool) -> None:
        waiting = self.waiting
        if self.spec.scheduling == "priority":
            # Lower first, FIFO among equals; a preempted sequence goes before its equals.
            index = 0
            for index, other in enumerate(waiting):  # noqa: B007 - the index is the point
                if other.priority > sequence.priority or (at_head and other.priority == sequence.priority):
                    break
            else:
                index = len(waiting)
            waiting.insert(index, sequence)
        elif at_head:
            waiting.appendleft(sequence)
        else:
            waiting.append(sequence)

    def _end(self, sequence: Sequence, *, ok: bool) -> None:
        sequence.ended = True
        if sequence in self.running:
            self.running.remove(sequence)
            self.kv_used -= sequence.held_tokens
        else:
            self.waiting.remove(sequence)
        stats = self.stats
        stats.inflight -= 1
        stats.running = len(self.running)
        if ok:
            stats.completed += 1
        if sequence.on_progress is not None:
            sequence.on_progress()


class ContinuousEngine:
    """Runs a ContinuousBatch's steps on the event loop while it has sequences."""

    def __init__(
        self,
        spec: ContinuousSpec,
        stats: EngineStats | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.batch = ContinuousBatch(spec, stats)
        self.slowdown = 1.0
        """Every step takes this many times longer (`/sim/speed`: another tenant on the GPU)."""
        self._clock = clock
        self._stepping: asyncio.Task[None] | None = None

    def start(self, model: str, prompt_tokens: int, output_tokens: int, *, priority: int = 0) -> Sequence:
        """Submit a sequence: the caller follows its `generated` with `progress`, and aborts it
        if its client leaves."""
        sequence = Sequence(model, prompt_tokens, max(1, output_tokens), self._clock(), priority)
        self.batch.submit(sequence)
        if self._stepping is None or self._stepping.done():
            self._stepping = asyncio.ensure_future(self._run())
        return sequence

    async def progress(self, sequence: Sequence) -> int:
        """Wait until `sequence` has made a token past what it had, or has ended: its `generated`."""
        had = sequence.generated
        while sequence.generated == had and not sequence.ended:
            woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            sequence.on_progress = partial(_wake, woken)
            await woken
        return sequence.generated

    def abort(self, sequence: Sequence) -> None:
        self.batch.abort(sequence)

    async def _run(self) -> None:
        batch = self.batch
        while not batch.idle:
            seconds = batch.begin_step(self._clock()) * self.slowdown
            await asyncio.sleep(seconds)
            batch.end_step(self._clock())


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
