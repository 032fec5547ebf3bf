"""Values read on a grid, so that small moves of an estimate do not undo what was worked out from
it: a reading reused, a slice of the return schedule left full."""

from __future__ import annotations

import math


def rounded_down(value: float, step_bits: int = 6) -> float:
    """`value` rounded down to a 2**-step_bits step of its binary order (at 6, about 1.5%);
    values at or below 0, and those not finite, as they are."""
    if not 0 < value < math.inf:
        return value
    # frexp's exponent is exact where log2 rounds: a value a few ulps below 2**k is of order k-1.
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, 0.5 <= mantissa < 1
    steps = math.floor(math.ldexp(mantissa, step_bits + 1))
    return math.ldexp(steps, exponent - step_bits - 1)
