"""What admission reads of the backends and the cluster (gateway.signals scrapes them)."""

from __future__ import annotations

from typing import Protocol

from policies.shedding import ClusterBacklog


class SignalView(Protocol):
    """What the backends and the cluster report (see gateway.signals)."""

    def external_waiting(self, model: str) -> float: ...
    def backlog(self) -> ClusterBacklog | None: ...


class NoSignals:
    """Nothing reported: no backend queues for others, no cluster backlog."""

    def external_waiting(self, model: str) -> float:
        return 0.0

    def backlog(self) -> ClusterBacklog | None:
        return None
