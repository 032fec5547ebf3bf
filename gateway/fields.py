"""Numbers in HTTP fields: the lengths and counts the gateway reads from a client's or a backend's
headers.

`int()` raises on more than 4,300 digits (Python's guard against quadratic parsing), so a field
that `bytes.isdigit()` accepts can still end a request in a 500. A field here is a number only as
1*DIGIT, and only up to 18 digits: far beyond any length or count the gateway could hold.
"""

from __future__ import annotations

MAX_DIGITS = 18


def decimal(value: bytes) -> int | None:
    """The non-negative integer `value` spells in ASCII digits, or None where it spells none."""
    if 0 < len(value) <= MAX_DIGITS and value.isdigit():
        return int(value)
    return None
