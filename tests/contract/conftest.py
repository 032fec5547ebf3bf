"""One fixture per queue store: every contract test runs against each of them."""

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from gateway.queues.base import RequestQueue
from gateway.queues.memory import MemoryQueue
from gateway.settings import Estimation
from gateway.upstream.backends import BackendState, ModelPool

MODEL = "m"


@dataclass
class StoreUnderTest:
    store: RequestQueue
    pool: ModelPool

    def backend(self, index: int = 0) -> BackendState:
        return self.pool.backends[index]


def make_pool(slots: tuple[int, ...]) -> ModelPool:
    return ModelPool(
        name=MODEL,
        backends=[
            BackendState(MODEL, f"http://127.0.0.1:{9000 + i}", n, "/v2/health/ready", ready=True)
            for i, n in enumerate(slots)
        ],
        expected_service_s=0.04,
    )


@pytest.fixture(params=["memory"])
async def make_store(request) -> AsyncIterator[Callable[..., StoreUnderTest]]:
    def build(slots: tuple[int, ...] = (2,), bands: int = 2) -> StoreUnderTest:
        pool = make_pool(slots)
        return StoreUnderTest(MemoryQueue([pool], bands, Estimation()), pool)

    yield build
