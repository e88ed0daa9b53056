"""A run's timeline as one inline SVG chart, written by hand: stacked panels of per-step counters,
constant levels as grey lines, and marked steps, each with a tooltip and a link.

    timeline_svg(timeline, panels, labels, marks, chart_id) -> "<svg ...>...</svg>"

The chart is a few dozen elements a panel (a frame, grid lines, tick labels, a polyline per
counter with a vertex only where its value changes, a line per level, a legend), so a page of many
charts renders in milliseconds. Vector output keeps the page printable and small; no script runs
when it is opened, nothing is fetched. A mark's tooltip is an SVG ``<title>`` (browsers show it on
hover), its link a fragment of the page. Same input, same bytes.

Layout, in the viewBox's units (the page's CSS scales the chart to its width)::

    | y label | y ticks | plot area (the panel's frame)             | legend |
                          ^ mark triangles above the first panel
                          | ... one panel per Panel, stacked, sharing the x axis ...
                          x ticks and "step" under the last panel
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from compare.records import Timeline
from compare.render import xml_safe

_WIDTH = 1200  # the viewBox's width; text sizes below are in the same units
_FONT_SIZE = 11
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 170, 14, 36  # margins around the stacked plot areas
_PLOT_WIDTH = _WIDTH - _LEFT - _RIGHT
_PANEL_HEIGHT, _PANEL_GAP = 120, 18
_LEGEND_ROW = 15
_Y_INTERVALS, _X_INTERVALS = 4, 10  # at most this many tick intervals on each axis
_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
_LEVEL_DASHES = ("6 3", "1.5 2.5", "6 2.5 1.5 2.5")  # dashed, dotted, dash-dot
_LEVEL_COLOUR, _GRID_COLOUR, _FRAME_COLOUR, _TEXT_COLOUR = "dimgray", "#e4e4e4", "#999", "#333"
_MARK_COLOUR = "crimson"


@dataclass(frozen=True, slots=True)
class Panel:
    """One panel of the chart: its counters as lines, its levels as grey lines."""

    title: str  # the y axis label
    counters: tuple[str, ...]
    levels: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Mark:
    """A marked step: a red tick across every panel and a triangle above the first one."""

    step: int
    tooltip: str  # plain text (anyone's: it is escaped)
    href: str  # where a click goes, e.g. "#d-0-3" (a trusted id, not escaped)


@dataclass(frozen=True, slots=True)
class _Frame:
    """A panel's plot area in the viewBox and the data ranges it spans (x: steps, y: values; the
    y axis from its first tick to its last)."""

    top: float
    x_range: tuple[int, int]
    y_ticks: tuple[int, ...]

    @property
    def y_range(self) -> tuple[int, int]:
        return self.y_ticks[0], self.y_ticks[-1]

    def x(self, step: float) -> float:
        low, high = self.x_range
        return _LEFT + (step - low) / (high - low) * _PLOT_WIDTH

    def y(self, value: float) -> float:
        low, high = self.y_range
        return self.top + _PANEL_HEIGHT - (value - low) / (high - low) * _PANEL_HEIGHT

    def data_transform(self) -> str:
        """The SVG transform drawing (step, value) points where ``x`` and ``y`` place them."""
        x_scale = _PLOT_WIDTH / (self.x_range[1] - self.x_range[0])
        y_scale = _PANEL_HEIGHT / (self.y_range[1] - self.y_range[0])
        return f"matrix({x_scale:.6g} 0 0 {-y_scale:.6g} {self.x(0):.6g} {self.y(0):.6g})"


def timeline_svg(
    timeline: Timeline,
    panels: Sequence[Panel],
    labels: Mapping[str, str],
    marks: Sequence[Mark],
    chart_id: str,
) -> str:
    """The chart as an ``<svg>`` element to inline in a page. ``labels``: counter or level name ->
    legend label (the name when absent); counters and levels the timeline lacks are left out.
    ``chart_id`` must be unique in the page: every id in the SVG derives from it. Pure."""
    x_range = chart_x_range(timeline, marks)
    height = _TOP + len(panels) * (_PANEL_HEIGHT + _PANEL_GAP) - _PANEL_GAP + _BOTTOM
    frames = []
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink"'
        f' viewBox="0 0 {_WIDTH} {height}" width="100%" font-family="system-ui, sans-serif"'
        f' font-size="{_FONT_SIZE}" fill="{_TEXT_COLOUR}">'
    ]
    for index, panel in enumerate(panels):
        top = _TOP + index * (_PANEL_HEIGHT + _PANEL_GAP)
        frame = _Frame(top, x_range, _panel_y_ticks(panel, timeline))
        frames.append(frame)
        parts += _axes_svg(frame, panel.title)
        parts += _series_svg(frame, panel, timeline, labels)
    if frames:
        parts += _x_axis_svg(frames[-1])
        parts += _marks_svg(frames, marks, chart_id)
    parts.append("</svg>")
    return "\n".join(parts)


def chart_x_range(timeline: Timeline, marks: Sequence[Mark]) -> tuple[int, int]:
    """The steps the x axis spans: from the first step to the end of the last one (its value
    holds for the whole step), widened to every marked step (a run stopped by a divergence is
    marked past its steps), at least one step wide. Pure."""
    marked = [mark.step for mark in marks]
    end = timeline.first_step + max(timeline.num_steps, 1)
    return min([timeline.first_step, *marked]), max([end, *marked])


def step_corners(first_step: int, values: Sequence[int]) -> list[tuple[int, int]]:
    """The (step, value) corners of ``values`` drawn as a step line from ``first_step`` on, each
    value held for its whole step: the first point, two where the value changes (the old value,
    then the new one, at the step of the change), and the end of the last step. Pure."""
    if not values:
        return []
    corners = [(first_step, values[0])]
    for step, (before, value) in enumerate(pairwise(values), first_step + 1):
        if value != before:
            corners += [(step, before), (step, value)]
    corners.append((first_step + len(values), values[-1]))
    return corners


def y_ticks(low: int, high: int) -> list[int]:
    """Integer ticks from ``low`` rounded down to ``high`` rounded up, at most four intervals of a
    round size (1, 2, 2.5 or 5 times a power of ten; counts never get 0.5), at least one. With
    ``low`` 0 they start at 0. The first and last are the y axis's ends. Pure."""
    step = nice_step(high - low, _Y_INTERVALS)
    start, stop = math.floor(low / step) * step, math.ceil(high / step) * step
    return list(range(start, max(stop, start + step) + 1, step))


