"""Values read on a grid, so that small moves of an estimate do not undo what was worked out from
it: a reading reused, a slice of the return schedule left full."""

from __future__ import annotations

import math


def rounded_down(value: float, step_bits: int = 6) -> float:
    """`value` rounded down to a 2**-step_bits step of its binary order (at 6, about 1.5%);
    values at or below 0 as they are."""
    if value <= 0:
        return value
    step = 2.0 ** (math.floor(math.log2(value)) - step_bits)
    return math.floor(value / step) * step
