"""QueuedBytes: the request-body bytes this replica holds for queued requests, per model."""

from __future__ import annotations

from policies.queued_bytes import ByteLimits, excess_bytes


class QueuedBytes:
    """Holds are taken before a request joins the queue and given back when it leaves it (with a
    slot or without); `excess` says whether one more fits."""

    def __init__(self, limits: ByteLimits) -> None:
        self.limits = limits
        self.held: dict[str, int] = {}

    def hold(self, model: str, body_bytes: int) -> int:
        """Take the bytes and return 0, or take nothing and return how many bytes too many."""
        excess = excess_bytes(self.limits, self.held, model, body_bytes)
        if excess > 0:
            return excess
        self.held[model] = self.held.get(model, 0) + body_bytes
        return 0

    def give_back(self, model: str, body_bytes: int) -> None:
        self.held[model] -= body_bytes
