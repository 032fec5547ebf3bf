"""The requests this replica holds queued, by request id: what `/status/requests/{id}` looks up.

A request is entered when it is queued (not when it is refused at arrival, most of them under
overload) and taken out when its wait ends, however it ends. Ids are the access log's: the
client's `X-Request-Id`, or one made here. Two requests queued under one id (a client reusing
it): the later is found, and the earlier's leaving does not take it out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, eq=False)
class QueuedRequest:
    request_id: str
    model: str
    band: int
    priority: str
    tenant: str
    """The flow's tenant: a configured name, or "" for the unnamed flow."""
    cost: float
    queued_at: float
    """On the gateway's clock."""
    budget_s: float | None
    sequence: str | None = None
    """The sequence it belongs to where its model pins sequences (it waits for that backend)."""


class QueuedRequests:
    def __init__(self) -> None:
        self._by_id: dict[str, QueuedRequest] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, request: QueuedRequest) -> None:
        self._by_id[request.request_id] = request

    def discard(self, request: QueuedRequest) -> None:
        if self._by_id.get(request.request_id) is request:
            del self._by_id[request.request_id]

    def get(self, request_id: str) -> QueuedRequest | None:
        return self._by_id.get(request_id)

    def all(self) -> Iterator[QueuedRequest]:
        return iter(list(self._by_id.values()))
