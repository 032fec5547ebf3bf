"""How full is a backend? Its saturation, from its own counts where fresh and the gateway's otherwise.

Saturation is the work on a backend per slot: 1 means every slot busy and nothing waiting, above 1
means requests queue inside it. A backend's own report counts the work others send it directly;
when that report is stale, only the gateway's own requests (its slots in use) are known.
"""

from __future__ import annotations


def saturation(
    inflight: int,
    max_concurrency: int,
    reported_waiting: float,
    reported_running: float | None,
    report_fresh: bool,
) -> float:
    """Requests running and waiting on the backend, per slot; 1.0 when its capacity is unknown."""
    if max_concurrency <= 0:
        return 1.0
    if not report_fresh:
        return inflight / max_concurrency
    running = inflight if reported_running is None else max(float(inflight), reported_running)
    return (running + reported_waiting) / max_concurrency
