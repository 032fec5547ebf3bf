"""The simulator's /metrics in the exact wire format of Triton 2.51 and vLLM.

Written out here rather than through prometheus-client because Triton's counters carry no `_total`
suffix (see ../shared/reference/triton-2.51-metrics.txt) and prometheus-client always adds one;
the gateway's scrapers must meet the real format.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.tools.model_server.engine import ModelCounters, SimEngine

_TRITON: tuple[tuple[str, str, str, Callable[[ModelCounters], float]], ...] = (
    (
        "nv_inference_request_success",
        "counter",
        "Number of successful inference requests, all batch sizes",
        lambda c: c.request_success,
    ),
    (
        "nv_inference_count",
        "counter",
        "Number of inferences performed (does not include cached requests)",
        lambda c: c.inference_count,
    ),
    (
        "nv_inference_exec_count",
        "counter",
        "Number of model executions performed (does not include cached requests)",
        lambda c: c.exec_count,
    ),
    (
        "nv_inference_request_duration_us",
        "counter",
        "Cumulative inference request duration in microseconds (includes cached requests)",
        lambda c: c.request_duration_us,
    ),
    (
        "nv_inference_queue_duration_us",
        "counter",
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
        lambda c: c.queue_duration_us,
    ),
    (
        "nv_inference_pending_request_count",
        "gauge",
        "Instantaneous number of pending requests awaiting execution per-model.",
        lambda c: c.pending,
    ),
)
_VLLM: tuple[tuple[str, str, Callable[[ModelCounters], float]], ...] = (
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda c: c.pending),
    ("vllm:num_requests_running", "Number of requests in model execution batches.", lambda c: c.running),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(engine: SimEngine) -> bytes:
    models: list[tuple[str, ModelCounters]] = [
        (_label(name), counters) for name, counters in sorted(engine.stats.models.items())
    ]
    lines: list[str] = []
    for name, kind, help_text, value in _TRITON:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{model="{m}",version="1"}} {value(c)}' for m, c in models]
    for name, help_text, value in _VLLM:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        lines += [f'{name}{{engine="0",model_name="{m}"}} {float(value(c))}' for m, c in models]
    return ("\n".join(lines) + "\n").encode()
