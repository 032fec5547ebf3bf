import fcntl
from collections.abc import Iterator
from pathlib import Path

import pytest

SLOW_ROOMS = {"integration", "adversarial", "deploy"}
"""Test folders whose tests start real servers: the fast tier (`-m "not slow"`) leaves them out."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `slow` what starts processes or needs a redis-server: the suites of real servers, and
    every test run against the Redis store. What stays is the fast tier: units, the policies'
    and the simulator's properties, and the contract suites on the memory store."""
    for item in items:
        room = Path(item.path).relative_to(Path(__file__).parent).parts[0]
        params = getattr(item, "callspec", None)
        on_redis = params is not None and "redis" in map(str, params.params.values())
        if room in SLOW_ROOMS or on_redis or item.get_closest_marker("redis") or _uses_redis(item):
            item.add_marker(pytest.mark.slow)


def _uses_redis(item: pytest.Item) -> bool:
    return any("redis" in name or name == "cluster" for name in getattr(item, "fixturenames", ()))


@pytest.fixture(autouse=True)
def _floods_run_alone(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """A test marked `flood` runs while no other test does, across the suite's workers: a flood
    measures shares and deadlines with the backend as the bottleneck, and beside another test's
    processes on two cores the machine becomes the bottleneck instead (the gateway's loop late on
    its hand-overs, admitted requests expiring). Other tests share the suite; a flood waiting for
    its turn holds a turnstile that keeps new ones from starting meanwhile (else one worker's
    stream of short tests could keep it waiting). Taken before the test's servers start: autouse
    fixtures come first."""
    # The workers' temporary folders share one parent per session (popen-gw0, popen-gw1).
    folder = tmp_path_factory.getbasetemp().parent
    alone = request.node.get_closest_marker("flood") is not None
    with open(folder / "tests.lock", "a") as running, open(folder / "turnstile.lock", "a") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(running, fcntl.LOCK_UN)
