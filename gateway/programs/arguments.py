"""Argument types for the command line's numbers (argparse `type=`): a bad value is a message
naming the bound it breaks, and exit status 2."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(low: float, high: float = math.inf, *, strict: bool = False) -> Callable[[str], float]:
    """A finite number at least `low` (above it when `strict`) and at most `high`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(value) and (value > low if strict else value >= low) and value <= high):
            bound = f"{'>' if strict else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    return parse


def count(low: int, high: int | None = None) -> Callable[[str], int]:
    """A whole number at least `low`, and at most `high` when given."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {text}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    return parse
