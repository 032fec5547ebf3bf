"""report.json's document rendered as report.html: self-contained (inline CSS and SVG), readable offline."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from gateway.tools.loadtest.charts import Series, line_chart

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1340px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; } h3 { font-size: 15px; }
table { border-collapse: collapse; margin: 8px 0 16px; } td, th { padding: 3px 10px; text-align: right; }
th { border-bottom: 1px solid #999; } td:first-child, th:first-child { text-align: left; }
tr:nth-child(even) td { background: #f4f4f4; } .charts { display: flex; flex-wrap: wrap; gap: 12px; }
.chart { border: 1px solid #ddd; } .chart .title { font-weight: 600; font-size: 13px; }
.chart .grid { stroke: #eee; } .chart .tick, .chart .legend { font-size: 11px; fill: #444; }
.chart .axis { font-size: 12px; fill: #222; } .note { color: #555; } code { background: #f4f4f4; }
"""

_COLUMNS = (
    ("sent", "sent", None),
    ("offered/s", "offered_rps", None),
    ("goodput/s", "goodput_rps", None),
    ("within deadline", "goodput_share", "share"),
    ("served in the end", "served_eventually", "share"),
    ("first retry admitted", "first_retry_admitted", "share"),
    ("attempts/served", "attempts_per_served", None),
    ("p50 ms", ("latency_ms", "p50"), None),
    ("p99 ms", ("latency_ms", "p99"), None),
    ("queue p99 ms", ("queue_ms", "p99"), None),
    ("TTFT p50 ms", ("ttft_ms", "p50"), None),
    ("ITL p50 ms", ("itl_ms", "p50"), None),
    ("refused", "refused_by_reason", "reasons"),
)


def render(document: Mapping[str, Any]) -> str:
    """The whole report: the run's settings, the sweep's curves, then each run's tables and charts."""
    runs: Sequence[Mapping[str, Any]] = document["runs"]
    title = f"Load test of {document['model']} at {document['target']}"
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f'<p class="note">Started {escape(str(document["started_at"]))}; command '
        f"<code>{escape(' '.join(document['command']))}</code>.</p>",
    ]
    if len(runs) > 1:
        parts.append(_sweep(document))
    if "recommendation" in document:
        parts.append(_recommendation(document["recommendation"]))
    if "compared" in document:
        parts.append(_compared(document["compared"]))
    parts += [_run(run, several=len(runs) > 1) for run in runs]
    data = _script_safe(json.dumps(document))
    parts.append(f'<script type="application/json" id="report">{data}</script></body></html>')
    return "".join(parts)


def _script_safe(text: str) -> str:
    return text.replace("</", "<\\/")


def _sweep(document: Mapping[str, Any]) -> str:
    runs = document["runs"]
    knee = document.get("sweep") or {}
    offered = [run["overall"]["offered_rps"] for run in runs]
    overall = [run["overall"] for run in runs]
    goodput = Series("goodput within deadline", _points(offered, [o["goodput_rps"] for o in overall]))
    ideal = Series("offered", [(x, x) for x in offered], dashed=True)
    p50 = Series("p50", _points(offered, [o["latency_ms"]["p50"] for o in overall]))
    p99 = Series("p99", _points(offered, [o["latency_ms"]["p99"] for o in overall]))
    sustained = knee.get("knee_offered_rps")
    return (
        "<h2>Sweep</h2>"
        f"<p>Most goodput within deadline: <b>{knee.get('max_sustainable_rps')}</b> requests/s; highest "
        f"offered rate served at least 95% within deadline: <b>{sustained}</b> requests/s.</p>"
        '<div class="charts">'
        + line_chart("Goodput against offered rate", "offered requests/s", "requests/s", [goodput, ideal])
        + line_chart("Latency of served requests", "offered requests/s", "ms", [p50, p99])
        + "</div>"
    )


def _run(run: Mapping[str, Any], several: bool) -> str:
    heading = f"At {run['rate_rps']:g} requests/s" if several else "The run"
    lag = run["generator_lag_ms"]
    parts = [
        f"<h2>{escape(heading)}</h2>",
        f'<p class="note">{run["duration_s"]:g} s of arrivals. Generator lag p99 {lag["p99"]} ms, max '
        f"{lag['max']} ms (latency counts from the scheduled send). Jain's index across tenants: "
        f"{run['jain_index']}.</p>",
        _table("By class", run["by_class"]),
        _table("By tenant", run["by_tenant"]),
    ]
    if len(run["by_traffic"]) > 1:
        parts.append(_table("By traffic", run["by_traffic"]))
    parts.append('<div class="charts">' + "".join(_timeline_charts(run)) + "</div>")
    return "".join(parts)


def _table(title: str, groups: Mapping[str, Mapping[str, Any]]) -> str:
    head = "".join(f"<th>{escape(name)}</th>" for name, _, _ in _COLUMNS)
    rows = []
    for group, stats in groups.items():
        cells = "".join(f"<td>{_cell(stats, key, kind)}</td>" for _, key, kind in _COLUMNS)
        rows.append(f"<tr><td>{escape(group)}</td>{cells}</tr>")
    return f"<h3>{escape(title)}</h3><table><tr><th></th>{head}</tr>{''.join(rows)}</table>"


