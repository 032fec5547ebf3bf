"""Endpoint discovery turns the addresses of one name into backends, and follows them."""

import asyncio

import anyio
import pytest

from gateway.queues.base import Flow, Queued
from gateway.queues.memory.store import MemoryQueue
from gateway.settings import Estimation, parse_settings
from gateway.upstream.backends import ModelPool
from gateway.upstream.endpoints import EndpointDiscovery, at_address

pytestmark = pytest.mark.anyio


def settings_with(backend):
    return parse_settings(
        {
            "priorities": [{"name": "low", "max_wait_ms": 1000}],
            "default_priority": "low",
            "models": [{"name": "m", "backends": [backend]}],
        }
    )


@pytest.mark.parametrize(
    ("url", "address", "expected"),
    [
        ("http://pods:8000", "10.0.0.7", "http://10.0.0.7:8000"),
        ("http://pods:8002/metrics", "10.0.0.7", "http://10.0.0.7:8002/metrics"),
        ("http://pods:8000", "fd00::7", "http://[fd00::7]:8000"),
        ("https://pods", "10.0.0.7", "https://10.0.0.7"),
    ],
)
def test_at_address_keeps_scheme_port_and_path(url, address, expected):
    assert at_address(url, address) == expected


async def test_each_address_becomes_a_backend_and_they_follow_the_name():
    settings = settings_with(
        {
            "url": "http://pods:8000",
            "discover": "dns",
            "max_concurrency": 4,
            "metrics_url": "http://pods:8002/metrics",
        }
    )
    pool = ModelPool.from_settings(settings.models[0])
    assert pool.backends == []  # nothing until the name resolves
    addresses = ["10.0.0.1", "10.0.0.2"]
    changed: list[str] = []

    async def resolve(host, port):
        assert (host, port) == ("pods", 8000)
        return list(addresses)

    discovery = EndpointDiscovery(
        [pool], settings.models, changed.append, interval_s=1, timeout_s=1, resolve=resolve
    )
    await discovery.refresh_all()
    assert [(b.url, b.metrics_url, b.max_concurrency) for b in pool.backends] == [
        ("http://10.0.0.1:8000", "http://10.0.0.1:8002/metrics", 4),
        ("http://10.0.0.2:8000", "http://10.0.0.2:8002/metrics", 4),
    ]
    first = pool.backends[0]
    addresses[:] = ["10.0.0.2", "10.0.0.3"]  # the autoscaler replaced a pod
    await discovery.refresh_all()
    assert [b.url for b in pool.backends] == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    assert first not in pool.backends
    assert changed == ["m", "m"]
    await discovery.refresh_all()  # nothing moved: nobody is told
    assert changed == ["m", "m"]


async def test_a_name_that_stops_resolving_keeps_its_backends():
    settings = settings_with({"url": "http://pods:8000", "discover": "dns", "max_concurrency": 1})
    pool = ModelPool.from_settings(settings.models[0])
    answers = [["10.0.0.1"], OSError("temporary failure in name resolution")]

    async def resolve(host, port):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    discovery = EndpointDiscovery(
        [pool], settings.models, lambda model: None, interval_s=1, timeout_s=1, resolve=resolve
    )
    await discovery.refresh_all()
    await discovery.refresh_all()
    assert [b.url for b in pool.backends] == ["http://10.0.0.1:8000"]


async def test_a_resolver_that_hangs_keeps_the_backends_and_does_not_hold_discovery():
    settings = settings_with({"url": "http://pods:8000", "discover": "dns", "max_concurrency": 1})
    pool = ModelPool.from_settings(settings.models[0])
    hang = False

    async def resolve(host, port):
        if hang:
            await asyncio.Event().wait()  # a resolver that never answers
        return ["10.0.0.1"]

    discovery = EndpointDiscovery(
        [pool], settings.models, lambda model: None, interval_s=1, timeout_s=0.05, resolve=resolve
    )
    await discovery.refresh_all()
    hang = True
    with anyio.fail_after(5):  # without its own timeout, the refresh (and the gateway's start) waits for ever
        await discovery.refresh_all()
    assert [b.url for b in pool.backends] == ["http://10.0.0.1:8000"]


def one_slot_pods(addresses: list[str]) -> tuple[ModelPool, MemoryQueue, EndpointDiscovery]:
    """A pool of one slot per address the name resolves to (the list, as the test changes it), a
    memory store over it, and the discovery that follows the name."""
    settings = settings_with({"url": "http://pods:8000", "discover": "dns", "max_concurrency": 1})
    pool = ModelPool.from_settings(settings.models[0])

    async def resolve(host, port):
        return list(addresses)

    store = MemoryQueue([pool], 1, Estimation())
    discovery = EndpointDiscovery(
        [pool], settings.models, store.backends_changed, interval_s=1, timeout_s=1, resolve=resolve
    )
    return pool, store, discovery


async def test_a_departed_backend_keeps_its_slot_count_until_its_requests_end():
    addresses = ["10.0.0.1"]
    pool, store, discovery = one_slot_pods(addresses)
    await discovery.refresh_all()
    pool.backends[0].ready = True
    held = (await store.offer(Flow("m", 0), 1.0, 10.0, 100, now=0.0)).slot
    addresses[:] = ["10.0.0.2"]
    await discovery.refresh_all()
    pool.backends[0].ready = True
    store.backends_changed("m")
    assert store.stats("m").free_slots == 1  # the new pod's slot; the old one is still in use
    await store.release(held, now=1.0)
    assert held.backend.inflight == 0
    assert store.stats("m").free_slots == 1


async def test_an_address_back_while_its_requests_run_is_the_same_backend_with_its_slots_in_use():
    addresses = ["10.0.0.1", "10.0.0.2"]
    pool, store, discovery = one_slot_pods(addresses)
    await discovery.refresh_all()
    for backend in pool.backends:
        backend.ready = True
    store.backends_changed("m")
    held = [(await store.offer(Flow("m", 0), 1.0, 10.0, 100, now=0.0)).slot for _ in range(2)]
    addresses[:] = ["10.0.0.2"]  # 10.0.0.1 fails one readiness probe: out of the endpoints
    await discovery.refresh_all()
    addresses[:] = ["10.0.0.1", "10.0.0.2"]  # and back, its request still running
    await discovery.refresh_all()
    for backend in pool.backends:
        backend.ready = True
    store.backends_changed("m")
    assert isinstance(await store.offer(Flow("m", 0), 1.0, 10.0, 100, now=0.0), Queued), (
        "each server runs one request already"
    )
    for slot in held:
        await store.release(slot, now=1.0)
    assert store.stats("m").free_slots == 1  # the queued request took the first one back
