"""What a replica sends when it rejoins Redis after running from its fallback, and what it takes
from the reply (lua/rejoin.lua does the rejoining itself, in one step)."""

from __future__ import annotations

import logging
from typing import Any

from gateway.queues.redis_codec import as_list, ready_arg
from gateway.queues.redis_grants import ModelState

log = logging.getLogger("gateway.redis")


def rejoin_args(
    state: ModelState, replica: str, lease_ttl_s: float, expected_replicas: int, reserve: dict[str, int]
) -> dict[str, Any]:
    """`reserve`: backend url -> slots the fallback store still uses, to be held as leases."""
    return {
        "replica": replica,
        # Long enough for every live replica to notice Redis is back and rejoin.
        "window": lease_ttl_s + 1.0,
        "expected": expected_replicas,
        "ready": ready_arg(state.pool),
        "reserve": [{"u": url, "n": n} for url, n in reserve.items() if n],
        "keep": [{"l": lease, "u": slot.backend.url} for lease, slot in state.held.items()],
    }


def take_rejoin(state: ModelState, reply: dict[str, Any]) -> list[str]:
    """Follow the leases Redis renamed (it had forgotten them); returns the reserved leases."""
    if reply["dropped"] or reply["freed"]:
        log.info(
            "model %s: dropped %d stale ticket(s) and %d stale lease(s)",
            state.pool.name,
            reply["dropped"],
            reply["freed"],
        )
    for old, new in as_list(reply["renamed"]):
        slot = state.held.pop(old)
        slot.lease = new
        state.held[new] = slot
    return as_list(reply["reserved"])
