"""When should a forming batch leave: now, or after waiting a little longer for companions?

The gateway merges queued KServe requests of one model into one upstream call (gateway.flow.batch_calls).
Under load that needs no waiting: requests queue while every slot is busy, and the slot that frees
takes the head of the queue with the mergeable requests behind it. Waiting is a choice only while
a slot is free, and it pays only on the last one: with a spare slot left, a request sent now costs
the pool nothing it lacks, and holding it only adds latency. On the last free slot a batch sent too
early keeps the next arrivals waiting a whole service time for it to end, so the batch waits for
them instead, as a model server's dynamic batcher does, but never past:
- `max_delay_s` after its oldest member arrived;
- the moment its most urgent member could no longer be served within its budget;
- reaching `max_batch_size` items, or one of the preferred sizes (Triton's `preferred_batch_size`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """A model's batching, in batch items (dimension 0 of a KServe tensor)."""

    max_batch_size: int
    max_delay_s: float
    preferred_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if self.max_delay_s < 0:
            raise ValueError("max_delay_s must not be negative")


@dataclass(frozen=True, slots=True)
class FormingBatch:
    """A batch that may still wait: what the decision reads."""

    items: float
    """Its members' batch items, the newcomer's included."""
    head_age_s: float
    """How long its oldest member has waited."""
    free_slots: int
    """Slots its band may take this moment."""
    slack_s: float | None = None
    """How much longer its most urgent member may wait and still be served within its budget
    (its time left less a service time); None when no member has a budget."""


def hold_s(limits: BatchLimits, batch: FormingBatch) -> float:
    """How much longer the batch waits for companions before it takes a free slot; 0: leave now.

    Also 0 when no slot is free: the batch then queues for one like any request, and leaves
    with whatever mergeable work queued behind it by the time a slot frees.
    """
    if batch.free_slots != 1:
        return 0.0  # none free: nothing to hold back; more than one: a spare slot would idle
    if batch.items >= limits.max_batch_size or batch.items in limits.preferred_sizes:
        return 0.0
    left = limits.max_delay_s - batch.head_age_s
    if batch.slack_s is not None:
        left = min(left, batch.slack_s)
    return max(0.0, left)
