"""Where the core benchmark runs what (loadtests.bench.Cores.layout)."""

from __future__ import annotations

import os

import pytest

from loadtests.bench import Cores


@pytest.fixture
def four_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 2, 7, 3})


@pytest.mark.usefixtures("four_cores")
def test_the_first_core_is_for_the_servers_under_test_and_the_others_for_the_load_and_backend() -> None:
    assert Cores.layout(["haproxy", "gateway", "floor"], share=False) == Cores(
        frozenset({2}), frozenset({3, 5, 7})
    )


@pytest.mark.usefixtures("four_cores")
def test_cores_are_shared_when_asked_or_when_a_redis_target_would_crowd_its_replicas_onto_one() -> None:
    assert Cores.layout(["gateway"], share=True) is None
    assert Cores.layout(["gateway", "redis3"], share=False) is None


def test_one_core_is_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert Cores.layout(["gateway"], share=False) is None
