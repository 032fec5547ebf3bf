"""Faults injected into the gateway's own code, for tests of what survives them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest


def fail_once(target: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make `target.name` raise RuntimeError on its first call, then behave; returns its call count."""
    real = getattr(target, name)
    calls: list[int] = []

    def patched(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(f"injected failure in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, patched)
    return calls


class HeldDown:
    """An injected backoff sleep: a crashed loop stays down until the test lets it restart."""

    def __init__(self) -> None:
        self.waiting = 0
        self._go = asyncio.Event()

    async def sleep(self, seconds: float) -> None:
        self.waiting += 1
        await self._go.wait()

    def release(self) -> None:
        self._go.set()
