"""The health checker's record of a backend is the backend's own: it leaves with it."""

import asyncio
import gc
from collections.abc import Callable
from typing import TypeVar

import aiohttp
import pytest

from gateway.upstream.backends import BackendState, ModelPool
from gateway.upstream.health import HealthChecker
from tests.integration.scripted import ScriptedServer

pytestmark = pytest.mark.anyio
T = TypeVar("T")
UNAVAILABLE = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"


async def unavailable(
    server: ScriptedServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    while await server.read_request(reader):
        writer.write(UNAVAILABLE)
        await writer.drain()


def same_id_as(gone: int, make: Callable[[], T]) -> T:
    """A new object at a freed one's address: CPython reuses freed blocks of the same size."""
    kept = []  # the misses stay alive, so the next try gets another block
    for _ in range(10_000):
        if id(candidate := make()) == gone:
            return candidate
        kept.append(candidate)
    raise AssertionError("no new object took the freed one's address")


def probed_ready(url: str) -> BackendState:
    return BackendState("m", url, 1, "/v2/health/ready", ready=True, probed_ready=True)


async def test_a_new_backend_does_not_inherit_the_failed_probes_of_one_that_left():
    async with ScriptedServer(unavailable) as server, aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{server.origin.port}"
        pool = ModelPool(name="m", backends=[probed_ready(url)], expected_service_s=0.1)
        checker = HealthChecker([pool], lambda model: None, interval_s=1, timeout_s=2, failures_to_down=2)
        await checker.check_all(session)
        assert pool.backends[0].ready  # one failed probe of two
        # Endpoint discovery replaces the pod: the new backend takes the old one's memory (and id).
        gone = id(pool.backends[0])
        pool.backends = []
        gc.collect()
        newcomer = same_id_as(gone, lambda: probed_ready(url))
        pool.backends = [newcomer]
        await checker.check_all(session)
        assert newcomer.ready, "its first failed probe is one of two, not the second"
        await checker.check_all(session)
        assert not newcomer.ready
