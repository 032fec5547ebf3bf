"""The simulator's hang fault lets hung requests go one by one, longest-hanging first."""

from __future__ import annotations

import asyncio

import pytest

from gateway.tools.model_server.faults import Fault, Faults
from tests.eventually import eventually

pytestmark = pytest.mark.anyio


async def _hang(faults: Faults, name: str, finished: list[str]) -> None:
    async def receive():
        return {"type": "http.request", "body": name.encode(), "more_body": False}

    answering, replay = await faults.hang(receive, until_disconnect=False)
    assert answering and (await replay())["body"] == name.encode()
    finished.append(name)


async def test_release_lets_the_longest_hanging_requests_go_and_keeps_the_rest():
    faults, finished = Faults(), []
    faults.set(Fault(hang=True))
    tasks = []
    for count, name in enumerate(("first", "second", "third"), start=1):
        tasks.append(asyncio.ensure_future(_hang(faults, name, finished)))
        await eventually(lambda n=count: faults.hanging == n)
    faults.set(Fault.parse(b'{"hang": true, "release": 2}'))
    await eventually(lambda: len(finished) == 2)
    assert finished == ["first", "second"] and faults.hanging == 1
    faults.set(Fault())  # clearing the fault lets the rest go
    await asyncio.gather(*tasks)
    assert finished == ["first", "second", "third"] and faults.hanging == 0


@pytest.mark.parametrize(
    "body", [b'{"release": 1}', b'{"hang": true, "release": -1}', b'{"hang": true, "release": "1"}']
)
def test_release_is_a_count_of_hung_requests(body):
    with pytest.raises(ValueError, match="release"):
        Fault.parse(body)
