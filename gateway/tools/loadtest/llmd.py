"""Each run written as an llm-d Benchmark Report (v0.2, the `llmd-benchmark-report` package), so llm-d's
analysis tools read it. Its file names follow the glob those tools search for."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from gateway.version import package_version

TOOL = "inference-gateway-loadtest"


def write_reports(document: Mapping[str, Any], out: Path) -> list[Path]:
    """One report per run (a sweep's steps are its stages), validated as they are built."""
    from llmd_benchmark_report import BenchmarkReportV02  # imported only when exporting

    paths = []
    for stage, run in enumerate(document["runs"]):
        report = BenchmarkReportV02(**report_fields(document, run, stage))
        path = out / f"benchmark_report_v0.2,_{TOOL}_stage_{stage}.yaml"
        report.export_yaml(str(path))
        paths.append(path)
    return paths


def report_fields(document: Mapping[str, Any], run: Mapping[str, Any], stage: int) -> dict[str, Any]:
    """The report's fields: the whole run's requests (failures: those never served), its latencies
    in seconds over the requests served, and its served rate."""
    overall = run["overall"]
    started = datetime.fromisoformat(run["started_at"])
    duration = timedelta(seconds=run["wall_s"])
    latency: dict[str, Any] = {}
    for name, key, units in (
        ("request_latency", "latency_ms", "s"),
        ("time_to_first_token", "ttft_ms", "s"),
        ("inter_token_latency", "itl_ms", "s/token"),
    ):
        if (stats := _seconds(overall[key], units)) is not None:
            latency[name] = stats
    aggregate: dict[str, Any] = {
        "requests": {"total": overall["sent"], "failures": overall["sent"] - overall["served"]},
        "latency": latency,
        "throughput": {"request_rate": {"units": "queries/s", "mean": overall["served"] / run["duration_s"]}},
    }
    load: dict[str, Any] = {
        "tool": TOOL,
        "tool_version": package_version(),
        "source": "random",
        "input_seq_len": {"distribution": "other", "value": 0},
        "stage": stage,
    }
    if run["rate_rps"] > 0:
        load["rate_qps"] = run["rate_rps"]
    return {
        "run": {
            "uid": uuid.uuid4().hex,
            "description": f"{TOOL} against {document['target']} ({document['model']})",
            "time": {
                "start": started.isoformat(),
                "end": (started + duration).isoformat(),
                "duration": f"PT{duration.total_seconds():.3f}S",
            },
        },
        "scenario": {
            "load": {
                "metadata": {"cfg_id": f"{TOOL}-{document['model']}"},
                "standardized": load,
                "native": {"args": {"command": list(document["command"])}},
            }
        },
        "results": {"request_performance": {"aggregate": aggregate}},
    }


def _seconds(stats_ms: Mapping[str, float | None], units: str) -> dict[str, Any] | None:
    if stats_ms["mean"] is None:
        return None  # the schema refuses a null mean: a metric the run lacks is left out
    return {"units": units} | {k: v / 1000 for k, v in stats_ms.items() if v is not None}


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
