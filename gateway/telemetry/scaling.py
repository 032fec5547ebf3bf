"""Autoscaler hints: per model, the replica count that queueing theory says the load needs.

Every `interval_ms` the measured arrival rate (the store's, so global with Redis), service time
and its variability go to the planner (policies.capacity through policies.scaling_hint), with the
configured target wait and utilization ceiling; replicas have the slots of the model's backends.
The answer is exported as `gateway_desired_replicas{model}`, stabilized against flapping (absent
until the slots of one of the model's backends have been known), beside
the inputs an operator checks it against: `gateway_arrival_rate{model}` and
`gateway_utilization{model}`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskStatus
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.settings import Autoscaling
from gateway.telemetry.metrics import QueueView
from gateway.upstream.backends import ModelPool
from policies.capacity import Targets
from policies.estimators import ewma_in_time
from policies.scaling_hint import desired_replicas, stabilized


@dataclass(slots=True)
class _ModelHint:
    arrival_rate: float = 0.0
    utilization: float = 0.0
    desired: int | None = None
    """None until a backend's slots are known: no answer, rather than a guess an autoscaler acts on."""
    slots_per_replica: int = 0
    """As last known: pods that all left (scaled to zero, or not resolving) do not make it unknown."""
    history: deque[tuple[float, int]] = field(default_factory=deque)


class ScalingHints(Collector):
    def __init__(
        self,
        pools: Sequence[ModelPool],
        store: QueueView,
        config: Autoscaling,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pools = pools
        self._store = store
        self._config = config
        self._clock = clock
        self._targets = Targets(
            mean_wait=config.target_wait_ms / 1000,
            p_wait=config.target_p_wait,
            max_utilization=config.max_utilization,
        )
        self._hints = {pool.name: _ModelHint() for pool in pools}
        self._updated_at: float | None = None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        while True:
            self.update()
            task_status.started()
            await asyncio.sleep(self._config.interval_ms / 1000)

    def update(self) -> None:
        now = self._clock()
        first = self._updated_at is None
        elapsed_s = 0.0 if self._updated_at is None else now - self._updated_at
        self._updated_at = now
        for pool in self._pools:
            hint = self._hints[pool.name]
            flow = self._store.throughput(pool.name, now)
            # The store's rate forgets within seconds; the hint averages over the longer window.
            # It counts work (tokens, batch items): a slot takes `handover_cost` of it per call.
            instant = sum(flow.offered_rate_by_band) / max(flow.handover_cost, 1e-9)
            hint.arrival_rate = ewma_in_time(
                None if first else hint.arrival_rate, instant, elapsed_s, self._config.window_s
            )
            total_slots = sum(b.max_concurrency for b in pool.backends if b.ready)
            hint.utilization = hint.arrival_rate * flow.service_time_s / total_slots if total_slots else 0.0
            if known := [b.known_slots for b in pool.backends if b.known_slots > 0]:
                hint.slots_per_replica = round(sum(known) / len(known))
            if not hint.slots_per_replica:
                continue  # a Triton's slots not read yet: an HPA holds while the metric is absent
            answer = desired_replicas(
                hint.arrival_rate, flow.service_time_s, flow.service_cv, hint.slots_per_replica, self._targets
            )
            hint.history.append((now, answer))
            while hint.history and now - hint.history[0][0] > self._config.scale_down_window_s:
                hint.history.popleft()
            hint.desired = stabilized(hint.history, now, self._config.scale_down_window_s)

    def collect(self) -> Iterator[Metric]:
        desired = GaugeMetricFamily(
            "gateway_desired_replicas",
            "Model-server replicas the measured load needs for the target wait (scale on this).",
            labels=["model"],
        )
        arrivals = GaugeMetricFamily(
            "gateway_arrival_rate",
            "Requests per second arriving for the model (upstream calls: the arriving work over the "
            "work one call carries), averaged over the autoscaling window.",
            labels=["model"],
        )
        utilization = GaugeMetricFamily(
            "gateway_utilization",
            "Offered load over the ready backends' slots: arrival rate x service time / slots.",
            labels=["model"],
        )
        for name, hint in self._hints.items():
            if hint.desired is not None:
                desired.add_metric([name], hint.desired)
            arrivals.add_metric([name], hint.arrival_rate)
            utilization.add_metric([name], hint.utilization)
        yield from (desired, arrivals, utilization)

    def describe(self) -> Iterator[Metric]:
        return iter(())
