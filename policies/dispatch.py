"""Which band gets a slot that frees? Strict priority: the most urgent band with work waiting.

A request never waits behind a less urgent one. (Fairness between tenants within a band picks the
flow once the band is chosen; it does not cross bands.)
"""

from __future__ import annotations

from collections.abc import Sequence


def next_band(queued_by_band: Sequence[int]) -> int | None:
    """The index of the most urgent non-empty band, or None when nothing waits."""
    for band, depth in enumerate(queued_by_band):
        if depth > 0:
            return band
    return None
