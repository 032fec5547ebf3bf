"""Run a long pure computation (policies.steps) a step per turn of the event loop.

A computation that takes milliseconds would hold up every request the loop serves meanwhile;
run a step at a time, it lets the loop take its I/O between steps. Its value goes to a callback
once it ends; a computation that raises is logged and dropped. No request waits for one: the
sampled predicted wait is an export, and a limit read again leaves the held one serving (until
it is twice its reuse time old, gateway/flow/predictions.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from policies.steps import Steps

T = TypeVar("T")
log = logging.getLogger(__name__)

StepRunner = Callable[[Steps[T], Callable[[T], None]], None]
"""Runs a computation and hands its value to a callback; `run_stepwise` is the one the gateway
uses, and tests pass one that holds the computations until they choose to run them."""


def run_stepwise(steps: Steps[T], on_value: Callable[[T], None]) -> None:
    """Run `steps` on the running loop, one step per turn, then call `on_value` with its value."""
    loop = asyncio.get_running_loop()

    def step() -> None:
        try:
            next(steps)
        except StopIteration as end:
            on_value(end.value)
        except Exception:
            log.exception("a stepwise computation failed")
        else:
            loop.call_soon(step)

    loop.call_soon(step)
