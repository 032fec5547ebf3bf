"""Sequences: requests of one stateful conversation with a model (Triton's sequence batcher) must all
reach the backend that holds its state.

A KServe v2 / Triton request names its sequence in its parameters: `sequence_id` (a positive
integer or a non-empty string; 0 or "" is no sequence), `sequence_start` on its first request and
`sequence_end` on its last. The gateway pins a sequence to a backend when its first request
arrives (the least loaded ready one: policies.balancing.least_loaded), and every request of it
takes a slot on that backend only (a queued one waits for that backend's slot while others go to
the rest: policies.dispatch). A start pins it anew; an end, once served, or PIN_IDLE_S with no
request of it forgets the pin.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PIN_IDLE_S = 600.0
"""A pin outlives this long without a request of its sequence. Longer than a model server keeps an
idle sequence (Triton's max_sequence_idle_microseconds, 1 s by default), so that a live sequence
never loses its backend; a request after the server forgot it fails there, as it would alone."""


@dataclass(frozen=True, slots=True)
class SequenceRef:
    key: str
    """The sequence's id, as text (an integer id and its decimal string are one sequence)."""
    start: bool = False
    end: bool = False


def sequence_of(parameters: Mapping[str, object]) -> SequenceRef | str | None:
    """The sequence a request's parameters name, None where they name none, or what is wrong."""
    raw = parameters.get("sequence_id")
    if raw is None or raw == 0 or raw == "":
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | str) or (isinstance(raw, int) and raw < 0):
        return "sequence_id must be a positive integer or a non-empty string"
    flags = {}
    for name in ("sequence_start", "sequence_end"):
        value = parameters.get(name, False)
        if not isinstance(value, bool):
            return f"{name} must be true or false"
        flags[name] = value
    return SequenceRef(str(raw), flags["sequence_start"], flags["sequence_end"])
