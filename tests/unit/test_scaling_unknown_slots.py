"""The desired replicas of a model whose model servers' slots are not known: no answer until they
have been, and the last known slots once its pods are gone."""

from __future__ import annotations

from dataclasses import replace

from gateway.settings import Autoscaling
from gateway.telemetry.scaling import ScalingHints
from gateway.upstream.backends import BackendState, ModelPool
from policies.wait import Throughput
from tests.unit.test_scaling_in_work import PricedStore


class GrowingStore(PricedStore):
    """PricedStore's load, times `factor`."""

    factor = 1.0

    def throughput(self, model: str, now: float) -> Throughput:
        base = super().throughput(model, now)
        return replace(
            base, offered_rate_by_band=tuple(rate * self.factor for rate in base.offered_rate_by_band)
        )


def exported(hints: ScalingHints) -> dict[str, list[float]]:
    return {m.name: [s.value for s in m.samples] for m in hints.collect()}


def test_no_answer_while_no_backend_slots_are_known_then_the_last_known_ones():
    triton = BackendState("m", "http://127.0.0.1:1", 0, "/", ready=False)  # its config not read yet
    pool = ModelPool("m", [triton], 1.0)
    now = [0.0]
    config = Autoscaling()
    store = GrowingStore()
    hints = ScalingHints([pool], store, config, clock=lambda: now[0])
    hints.update()
    # Not 1: an HPA scaling on it would shrink the fleet to one pod while its slots are unknown.
    assert exported(hints)["gateway_desired_replicas"] == []
    assert exported(hints)["gateway_arrival_rate"] == [10.0]

    triton.known_slots = 4  # 10 calls/s of 1 s each need more than 10 slots: at least 3 pods of 4
    hints.update()
    needed = exported(hints)["gateway_desired_replicas"]
    assert len(needed) == 1 and needed[0] >= 3
    pool.backends = []  # every pod gone (scaled to zero, or the name resolves to nothing)
    store.factor = 2.0  # and the load doubles meanwhile
    now[0] += config.scale_down_window_s + 1  # past what the stabilization window remembers
    hints.update()
    assert exported(hints)["gateway_desired_replicas"][0] > needed[0], "sized by the pods' last known slots"
