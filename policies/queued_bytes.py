"""Request bodies held in a replica's queue, bounded in bytes: the memory a queue may take.

Bodies stay in the replica that received them (they never enter a shared store), so the bound is
per replica: on all models together, and optionally on each model. A request whose body does not
fit is refused like one the queue has no room for, and its Retry-After is the time the queue needs
to hand out enough bodies for it to fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ByteLimits:
    total: int
    """All models together."""
    per_model: Mapping[str, int] = field(default_factory=dict)
    """Models with a bound of their own."""


def excess_bytes(limits: ByteLimits, held: Mapping[str, int], model: str, body_bytes: int) -> int:
    """How many bytes over its bound a body of `body_bytes` for `model` would take the queue
    (0 or less: it fits)."""
    over_total = sum(held.values()) + body_bytes - limits.total
    bound = limits.per_model.get(model)
    over_model = held.get(model, 0) + body_bytes - bound if bound is not None else over_total
    return max(over_total, over_model)


def model_bound_binds(limits: ByteLimits, held: Mapping[str, int], model: str, body_bytes: int) -> bool:
    """Whether the model's own bound, not the replica-wide one, is what a body over them exceeds most
    (the setting a refusal names)."""
    bound = limits.per_model.get(model)
    if bound is None:
        return False
    over_total = sum(held.values()) + body_bytes - limits.total
    return held.get(model, 0) + body_bytes - bound >= over_total


def bytes_excess_wait_s(excess: int, held_bytes: int, queued_work: float, drain_rate_per_s: float) -> float:
    """Seconds until `excess` bytes have left the queue: its bodies leave as their requests get
    slots, at the drain rate times the bytes per unit of queued work (0 with nothing queued, which
    leaves the floor to Retry-After)."""
    if excess <= 0 or held_bytes <= 0 or queued_work <= 0 or drain_rate_per_s <= 0:
        return 0.0
    bytes_per_s = drain_rate_per_s * held_bytes / queued_work
    return excess / bytes_per_s
