"""Readiness: may this replica take requests? Not while it drains, while a model has no ready
backend, or while a loop that serving depends on (the Redis store's heartbeat and grant listeners)
is down."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.flow.drain import Drain
from gateway.supervision import Supervisor
from gateway.upstream.backends import ModelPool


class Readiness:
    def __init__(
        self, pools: Mapping[str, ModelPool], drain: Drain, supervisors: Sequence[Supervisor]
    ) -> None:
        self._pools = pools
        self._drain = drain
        self._supervisors = supervisors

    @property
    def draining(self) -> bool:
        return self._drain.draining

    @property
    def models(self) -> dict[str, bool]:
        """Each model, and whether a backend of it is ready."""
        return {name: pool.any_ready for name, pool in self._pools.items()}

    @property
    def loops_down(self) -> list[str]:
        """The required loops that are down, by name."""
        return sorted({name for supervisor in self._supervisors for name in supervisor.required_down()})

    @property
    def ready(self) -> bool:
        return (
            not self._drain.draining
            and all(pool.any_ready for pool in self._pools.values())
            and not self.loops_down
        )
