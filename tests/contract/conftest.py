"""One fixture per queue store: every contract test runs against each of them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
from redis.asyncio import BlockingConnectionPool, Redis

from gateway.queues.base import RequestQueue, weight_lookup
from gateway.queues.memory.store import MemoryQueue
from gateway.queues.redis.store import RedisQueue
from gateway.settings import Estimation
from gateway.upstream.backends import BackendState, ModelPool
from policies.ordering import Ordering
from policies.quotas import Quota
from tests.redis_server import redis_url_or_skip, unique_prefix

if TYPE_CHECKING:
    from tests.contract.redis_cluster import Cluster

MODEL = "m"


@dataclass
class StoreUnderTest:
    store: RequestQueue
    pool: ModelPool

    def backend(self, index: int = 0) -> BackendState:
        return self.pool.backends[index]

    async def settle(self) -> None:
        """Wait for the store's background work (releases, withdrawals, readiness) to finish.

        Grants another script pushes to this replica's list arrive later, through its listener:
        a test expecting one waits for it with `eventually`.
        """
        if isinstance(self.store, RedisQueue):
            await self.store.settle()


def make_pool(slots: tuple[int, ...], max_queued_work: float | None = None) -> ModelPool:
    return ModelPool(
        name=MODEL,
        backends=[
            BackendState(MODEL, f"http://127.0.0.1:{9000 + i}", n, "/v2/health/ready", ready=True)
            for i, n in enumerate(slots)
        ],
        expected_service_s=0.04,
        max_queued_work=max_queued_work,
    )


StoreFactory = Callable[..., Awaitable[StoreUnderTest]]


@pytest.fixture(params=["memory", "redis"])
async def make_store(request: pytest.FixtureRequest) -> AsyncIterator[StoreFactory]:
    if request.param == "memory":

        async def memory(
            slots: tuple[int, ...] = (2,),
            bands: int = 2,
            ordering: Ordering = Ordering.FIFO,
            weights: dict[str, float] | None = None,
            reserved: tuple[int, ...] = (),
            quotas: dict[str, Quota] | None = None,
            cap: float | None = None,
        ) -> StoreUnderTest:
            pool = make_pool(slots, cap)
            store = MemoryQueue(
                [pool],
                bands,
                Estimation(),
                ordering=ordering,
                weights=weight_lookup(weights),
                reserved=reserved,
                quotas=quotas,
            )
            return StoreUnderTest(store, pool)

        yield memory
        return

    url = redis_url_or_skip()
    pool = BlockingConnectionPool.from_url(url, max_connections=64, timeout=5)
    client = Redis(connection_pool=pool)
    listener = Redis.from_url(url)
    prefix = unique_prefix()
    started: list[RedisQueue] = []

    async def redis(
        slots: tuple[int, ...] = (2,),
        bands: int = 2,
        ordering: Ordering = Ordering.FIFO,
        weights: dict[str, float] | None = None,
        reserved: tuple[int, ...] = (),
        quotas: dict[str, Quota] | None = None,
        cap: float | None = None,
    ) -> StoreUnderTest:
        pool = make_pool(slots, cap)
        store = RedisQueue(
            client,
            listener,
            [pool],
            bands,
            Estimation(),
            key_prefix=f"{prefix}{len(started)}",
            replica_id="r1",
            lease_ttl_s=5.0,
            ordering=ordering,
            weights=weight_lookup(weights),
            reserved=reserved,
            quotas=quotas,
        )
        await store.start()
        started.append(store)
        return StoreUnderTest(store, pool)

    yield redis
    for store in started:
        await store.stop()
    keys = [key async for key in client.scan_iter(match=f"{{{prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()
    await pool.aclose()
    await listener.aclose()


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    """Replicas on one key prefix and one injected Redis clock (tests.contract.redis_cluster)."""
    from tests.contract.redis_cluster import Cluster  # it needs this module's MODEL

    made = Cluster(redis_url_or_skip())
    await made.seed()
    yield made
    await made.close()
