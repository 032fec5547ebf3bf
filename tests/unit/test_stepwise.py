"""A long computation runs a step per turn of the event loop, and one that fails is dropped."""

import asyncio
import logging

import pytest

from gateway.flow.stepwise import run_stepwise
from policies.steps import Steps, finished, known
from tests.eventually import eventually

pytestmark = pytest.mark.anyio


def counted(order: list[str], steps: int) -> Steps[str]:
    for i in range(steps):
        order.append(f"step {i}")
        yield
    return "done"


async def test_other_callbacks_run_between_the_steps():
    order: list[str] = []
    values: list[str] = []
    run_stepwise(counted(order, 3), values.append)
    asyncio.get_running_loop().call_soon(order.append, "other")
    await eventually(lambda: values == ["done"])
    assert order == ["step 0", "other", "step 1", "step 2"]


async def test_a_computation_that_raises_is_logged_and_its_value_never_comes(caplog):
    def failing() -> Steps[str]:
        yield
        raise ZeroDivisionError("a defect in the computation")

    values: list[str] = []
    with caplog.at_level(logging.ERROR, logger="gateway.flow.stepwise"):
        run_stepwise(failing(), values.append)
        await eventually(lambda: "a stepwise computation failed" in caplog.text)
    assert values == []


def test_run_whole_or_known_at_once_a_computation_has_the_same_value():
    assert finished(counted([], 3)) == "done"
    assert finished(known(1.5)) == 1.5