def x_ticks(low: int, high: int) -> list[int]:
    """The multiples of a round step in ``low`` .. ``high``, at most ten intervals. Pure."""
    step = nice_step(high - low, _X_INTERVALS)
    return list(range(math.ceil(low / step) * step, high + 1, step))


def nice_step(span: int, max_intervals: int) -> int:
    """The smallest integer step of 1, 2, 2.5 or 5 times a power of ten that cuts ``span`` into at
    most ``max_intervals`` intervals (1 for a span of 0). Pure."""
    power = 1
    while True:
        for factor in (1, 2, 2.5, 5):
            step = factor * power
            if step == int(step) and span <= step * max_intervals:
                return int(step)
        power *= 10


def _panel_y_ticks(panel: Panel, timeline: Timeline) -> tuple[int, ...]:
    """The panel's y ticks: around 0 and every value it draws. Pure."""
    values = [0]
    for name in panel.counters:
        values += timeline.counters.get(name, ())
    values += [timeline.levels[name] for name in panel.levels if name in timeline.levels]
    return tuple(y_ticks(min(values), max(values)))


def _axes_svg(frame: _Frame, title: str) -> list[str]:
    """A panel's light grid, its frame, its y tick labels and its title (the y label, rotated).
    Pure."""
    left, right, bottom = _LEFT, _LEFT + _PLOT_WIDTH, _n(frame.top + _PANEL_HEIGHT)
    parts = [f'<g stroke="{_GRID_COLOUR}">']
    for step in x_ticks(*frame.x_range):
        x = _n(frame.x(step))
        parts.append(f'<line x1="{x}" y1="{_n(frame.top)}" x2="{x}" y2="{bottom}"/>')
    for value in frame.y_ticks:
        y = _n(frame.y(value))
        parts.append(f'<line x1="{left}" y1="{y}" x2="{right}" y2="{y}"/>')
    parts.append("</g>")
    parts.append(
        f'<rect x="{left}" y="{_n(frame.top)}" width="{_PLOT_WIDTH}" height="{_PANEL_HEIGHT}"'
        f' fill="none" stroke="{_FRAME_COLOUR}"/>'
    )
    for value in frame.y_ticks:
        y = _n(frame.y(value))
        parts.append(f'<text x="{left - 5}" y="{y}" dy="0.35em" text-anchor="end">{value}</text>')
    middle = _n(frame.top + _PANEL_HEIGHT / 2)
    parts.append(
        f'<text x="16" y="{middle}" text-anchor="middle" transform="rotate(-90 16 {middle})">'
        f"{_text(title)}</text>"
    )
    return parts


