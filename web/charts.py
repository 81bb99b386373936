"""Server-rendered SVG bar charts: geometry computed here, drawn by web/_bar_chart.html.

The chart is a plot of HEIGHT × (WIDTH - LEFT - RIGHT) user units with a value axis on its left
(gridlines at round values, each labelled) and a date axis under it (at most X_TICKS
labels, the first and the last always among them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

WIDTH = 900  # the whole drawing, axes included (about its width on a desktop page: labels read at their size)
HEIGHT = 120  # the plot's height: bars stand on its baseline
LEFT = 104  # room for the value axis's labels (money is written exactly: "$0.0000123")
TOP = 10  # room above the top gridline's label
BOTTOM = 24  # room for the date axis's labels
RIGHT = 28  # room for half of the last date's label
Y_TICKS = 4  # gridlines above zero
X_TICKS = 6


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    label: str
    title: str


@dataclass(frozen=True)
class Tick:
    at: float  # y of a value gridline, x of a date label
    label: str


@dataclass(frozen=True)
class BarChart:
    title: str
    width: int
    height: int  # of the whole drawing
    left: int  # where the plot starts (the value axis)
    right: int  # where it ends
    top: int
    baseline: float  # y of the value axis's zero: bars stand on it
    bars: list[Bar]
    y_ticks: list[Tick]
    x_ticks: list[Tick]
    peak: str
    first_label: str
    last_label: str


def nice_ceiling(value: int) -> int:
    """The smallest 1, 2, 2.5 or 5 × 10ⁿ that is at least `value` and divides into Y_TICKS
    steps of whole units (a value axis of round numbers)."""
    if value <= 0:
        return Y_TICKS
    magnitude = 1
    while True:
        for step in (1, 2, 2.5, 5):
            gap = Decimal(str(step)) * magnitude
            if gap * Y_TICKS >= value and gap == gap.to_integral_value():
                return int(gap * Y_TICKS)
        magnitude *= 10


def bar_chart(*, title: str, points: list[tuple[str, int]], fmt: Callable[[int], str] = str) -> BarChart:
    """One bar per (label, value) on a value axis from zero to a round number at or above the
    largest value; `fmt` renders values for the axis and the tooltips."""
    peak = max((value for _, value in points), default=0)
    top_value = nice_ceiling(peak)
    plot_width = WIDTH - LEFT - RIGHT
    slot = plot_width / max(len(points), 1)
    baseline = TOP + HEIGHT
    bars = []
    for index, (label, value) in enumerate(points):
        height = HEIGHT * value / top_value
        bars.append(
            Bar(
                x=round(LEFT + index * slot + slot * 0.1, 2),
                y=round(baseline - height, 2),
                width=round(slot * 0.8, 2),
                height=round(height, 2),
                label=label,
                title=f"{label}: {fmt(value)}",
            )
        )
    y_ticks = [
        Tick(at=round(baseline - HEIGHT * n / Y_TICKS, 2), label=fmt(top_value * n // Y_TICKS))
        for n in range(Y_TICKS + 1)
    ]
    return BarChart(
        title=title,
        width=WIDTH,
        height=TOP + HEIGHT + BOTTOM,
        left=LEFT,
        right=WIDTH - RIGHT,
        top=TOP,
        baseline=baseline,
        bars=bars,
        y_ticks=y_ticks,
        x_ticks=_date_ticks(points, slot),
        peak=fmt(peak),
        first_label=points[0][0] if points else "",
        last_label=points[-1][0] if points else "",
    )


def _date_ticks(points: list[tuple[str, int]], slot: float) -> list[Tick]:
    """At most X_TICKS labels under the bars, evenly spread, the first and last included."""
    if not points:
        return []
    every = max(1, -(-(len(points) - 1) // (X_TICKS - 1)))
    indexes = sorted({*range(0, len(points), every), len(points) - 1})
    if len(indexes) > 1 and indexes[-1] - indexes[-2] < every / 2:  # the last would crowd its neighbour
        indexes.pop(-2)
    return [Tick(at=round(LEFT + index * slot + slot / 2, 2), label=_short(points[index][0])) for index in indexes]


def _short(label: str) -> str:
    """An ISO date without its year ("12-03"): the range above the chart says which year."""
    return label[5:] if len(label) == 10 and label[4] == "-" and label[7] == "-" else label
