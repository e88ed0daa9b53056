"""A run's timeline as one inline SVG chart (matplotlib): stacked panels of per-step counters,
constant levels as grey lines, and marked steps, each with a tooltip and a link.

    timeline_svg(timeline, panels, labels, marks, chart_id) -> "<svg ...>...</svg>"

Vector output keeps the page printable and small; no script runs when it is opened. A mark's
tooltip is an SVG ``<title>`` (browsers show it on hover), its link a fragment of the page.
"""

from __future__ import annotations

import html
import io
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from compare.records import Timeline
from compare.render import xml_safe

_WIDTH_IN = 12.0  # scaled to the page's width by CSS; the text keeps these proportions
_PANEL_HEIGHT_IN = 1.35
# fixed margins (inches), not a layout engine, which measures every label of a chart to place its
# panels: a sweep's page draws up to 60 charts
_LEFT_IN, _RIGHT_IN, _TOP_IN, _BOTTOM_IN, _PANEL_GAP_IN = 0.6, 1.5, 0.2, 0.4, 0.15
_MARK_COLOUR = "crimson"
_LEVEL_STYLES = ("--", ":", "-.")
_METADATA = ("Date", "Creator", "Format", "Type")  # none written: no timestamp, no <metadata>
# matplotlib's per-figure group ids ("axes_1"); its referenced ids are hashes, salted per chart
_NUMBERED_ID = re.compile(r' id="([\w.]+_\d+)"')
_STYLE = {
    "svg.fonttype": "none",  # text stays text: smaller, selectable, searchable
    "font.size": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "legend.frameon": False,
}


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
    steps = range(timeline.first_step, timeline.first_step + timeline.num_steps)
    with matplotlib.rc_context({**_STYLE, "svg.hashsalt": chart_id}):
        figure = _figure(len(panels))
        axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        for ax, panel in zip(axes, panels):
            _draw_panel(ax, panel, timeline, steps, labels)
        _draw_marks(axes, marks, chart_id)
        marked = [mark.step for mark in marks]  # a run stopped by a divergence: past its steps
        axes[-1].set_xlim(
            min([steps.start, *marked]), max([steps.stop - 1, *marked, steps.start + 1])
        )
        axes[-1].set_xlabel("step")
        out = io.StringIO()
        figure.savefig(out, format="svg", metadata=dict.fromkeys(_METADATA))
    return _for_the_page(out.getvalue(), marks, chart_id)


def _figure(num_panels: int) -> Figure:
    """An empty figure of ``num_panels`` stacked panels' height, its margins set. Pure."""
    height = _PANEL_HEIGHT_IN * num_panels
    figure = Figure(figsize=(_WIDTH_IN, height))
    figure.subplots_adjust(
        left=_LEFT_IN / _WIDTH_IN, right=1 - _RIGHT_IN / _WIDTH_IN,
        bottom=_BOTTOM_IN / height, top=1 - _TOP_IN / height,
        hspace=_PANEL_GAP_IN / (_PANEL_HEIGHT_IN - _PANEL_GAP_IN),
    )  # fmt: skip
    return figure


def _draw_panel(
    ax: Axes, panel: Panel, timeline: Timeline, steps: range, labels: Mapping[str, str]
) -> None:
    """Counters as step lines (a value holds for its whole step), levels as grey lines. Mutates
    ``ax``."""
    for name in panel.counters:
        if name in timeline.counters:
            values = timeline.counters[name]
            ax.plot(
                steps, values, drawstyle="steps-post", linewidth=1, label=labels.get(name, name)
            )
    for name, style in zip(panel.levels, itertools.cycle(_LEVEL_STYLES)):
        if name in timeline.levels:
            label = labels.get(name, name)
            ax.axhline(timeline.levels[name], color="dimgray", linestyle=style, label=label)
    ax.set_ylabel(panel.title)
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))  # counts: no tick at 0.5
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0))


def _draw_marks(axes: Sequence[Axes], marks: Sequence[Mark], chart_id: str) -> None:
    """A tick per mark across every panel; above the first panel a triangle per mark, its own
    artist (its group gets the tooltip) with the mark's link. Mutates ``axes``."""
    if not marks:
        return
    for ax in axes:
        ax.vlines(
            [mark.step for mark in marks], 0, 1, transform=ax.get_xaxis_transform(),
            colors=_MARK_COLOUR, linewidth=0.8, alpha=0.5,
        )  # fmt: skip
    top = axes[0]
    for index, mark in enumerate(marks):
        [triangle] = top.plot(
            [mark.step], [1.0], marker="v", markersize=7, linestyle="none", color=_MARK_COLOUR,
            transform=top.get_xaxis_transform(), clip_on=False,
        )  # fmt: skip
        triangle.set_gid(_mark_id(chart_id, index))
        triangle.set_url(mark.href)


def _for_the_page(svg: str, marks: Sequence[Mark], chart_id: str) -> str:
    """The ``<svg>`` element alone (no XML prolog or doctype), its numbered group ids prefixed
    with ``chart_id`` (each chart numbers its groups from 1), each mark's group holding its
    ``<title>``, its link opening in the same tab. Pure."""
    svg = _NUMBERED_ID.sub(rf' id="{chart_id}-\1"', svg[svg.index("<svg") :])
    for index, mark in enumerate(marks):
        group = f'<g id="{_mark_id(chart_id, index)}">'
        svg = svg.replace(group, f"{group}<title>{html.escape(xml_safe(mark.tooltip))}</title>", 1)
        link = f'<a xlink:href="{mark.href}"'
        # matplotlib opens every link in a new tab; these jump within the page
        svg = svg.replace(f'{link} target="_blank">', f"{link}>")
    return svg


def _mark_id(chart_id: str, index: int) -> str:
    return f"{chart_id}-mark-{index}"
