"""How does a long computation run a step at a time?

A computation that may take longer than its caller can stall (an event loop serving requests)
is written as a generator that yields between its costly steps and returns its value. The caller
runs it whole (`finished`) or a step per turn of its loop; either way the value is the same, and
what the computation reads of its inputs it reads when it is made, not as its steps run.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")

Steps = Generator[None, None, T]
"""A computation that yields between its steps and returns its value."""


def finished(steps: Steps[T]) -> T:
    """The value of `steps`, run to its end."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            value: T = end.value
            return value


def known(value: T) -> Steps[T]:
    """A computation whose value is known at once."""
    yield from ()
    return value
