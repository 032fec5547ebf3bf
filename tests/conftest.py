import fcntl
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.scheduling import FLOOD_FILES, SLOW_ROOMS, FloodsFirst


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `slow` what starts processes or needs a redis-server: the suites of real servers, and
    every test run against the Redis store. What stays is the fast tier: units, the policies'
    and the simulator's properties, and the contract suites on the memory store."""
    for item in items:
        room = _room(item)
        params = getattr(item, "callspec", None)
        on_redis = params is not None and "redis" in map(str, params.params.values())
        if room in SLOW_ROOMS or on_redis or item.get_closest_marker("redis") or _uses_redis(item):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("flood") is not None:
            assert item.nodeid.split("::")[0] in FLOOD_FILES, f"{item.nodeid}: a flood outside FLOOD_FILES"
            assert item.get_closest_marker("slow") is not None, f"{item.nodeid}: a flood in the fast tier"
            # Once more where it fails, and reported as rerun: a flood's deadlines and goodput are
            # the machine's too. On this shared 2-core one, floods running alone still failed now
            # and then, a different one each time, each passing alone after (the last: 10 of 299
            # admitted requests expired on Redis, where 0-3 do alone, beside two processes
            # spinning, or beside the Redis contracts). A fault of the gateway's fails twice.
            item.add_marker(pytest.mark.flaky(reruns=1))


_RERUNS: list[pytest.TestReport] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome == "rerun":
        _RERUNS.append(report)


def pytest_terminal_summary(terminalreporter) -> None:
    """Why each rerun flood failed the first time: a rerun that passed still tells something."""
    for report in _RERUNS:
        terminalreporter.write_sep("-", f"failed once, then run again: {report.nodeid}")
        terminalreporter.write_line(report.longreprtext[-3000:])


def pytest_xdist_make_scheduler(config: pytest.Config, log) -> FloodsFirst | None:
    """The floods' files first, on one worker, beside the fast rooms' on the other (tests/scheduling.py)."""
    return FloodsFirst(config, log) if config.getvalue("dist") == "loadfile" else None


def _room(item: pytest.Item) -> str:
    return Path(item.path).relative_to(Path(__file__).parent).parts[0]


def _uses_redis(item: pytest.Item) -> bool:
    return any("redis" in name or name == "cluster" for name in getattr(item, "fixturenames", ()))


@pytest.fixture(autouse=True)
def _floods_run_alone(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """A test marked `flood` runs while no other test of real servers (SLOW_ROOMS) runs, across the
    suite's workers: a flood measures shares and deadlines with the backend as the bottleneck, and
    beside another test's gateways and load on two cores the machine becomes the bottleneck
    instead (the gateway's loop late on its hand-overs, admitted requests expiring). Other tests of
    real servers share the suite; a flood waiting for its turn holds a turnstile that keeps new ones
    from starting meanwhile (else one worker's stream of short tests could keep it waiting). Tests
    in one process (units, properties, the stores' contracts, on Redis too) take no lock and run
    beside a flood: the floods passed beside two processes spinning on both cores. Taken before the
    test's servers start: autouse fixtures come first."""
    alone = request.node.get_closest_marker("flood") is not None
    if not alone and _room(request.node) not in SLOW_ROOMS:
        yield
        return
    # The workers' temporary folders share one parent per session (popen-gw0, popen-gw1).
    folder = tmp_path_factory.getbasetemp().parent
    with open(folder / "tests.lock", "a") as running, open(folder / "turnstile.lock", "a") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(running, fcntl.LOCK_UN)
