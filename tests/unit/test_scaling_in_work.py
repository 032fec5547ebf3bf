"""The autoscaler hints of a model whose requests cost work (tokens, batch items): its arrival
rate counts upstream calls, as its service time and slots do."""

from __future__ import annotations

from gateway.settings import Autoscaling
from gateway.telemetry.scaling import ScalingHints
from gateway.upstream.backends import BackendState, ModelPool
from policies.wait import QueueStats, Throughput


class PricedStore:
    """Work arrives at 1,000 tokens a second, 100 tokens a call, each call 1 s on a slot."""

    def stats(self, model: str) -> QueueStats:
        return QueueStats((0,), 10)

    def throughput(self, model: str, now: float) -> Throughput:
        return Throughput(
            drain_rate_per_s=10.0,
            admitted_rate_by_band=(1000.0,),
            offered_rate_by_band=(1000.0,),
            service_time_s=1.0,
            handover_cost=100.0,
        )


def test_work_priced_in_tokens_counts_calls_for_the_hints():
    pool = ModelPool("m", [BackendState("m", "http://127.0.0.1:1", 20, "/", ready=True)], 1.0)
    hints = ScalingHints([pool], PricedStore(), Autoscaling(), clock=lambda: 0.0)
    hints.update()
    samples = {m.name: m.samples[0].value for m in hints.collect()}
    assert samples["gateway_arrival_rate"] == 10.0  # calls a second, not tokens
    assert samples["gateway_utilization"] == 0.5  # 10 calls/s x 1 s over 20 slots
