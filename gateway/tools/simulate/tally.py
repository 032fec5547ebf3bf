"""What a simulated run measured: a tally per (band, tenant) flow, and the window it covers."""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class FlowTally:
    """One (band, tenant) flow over the measured part of a run."""

    arrived: int = 0
    refused: int = 0
    expired: int = 0
    displaced: int = 0
    """Queued, then told at once that a more urgent arrival pushed it past its allowance."""
    late: int = 0
    """Served, but done after the band's deadline."""
    handed_work: float = 0.0
    """Cost handed slots within the measured window."""
    busy_s: float = 0.0
    """Slot time handed within the measured window."""
    service_s: float = 0.0
    """Total service time of the measured requests served."""
    service_squares_s2: float = 0.0
    """Their sum of squared service times (with `service_s`, the served workload's moments)."""
    waits_s: array[float] = field(default_factory=lambda: array("d"))
    retry_after_s: array[float] = field(default_factory=lambda: array("d"))
    """The Retry-After told the measured requests admission refused at arrival."""
    """Queue waits of the measured requests served, in hand-over order."""

    @property
    def served(self) -> int:
        """Measured requests handed a slot."""
        return len(self.waits_s)

    @property
    def on_time(self) -> int:
        """Measured requests served and done within the band's deadline (all served without one)."""
        return len(self.waits_s) - self.late


@dataclass(frozen=True, slots=True)
class Run:
    """What a run measured, per flow, and over which window."""

    tallies: Mapping[tuple[int, str], FlowTally]
    """(band, tenant) -> its tally, for every flow that sent a request."""
    requests: int
    measured_from_s: float
    """When the first measured request arrived."""
    last_arrival_s: float
    measured_to_s: float
    left_queued: int
    """Requests still waiting when the run stopped."""
