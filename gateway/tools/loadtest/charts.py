"""Line charts as inline SVG: a report that renders offline, in any browser, with nothing to load."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 640, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 28, 36
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    points: Sequence[tuple[float, float | None]]
    """(x, y); a None y breaks the line."""
    dashed: bool = False


def nice_max(value: float) -> float:
    """The axis's top: 1, 2, 2.5 or 5 times a power of ten at or above `value`."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if step * power >= value:
            return step * power
    return 10 * power


def line_chart(title: str, x_label: str, y_label: str, series: Sequence[Series]) -> str:
    """An SVG chart of `series` on shared axes from zero, with a legend."""
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points if y is not None]
    x_top = nice_max(max(xs, default=1.0))
    y_top = nice_max(max(ys, default=1.0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return round(LEFT + plot_w * x / x_top, 1)

    def py(y: float) -> float:
        return round(TOP + plot_h * (1 - y / y_top), 1)

    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>',
        f'<text x="{LEFT}" y="16" class="title">{escape(title)}</text>',
    ]
    for tick in range(5):
        y, x = y_top * tick / 4, x_top * tick / 4
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py(y)}" y2="{py(y)}" class="grid"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{py(y)}" class="tick" text-anchor="end">{y:g}</text>')
        parts.append(
            f'<text x="{px(x)}" y="{HEIGHT - BOTTOM + 14}" class="tick" text-anchor="middle">{x:g}</text>'
        )
    middle = TOP + plot_h / 2
    parts.append(
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 4}" class="axis" text-anchor="middle">'
        f"{escape(x_label)}</text>"
    )
    parts.append(
        f'<text x="12" y="{middle}" class="axis" text-anchor="middle" transform="rotate(-90 12 {middle})">'
        f"{escape(y_label)}</text>"
    )
    for index, one in enumerate(series):
        color = COLORS[index % len(COLORS)]
        dash = ' stroke-dasharray="5 4"' if one.dashed else ""
        for run in _runs(one.points):
            if len(run) == 1:
                parts.append(f'<circle cx="{px(run[0][0])}" cy="{py(run[0][1])}" r="2.5" fill="{color}"/>')
                continue
            points = " ".join(f"{px(x)},{py(y)}" for x, y in run)
            parts.append(
                f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.8"{dash}/>'
            )
        legend_y = TOP + 4 + 14 * index
        parts.append(
            f'<rect x="{WIDTH - RIGHT - 150}" y="{legend_y}" width="10" height="10" fill="{color}"/>'
        )
        parts.append(
            f'<text x="{WIDTH - RIGHT - 136}" y="{legend_y + 9}" class="legend">{escape(one.name)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _runs(points: Sequence[tuple[float, float | None]]) -> list[list[tuple[float, float]]]:
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in points:
        if y is None:
            if runs[-1]:
                runs.append([])
            continue
        runs[-1].append((x, y))
    return [run for run in runs if run]
