"""gateway.flow.auto_limits: the law's limit becomes the backend's slots; a follower takes the
leader's, and goes on from there when it comes to lead."""

from __future__ import annotations

import pytest

from gateway.flow.auto_limits import AutoLimits
from gateway.settings import parse_settings
from gateway.upstream.backends import ModelPool
from policies.concurrency_limit import EngineSample
from policies.wait import QueueStats, Throughput

pytestmark = pytest.mark.anyio
URL = "http://127.0.0.1:9000"
CALM = EngineSample(waiting=0, itl_s=0.02, ttft_s=0.1, throughput=100.0)


class SharingStore:
    def __init__(self) -> None:
        self.leader_slots: int | None = 20  # another replica leads with 20
        self.changed: list[str] = []

    def stats(self, model: str) -> QueueStats:
        return QueueStats((3,), 0)  # work queued, no slot free: the limit binds

    def throughput(self, model: str, now: float) -> Throughput:
        return Throughput(0.1, 10.0, (10.0,), (10.0,))  # nothing turned away

    async def share_limit(self, model: str, url: str, slots: int, lead_s: float) -> tuple[bool, int]:
        if self.leader_slots is None:
            return True, slots
        return False, self.leader_slots

    def backends_changed(self, model: str) -> None:
        self.changed.append(model)


def auto_model():
    backend = {"url": URL, "kind": "vllm", "max_concurrency": "auto", "metrics_url": URL + "/metrics"}
    settings = parse_settings(
        {
            "priorities": [{"name": "p", "max_wait_ms": 100}],
            "default_priority": "p",
            "models": [{"name": "m", "backends": [backend]}],
        }
    )
    return settings.models[0]


async def test_a_follower_takes_the_leaders_limit_and_probes_above_it_once_it_leads():
    model = auto_model()
    pool = ModelPool.from_settings(model)
    backend = pool.backends[0]
    store = SharingStore()
    now = [5.0]
    limits = AutoLimits([model], store, scrape_interval_s=0.25, clock=lambda: now[0])
    assert backend.max_concurrency == 1  # min_concurrency, until a sample comes
    await limits.on_sample(pool, backend, CALM)
    assert backend.max_concurrency == 20 and store.changed == ["m"]
    assert backend.limit_moved_at == 5.0  # deadlines of requests sent before tell of the old limit
    store.leader_slots = None  # the leader went away: this replica leads now
    for _ in range(4):
        await limits.on_sample(pool, backend, CALM)
    assert backend.max_concurrency == 20  # calm at the known ceiling, not a slow start to 30
    await limits.on_sample(pool, backend, CALM)
    assert backend.max_concurrency == 21  # the first probe above it


async def test_a_backend_with_a_fixed_limit_is_left_alone():
    settings = parse_settings(
        {
            "priorities": [{"name": "p", "max_wait_ms": 100}],
            "default_priority": "p",
            "models": [{"name": "m", "backends": [{"url": URL, "max_concurrency": 8}]}],
        }
    )
    pool = ModelPool.from_settings(settings.models[0])
    store = SharingStore()
    limits = AutoLimits(settings.models, store, scrape_interval_s=0.25)
    assert not limits.any
    await limits.on_sample(pool, pool.backends[0], CALM)
    assert pool.backends[0].max_concurrency == 8 and store.changed == []