def _series_svg(
    frame: _Frame, panel: Panel, timeline: Timeline, labels: Mapping[str, str]
) -> list[str]:
    """The panel's counters as step lines, one palette colour each, then its levels as grey
    dashed lines across the panel, each with a legend row; those the timeline lacks are left
    out. Pure."""
    lines, levels, legend = [], [], []  # legend: (label, style) per row
    counters = [name for name in panel.counters if name in timeline.counters]
    for name, colour in zip(counters, itertools.cycle(_PALETTE)):
        corners = step_corners(timeline.first_step, timeline.counters[name])
        points = " ".join(f"{step},{value}" for step, value in corners)
        style = f'stroke="{colour}" stroke-width="1.3"'
        # the vertices in data units (steps, values), the stroke's width in the viewBox's
        lines.append(
            f'<polyline points="{points}" fill="none" {style} vector-effect="non-scaling-stroke"/>'
        )
        legend.append((labels.get(name, name), style))
    for name, dashes in zip(panel.levels, itertools.cycle(_LEVEL_DASHES)):
        if name in timeline.levels:
            y = _n(frame.y(timeline.levels[name]))
            style = f'stroke="{_LEVEL_COLOUR}" stroke-width="1.2" stroke-dasharray="{dashes}"'
            levels.append(
                f'<line x1="{_LEFT}" y1="{y}" x2="{_LEFT + _PLOT_WIDTH}" y2="{y}" {style}/>'
            )
            legend.append((labels.get(name, name), style))
    rows = [_legend_row(frame, row, style, label) for row, (label, style) in enumerate(legend)]
    return [f'<g transform="{frame.data_transform()}">', *lines, "</g>", *levels, *rows]


def _legend_row(frame: _Frame, row: int, style: str, label: str) -> str:
    """Legend row ``row`` of a panel: a swatch drawn in ``style`` and its label. Pure."""
    x, y = _LEFT + _PLOT_WIDTH + 12, _n(frame.top + 8 + row * _LEGEND_ROW)
    return (
        f'<line x1="{x}" y1="{y}" x2="{x + 20}" y2="{y}" {style}/>'
        f'<text x="{x + 26}" y="{y}" dy="0.35em">{_text(label)}</text>'
    )


def _x_axis_svg(frame: _Frame) -> list[str]:
    """The x tick labels under the last panel and the axis label "step". Pure."""
    y = frame.top + _PANEL_HEIGHT + 14
    parts = [
        f'<text x="{_n(frame.x(step))}" y="{_n(y)}" text-anchor="middle">{step}</text>'
        for step in x_ticks(*frame.x_range)
    ]
    middle = _n(_LEFT + _PLOT_WIDTH / 2)
    parts.append(f'<text x="{middle}" y="{_n(y + 16)}" text-anchor="middle">step</text>')
    return parts


def _marks_svg(frames: Sequence[_Frame], marks: Sequence[Mark], chart_id: str) -> list[str]:
    """A thin line per mark across every panel; above the first panel a triangle per mark in its
    own group (``{chart_id}-mark-{index}``) holding the tooltip and the mark's link. Pure."""
    if not marks:
        return []
    parts = [f'<g stroke="{_MARK_COLOUR}" stroke-opacity="0.5">']
    for frame in frames:
        parts += [
            f'<line x1="{_n(frame.x(m.step))}" y1="{_n(frame.top)}" x2="{_n(frame.x(m.step))}"'
            f' y2="{_n(frame.top + _PANEL_HEIGHT)}"/>'
            for m in marks
        ]
    parts.append("</g>")
    top = frames[0].top
    for index, mark in enumerate(marks):
        x = frames[0].x(mark.step)
        corners = f"{_n(x - 4.5)},{_n(top - 9)} {_n(x + 4.5)},{_n(top - 9)} {_n(x)},{_n(top)}"
        parts.append(
            f'<g id="{chart_id}-mark-{index}"><title>{_text(mark.tooltip)}</title>'
            f'<a xlink:href="{mark.href}"><polygon points="{corners}" fill="{_MARK_COLOUR}"/></a>'
            "</g>"
        )
    return parts


def _text(text: str) -> str:
    """``text`` (anyone's) as SVG character data: markup escaped, what XML cannot hold written
    as its escape. Pure."""
    return html.escape(xml_safe(text))


def _n(number: float) -> str:
    """A coordinate, compactly: one decimal (a tenth of a unit is below a pixel). Pure."""
    return f"{number:.1f}"