def _cell(stats: Mapping[str, Any], key: str | tuple[str, str], kind: str | None) -> str:
    value = stats[key[0]][key[1]] if isinstance(key, tuple) else stats[key]
    if value is None:
        return "-"
    if kind == "share":
        return f"{100 * value:.1f}%"
    if kind == "reasons":
        return escape(", ".join(f"{reason} {100 * share:.1f}%" for reason, share in value.items()) or "none")
    return escape(f"{value:.1f}" if isinstance(value, float) else str(value))


def _timeline_charts(run: Mapping[str, Any]) -> list[str]:
    rows = run["timeline"]
    t = [row["t_s"] + 0.5 for row in rows]
    outcomes = [
        Series("sent", _points(t, [row["sent"] for row in rows])),
        Series("within deadline", _points(t, [row["within_deadline"] for row in rows])),
        Series("late", _points(t, [row["late"] for row in rows])),
        Series("refused at first", _points(t, [row["refused_first"] for row in rows]), dashed=True),
    ]
    reasons = sorted({reason for row in rows for reason in row["refused"]})
    outcomes += [
        Series(f"refused: {reason}", _points(t, [row["refused"].get(reason, 0) for row in rows]))
        for reason in reasons
    ]
    advice = [
        Series("advised (mean)", _points(t, [row["advised_wait_ms"] for row in rows])),
        Series("waited until served (mean)", _points(t, [row["actual_wait_ms"] for row in rows])),
    ]
    charts = [
        line_chart("Requests per second, by outcome", "seconds (scheduled send)", "requests", outcomes),
        line_chart("Retry-After advised and actual", "seconds (first refusal)", "ms", advice),
    ]
    gateway = [s for s in run["scrapes"] if s["source"] == "gateway" and s["ok"]]
    if gateway:
        names = sorted(
            {name for s in gateway for name in s["values"] if name.startswith("gateway_queue_depth")}
        )
        queued = [
            Series(_queued_label(name), [(s["t_s"], s["values"].get(name)) for s in gateway])
            for name in names
        ]
        inflight = [(s["t_s"], s["values"].get("gateway_inflight_requests")) for s in gateway]
        charts.append(
            line_chart(
                "Queued and in flight (gateway)",
                "seconds",
                "requests",
                [*queued, Series("in flight", inflight)],
            )
        )
    return charts


def _queued_label(name: str) -> str:
    """`gateway_queue_depth{priority=high}` -> `queued high`."""
    return "queued " + name.partition("=")[2].rstrip("}")


def _points(xs: Sequence[float], ys: Sequence[float | None]) -> list[tuple[float, float | None]]:
    return list(zip(xs, ys, strict=True))


def _recommendation(recommended: Mapping[str, Any]) -> str:
    measured = recommended["measured"]
    rows = "".join(
        _row(
            name,
            values["max_wait_ms"],
            values.get("reserved_slots", "-"),
            f"{100 * values['predicted_within_deadline']:.1f}%",
            values["predicted_queue_p99_ms"],
        )
        for name, values in recommended["classes"].items()
    )
    return (
        f"<h2>Recommended for {recommended['target_rate_rps']:g} requests/s</h2>"
        f"<p><b>{recommended['replicas']}</b> backends of {measured['slots_per_backend']} slots (measured "
        f"service {measured['service_mean_ms']} ms mean, {measured['service_p99_ms']} ms p99, cv "
        f"{measured['service_cv']}), at most {100 * recommended['max_utilization']:.0f}% busy, "
        f"{100 * recommended['slo_share']:g}% of each class within its deadline.</p>"
        "<table><tr><th>class</th><th>max_wait_ms</th><th>reserved_slots</th>"
        f"<th>predicted within deadline</th><th>predicted queue p99 ms</th></tr>{rows}</table>"
    )


def _compared(compared: Mapping[str, Any]) -> str:
    rows = "".join(
        _row(
            name,
            _cell(row, "predicted_within_deadline", "share"),
            _cell(row, "measured_within_deadline", "share"),
            _cell(row, "predicted_queue_p99_ms", None),
            _cell(row, "measured_queue_p99_ms", None),
        )
        for name, row in compared["classes"].items()
    )
    return (
        "<h2>Predicted and measured</h2>"
        f"<p>The recommendation for {compared['target_rate_rps']:g} requests/s, beside this run at "
        f"{compared['offered_rps']:g}.</p>"
        "<table><tr><th>class</th><th>predicted within deadline</th><th>measured</th>"
        f"<th>predicted queue p99 ms</th><th>measured</th></tr>{rows}</table>"
    )


def _row(*cells: object) -> str:
    """A table row of text cells (a `_cell`'s numbers and shares hold nothing escaping changes)."""
    return "<tr>" + "".join(f"<td>{escape(str(cell))}</td>" for cell in cells) + "</tr>"
