"""`Server-Timing` of an answer (HTTP's header, gRPC's trailing metadata): where its time went."""

from __future__ import annotations


def server_timing_value(queue_s: float, upstream_s: float, batch_s: float | None = None) -> str:
    """The wait for a slot, for a batch's companions where batched, and the time upstream, in ms:
    `queue;dur=<ms>, [batch;dur=<ms>, ]upstream;dur=<ms>`."""
    batch = "" if batch_s is None else f"batch;dur={batch_s * 1000:.3f}, "
    return f"queue;dur={queue_s * 1000:.3f}, {batch}upstream;dur={upstream_s * 1000:.3f}"
