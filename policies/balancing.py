"""Which backend gets the next request? The least loaded ready backend with a free slot.

Load is the share of a backend's slots in use plus the requests it reports queued inside it (other
clients may bypass the gateway), so that a backend with more slots takes proportionally more work
and a backend busy with others' work takes less; ties go to the first backend listed, which keeps
dispatch deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class SlotView(Protocol):
    @property
    def inflight(self) -> int: ...
    @property
    def max_concurrency(self) -> int: ...
    @property
    def ready(self) -> bool: ...
    @property
    def external_waiting(self) -> float: ...


def pick_backend(backends: Sequence[SlotView]) -> int | None:
    """The index of the backend to send to, or None when no ready backend has a free slot."""
    return _least_loaded(backends, with_free_slot=True)


def least_loaded(backends: Sequence[SlotView]) -> int | None:
    """The index of the least loaded ready backend, free slot or not (where a sequence's first
    request is pinned: policies.sequences), or None when none is ready."""
    return _least_loaded(backends, with_free_slot=False)


def _least_loaded(backends: Sequence[SlotView], with_free_slot: bool) -> int | None:
    best: int | None = None
    best_load = 0.0
    for index, backend in enumerate(backends):
        if not backend.ready or backend.max_concurrency <= 0:
            continue
        if with_free_slot and backend.inflight >= backend.max_concurrency:
            continue
        load = (backend.inflight + backend.external_waiting) / backend.max_concurrency
        if best is None or load < best_load:
            best, best_load = index, load
    return best


def free_slots(backends: Sequence[SlotView]) -> int:
    """Slots free on ready backends."""
    return sum(max(0, backend.max_concurrency - backend.inflight) for backend in backends if backend.ready)
