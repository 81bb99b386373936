"""Server-rendered SVG bar charts: geometry computed here, drawn by web/_bar_chart.html."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

WIDTH = 600
HEIGHT = 160


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    label: str
    title: str


@dataclass(frozen=True)
class BarChart:
    title: str
    width: int
    bars: list[Bar]
    peak: str
    first_label: str
    last_label: str
    baseline: int  # the plot's height: bars stand on it


def bar_chart(*, title: str, points: list[tuple[str, int]], fmt: Callable[[int], str] = str) -> BarChart:
    """One bar per (label, value), scaled so the largest value fills the plot; `fmt` renders values for tooltips."""
    plot = HEIGHT
    peak = max((value for _, value in points), default=0)
    slot = WIDTH / max(len(points), 1)
    bars = []
    for index, (label, value) in enumerate(points):
        height = plot * value / peak if peak else 0
        bars.append(
            Bar(
                x=round(index * slot + slot * 0.1, 2),
                y=round(plot - height, 2),
                width=round(slot * 0.8, 2),
                height=round(height, 2),
                label=label,
                title=f"{label}: {fmt(value)}",
            )
        )
    return BarChart(
        title=title,
        width=WIDTH,
        bars=bars,
        peak=fmt(peak),
        first_label=points[0][0] if points else "",
        last_label=points[-1][0] if points else "",
        baseline=plot,
    )
