"""A replica's share of a backend's slots when it serves from its in-memory fallback store."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.upstream.backends import BackendState


def fallback_share(slots: int, divisor: int) -> int:
    """The slots of a backend that one of `divisor` replicas may use from its fallback store."""
    return max(1, slots // divisor) if slots else 0


@dataclass(slots=True, eq=False)
class Capacity:
    """This store's share of one backend's slots, and how many of them are in use."""

    backend: BackendState
    divisor: int
    inflight: int = 0
    departed: bool = False
    """The backend left the pool: its slots in use still count, none is handed out."""
    limit: int | None = None
    """At most this many, below the share (see memory.MemoryQueue.limit)."""

    @property
    def max_concurrency(self) -> int:
        share = fallback_share(self.backend.max_concurrency, self.divisor)  # may be discovered later
        return share if self.limit is None else min(share, self.limit)

    @property
    def ready(self) -> bool:
        return self.backend.ready and not self.departed

    @property
    def external_waiting(self) -> float:
        return self.backend.external_waiting
