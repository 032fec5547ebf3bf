"""The open client connections of a process, and which one to close for a newcomer at the limit."""

from __future__ import annotations

from typing import Generic, TypeVar

C = TypeVar("C")


class ConnectionTable(Generic[C]):
    """The open client connections, and which to close for a new one at the limit.

    Sans-IO: the caller says what happens to its connections and closes the one it is told to.
    """

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self._open: set[C] = set()
        # Insertion-ordered: a connection goes to the end each time it starts waiting, so the
        # first one is the one that has waited longest.
        self._waiting: dict[C, None] = {}

    def opened(self, connection: C) -> C | None:
        """Count `connection` in, waiting for its first request. Returns the connection to close
        now: None under the limit, else the one waiting longest, which is `connection` itself when
        every other one has a request in progress. The connection returned is counted out."""
        self._open.add(connection)
        self._waiting[connection] = None
        if len(self._open) <= self.max_connections:
            return None
        victim = next(iter(self._waiting))
        self.closed(victim)
        return victim

    def busy(self, connection: C) -> None:
        """A request is in progress on `connection`: it is not closed for a newcomer."""
        self._waiting.pop(connection, None)

    def waiting(self, connection: C) -> None:
        """`connection` has no request in progress any more; it has waited since now."""
        if connection in self._open:
            self._waiting.pop(connection, None)
            self._waiting[connection] = None

    def closed(self, connection: C) -> None:
        self._open.discard(connection)
        self._waiting.pop(connection, None)

    def __len__(self) -> int:
        return len(self._open)
