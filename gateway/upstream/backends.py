"""The gateway's view of each model server: where it is, how many slots it has, whether it is ready."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.settings import Model


@dataclass(slots=True, eq=False)
class BackendState:
    """One backend of one model. `inflight` is the slots this gateway holds on it."""

    model: str
    url: str
    max_concurrency: int
    health_path: str
    metrics_url: str | None = None
    ready: bool = False
    inflight: int = 0


@dataclass(slots=True, eq=False)
class ModelPool:
    name: str
    backends: list[BackendState] = field(default_factory=list)
    expected_service_s: float = 0.1
    upstream_timeout_s: float = 300.0

    @property
    def any_ready(self) -> bool:
        return any(b.ready for b in self.backends)

    @property
    def total_slots(self) -> int:
        return sum(b.max_concurrency for b in self.backends if b.ready)

    @classmethod
    def from_settings(cls, model: Model) -> ModelPool:
        return cls(
            name=model.name,
            backends=[
                BackendState(
                    model=model.name,
                    url=b.url,
                    max_concurrency=b.max_concurrency,
                    health_path=b.health_path,
                    metrics_url=b.metrics_url,
                )
                for b in model.backends
            ],
            expected_service_s=model.expected_service_ms / 1000,
            upstream_timeout_s=model.upstream_timeout_ms / 1000,
        )
