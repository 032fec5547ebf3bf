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
