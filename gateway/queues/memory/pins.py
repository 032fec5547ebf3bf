"""The memory store's sequence pins: which backend each live sequence's requests must reach
(policies.sequences), and whether that backend has a slot free."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.queues.base import Ticket
from gateway.queues.memory.band_queue import BandQueue
from gateway.queues.shares import Capacity
from policies.balancing import least_loaded
from policies.sequences import PIN_IDLE_S, SequenceRef

SWEEP_AT = 4096
"""Pins past their time are swept out once this many are held, and after a sweep once twice as many
as it left (so that many live sequences cost a sweep now and then, not one a request); each is
dropped when read, too."""


class SequencePins:
    def __init__(self) -> None:
        self._pins: dict[str, tuple[str, float]] = {}
        """Sequence key -> (its backend's url, until when the pin holds)."""
        self._sweep_at = SWEEP_AT

    def __len__(self) -> int:
        return len(self._pins)

    def backend_of(
        self, sequence: SequenceRef, capacity: Sequence[Capacity], now: float
    ) -> tuple[str | None, bool]:
        """The backend a request of `sequence` arriving `now` must take a slot on, and whether it
        is pinned there anew: its pin; or, for its first request (or a start, or a pin past its
        time or to a backend gone or not ready), the least loaded ready backend (None: none is
        ready), which `admitted` pins once the request is admitted, so that the requests that
        follow before this one is served go there too. A refused request pins nothing."""
        pin = self._pins.get(sequence.key)
        if pin is not None and not sequence.start and pin[1] >= now:
            if any(c.backend.url == pin[0] and c.ready for c in capacity):
                return pin[0], False
        index = least_loaded(capacity)
        return (None if index is None else capacity[index].backend.url), True

    def admitted(self, sequence: SequenceRef, backend: str | None, anew: bool, now: float) -> None:
        """A request of `sequence` placed on `backend` (`backend_of`) was admitted."""
        if not anew:
            return
        if backend is None:
            self._pins.pop(sequence.key, None)
            return
        self.follow(SequenceRef(sequence.key), backend, now)

    def follow(self, sequence: SequenceRef, url: str, seen_at: float) -> None:
        """A request of `sequence` got a slot on `url`: its next ones go there too, until its end."""
        if sequence.end:
            self._pins.pop(sequence.key, None)
            return
        self._pins[sequence.key] = (url, seen_at + PIN_IDLE_S)
        if len(self._pins) >= self._sweep_at:
            self._pins = {key: pin for key, pin in self._pins.items() if pin[1] >= seen_at}
            self._sweep_at = max(SWEEP_AT, 2 * len(self._pins))


def index_of(capacity: Sequence[Capacity], url: str) -> int | None:
    """The index of the backend at `url` when it has a slot free for this store, else None."""
    for index, share in enumerate(capacity):
        if share.backend.url == url:
            return index if share.ready and share.inflight < share.max_concurrency else None
    return None


def has_room(capacity: Sequence[Capacity], url: str) -> bool:
    """Whether the backend at `url` has a slot free for this store (a pinned head's)."""
    return index_of(capacity, url) is not None


def next_pinned(
    bands: Sequence[BandQueue],
    live: set[Ticket],
    capacity: Sequence[Capacity],
    usable: Callable[[int], int],
    may_start: Callable[[str, float], bool],
) -> tuple[int, Ticket] | None:
    """The first waiting request of a sequence, most urgent band first, whose backend has a slot
    free, that its band may take (reservations) and its tenant may start (quotas); None if none."""
    for index, band in enumerate(bands):
        if not band.pinned:
            continue
        band.pinned[:] = [ticket for ticket in band.pinned if ticket in live]  # withdrawn ones go
        if band.pinned and usable(index) <= 0:
            return None  # kept for a more urgent class, and so from every less urgent one
        for ticket in band.pinned:
            if ticket.backend is not None and has_room(capacity, ticket.backend):
                if may_start(ticket.flow.tenant, ticket.cost):
                    return index, ticket
    return None
