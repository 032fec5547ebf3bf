"""What one scrape of a model server or of Kueue says, in the units decisions need.

Each reading is built from one Exposition, for one model (or ClusterQueue); counters stay
cumulative here and become rates in the scraper, which holds the previous reading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.signals.exposition import Exposition, Labels

TRITON_PENDING = "nv_inference_pending_request_count"
VLLM_WAITING = "vllm:num_requests_waiting"


@dataclass(frozen=True, slots=True)
class ServerReading:
    """A model server's own view of one model."""

    waiting: float
    """Requests queued inside the server, not yet executing."""
    running: float | None = None
    """Requests executing (vLLM reports it; Triton does not)."""
    kv_cache_usage: float | None = None
    queue_duration_us: float | None = None
    """Triton counters, cumulative."""
    request_success: float | None = None
    exec_count: float | None = None
    inference_count: float | None = None
    engine: EngineCounters | None = None
    """vLLM's cumulative counters of its scheduling (for an auto concurrency limit)."""


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """vLLM's counters and histogram totals, cumulative; None where the server does not emit one."""

    preemptions: float | None = None
    generation_tokens: float | None = None
    ttft: tuple[float, float] | None = None
    """(sum, count) of vllm:time_to_first_token_seconds."""
    itl: tuple[float, float] | None = None
    queue_time: tuple[float, float] | None = None
    """(sum, count) of vllm:request_queue_time_seconds (the wait inside before running)."""


def is_server_page(exposition: Exposition) -> bool:
    """Whether the text is Triton's or vLLM's metrics."""
    return exposition.has(TRITON_PENDING) or exposition.has(VLLM_WAITING)


def read_server(exposition: Exposition, model: str) -> ServerReading | None:
    """Triton's or vLLM's metrics for `model`, whichever the text holds; None if it holds neither,
    or holds nothing of `model`."""
    if exposition.has(TRITON_PENDING):
        return read_triton(exposition, model)
    if exposition.has(VLLM_WAITING):
        return read_vllm(exposition, model)
    return None


def read_triton(exposition: Exposition, model: str) -> ServerReading | None:
    """Sum over version, gpu_uuid and any other label of the model's series; None when the page
    has none (the model is not loaded, or is named otherwise): an unknown queue, not an empty one."""

    def mine(labels: Labels) -> bool:
        return labels.get("model") == model

    if not exposition.has_series(TRITON_PENDING, mine):
        return None
    return ServerReading(
        waiting=exposition.total(TRITON_PENDING, mine) or 0.0,
        queue_duration_us=exposition.total("nv_inference_queue_duration_us", mine),
        request_success=exposition.total("nv_inference_request_success", mine),
        exec_count=exposition.total("nv_inference_exec_count", mine),
        inference_count=exposition.total("nv_inference_count", mine),
    )


def read_vllm(exposition: Exposition, model: str) -> ServerReading | None:
    """Sum over engines; a server that serves one model may name it differently, so when no series
    carries `model` the server's only model_name counts."""
    names = {labels.get("model_name") for _, labels, _ in exposition.families.get(VLLM_WAITING, [])}
    target = model if model in names or len(names) != 1 else next(iter(names))
    if target not in names:
        return None  # several models, none of them this one: its queue is unknown

    def mine(labels: Labels) -> bool:
        return labels.get("model_name") == target

    return ServerReading(
        waiting=exposition.total(VLLM_WAITING, mine) or 0.0,
        running=exposition.total("vllm:num_requests_running", mine),
        kv_cache_usage=exposition.total("vllm:kv_cache_usage_perc", mine),
        engine=EngineCounters(
            preemptions=exposition.total("vllm:num_preemptions", mine),
            generation_tokens=exposition.total("vllm:generation_tokens", mine),
            ttft=exposition.histogram_totals("vllm:time_to_first_token_seconds", mine),
            itl=exposition.histogram_totals("vllm:inter_token_latency_seconds", mine),
            queue_time=exposition.histogram_totals("vllm:request_queue_time_seconds", mine),
        ),
    )


@dataclass(frozen=True, slots=True)
class KueueReading:
    """One ClusterQueue, summed over replica_role, priority_class and any other label."""

    pending_active: float
    pending_inadmissible: float
    admission_wait_buckets: dict[float, float]
    """Cumulative `kueue_admission_wait_time_seconds` buckets."""


def read_kueue(exposition: Exposition, cluster_queue: str) -> KueueReading | None:
    if not exposition.has("kueue_pending_workloads"):
        return None

    def status(wanted: str) -> Callable[[Labels], bool]:
        return lambda labels: labels.get("cluster_queue") == cluster_queue and labels.get("status") == wanted

    return KueueReading(
        pending_active=exposition.total("kueue_pending_workloads", status("active")) or 0.0,
        pending_inadmissible=exposition.total("kueue_pending_workloads", status("inadmissible")) or 0.0,
        admission_wait_buckets=exposition.buckets(
            "kueue_admission_wait_time_seconds", lambda labels: labels.get("cluster_queue") == cluster_queue
        ),
    )
