"""vLLM's own metrics for the continuous engine, written by prometheus-client as vLLM writes them.

Names, types, labels (`model_name`, `engine`) and histogram buckets are those of vLLM V1
(`vllm/v1/metrics/loggers.py`; ../shared/reference/metric-formats.md); counters get their `_total`
from prometheus-client, as vLLM's do.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.tools.model_server.continuous import ContinuousBatch

TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

QUEUE_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class VllmMetrics:
    def __init__(self, batch: ContinuousBatch, served_model_name: str) -> None:
        self.batch = batch
        self.registry = CollectorRegistry()
        labels = {"model_name": served_model_name, "engine": "0"}
        names = list(labels)

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, names, registry=self.registry).labels(**labels)

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, names, registry=self.registry).labels(**labels)

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, text, names, buckets=buckets, registry=self.registry).labels(**labels)

        self._waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self._running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self._kv = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self._prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self._generation = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS_S
        )
        self._itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS_S
        )
        self._queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            QUEUE_BUCKETS_S,
        )
        self._counted = (0, 0, 0)

    def render(self) -> bytes:
        batch, counters = self.batch, self.batch.counters
        self._waiting.set(len(batch.waiting))
        self._running.set(len(batch.running))
        self._kv.set(min(1.0, batch.kv_used / batch.spec.kv_tokens))
        preemptions, prompt, generation = self._counted
        self._preemptions.inc(counters.preemptions - preemptions)
        self._prompt.inc(counters.prompt_tokens - prompt)
        self._generation.inc(counters.generation_tokens - generation)
        self._counted = (counters.preemptions, counters.prompt_tokens, counters.generation_tokens)
        for seconds in counters.ttft_s:
            self._ttft.observe(seconds)
        for seconds in counters.itl_s:
            self._itl.observe(seconds)
        for seconds in counters.queue_s:
            self._queue.observe(seconds)
        counters.ttft_s.clear()
        counters.itl_s.clear()
        counters.queue_s.clear()
        return generate_latest(self.registry)
