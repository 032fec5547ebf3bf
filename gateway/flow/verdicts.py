"""What admission answers a request: a Lease on a slot, or a Refusal and why."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.queues.base import Slot
from policies.outcomes import Outcome


@dataclass(slots=True, eq=False)
class Lease:
    slot: Slot
    queue_wait_s: float
    batch_wait_s: float | None = None
    """Of a request its model may batch: the part of its wait spent held for companions while a
    slot was free (its whole wait when it was held, else 0)."""


@dataclass(frozen=True, slots=True)
class Refusal:
    outcome: Outcome
    retry_after_s: float | None = None
    detail: str | None = None
    rule: str | None = None
    """The setting or header that caused the refusal (gateway.errors shows it)."""
