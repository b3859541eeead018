"""The geometry of the overview's charts: numbers in, rectangles out; the template draws
them as inline SVG (no script, nothing fetched). Text stays text: the template escapes it.

Coordinates are in the SVG's viewBox units; the SVG scales to its container's width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ledger.selectors.charts import (
    AGE_BUCKETS,
    KIND_LABELS,
    WAITING_KINDS,
    AgeDistribution,
    UnknownOutcomeRates,
)

# Narrow on purpose: the SVG scales to its column (at most 480 px wide, desk.css), and at
# a phone's 360 px a 420-unit viewBox keeps 13-unit labels above 11 px.
WIDTH = 420
LABEL_WIDTH = 120  # room for the row labels on the left
VALUE_WIDTH = 120  # room for the figures on the right
ROW_HEIGHT = 26
BAR_HEIGHT = 16
TOP = 8
NAME_CHARS = 15  # an operation name longer than this is shortened (the full one in <title>)


@dataclass
class Segment:
    x: float
    width: float
    kind: str
    label: str
    count: int


@dataclass
class Row:
    label: str
    y: float
    total: int = 0
    segments: list[Segment] = field(default_factory=list)
    title: str = ""
    value: str = ""
    bar_width: float = 0.0

    @property
    def bar_y(self) -> float:
        return self.y + (ROW_HEIGHT - BAR_HEIGHT) / 2

    @property
    def text_y(self) -> float:
        return self.y + ROW_HEIGHT / 2 + 4


@dataclass
class Chart:
    rows: list[Row]
    height: float
    width: int = WIDTH
    label_width: int = LABEL_WIDTH
    bar_height: int = BAR_HEIGHT
    plot_width: float = WIDTH - LABEL_WIDTH - VALUE_WIDTH
    legend: list[tuple[str, str]] = field(default_factory=list)

    @property
    def value_x(self) -> float:
        return self.label_width + self.plot_width + 6


def _height(rows: int) -> float:
    return TOP * 2 + rows * ROW_HEIGHT


def age_chart(dist: AgeDistribution) -> Chart:
    """One row per age bucket, a bar stacked by kind of waiting item; bars share one
    scale (the fullest bucket spans the plot)."""
    totals = {key: sum(dist.count(kind, key) for kind in WAITING_KINDS)
              for key, _, _ in AGE_BUCKETS}
    scale_max = max(totals.values(), default=0) or 1
    chart = Chart(rows=[], height=_height(len(AGE_BUCKETS)),
                  legend=[(kind, KIND_LABELS[kind]) for kind in WAITING_KINDS])
    for index, (key, label, _) in enumerate(AGE_BUCKETS):
        row = Row(label=label, y=TOP + index * ROW_HEIGHT, total=totals[key],
                  value=str(totals[key]))
        x = float(chart.label_width)
        for kind in WAITING_KINDS:
            count = dist.count(kind, key)
            if not count:
                continue
            width = round(chart.plot_width * count / scale_max, 1)
            row.segments.append(Segment(x=round(x, 1), width=width, kind=kind,
                                        label=KIND_LABELS[kind], count=count))
            x += width
        chart.rows.append(row)
    return chart


def rate_chart(rates: UnknownOutcomeRates) -> Chart:
    """One row per operation name, a bar of its unknown-outcome rate on a 0–100 % scale."""
    chart = Chart(rows=[], height=_height(max(len(rates.rows), 1)))
    for index, rate in enumerate(rates.rows):
        name = rate.operation
        short = name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"
        percent = round(100 * rate.rate)
        chart.rows.append(Row(
            label=short, title=name, y=TOP + index * ROW_HEIGHT, total=rate.unknown,
            value=f"{percent} % ({rate.unknown}/{rate.submitted})",
            bar_width=round(chart.plot_width * min(rate.rate, 1.0), 1),
        ))
    return chart
