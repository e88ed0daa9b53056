"""The report as one self-contained HTML page: per run, a timeline chart with its divergences
marked and listed, each with both sides' values; then divergences by field path and decision
coverage, as the text report.

    render_html(report, logs, binding) -> "<!DOCTYPE html>..."

Self-contained: styles inline, charts inline SVG (``compare.charts``), no script, nothing
fetched when it is opened; it reads at 1280 px and prints. Every string from a log (ids,
workload names, field paths, log paths) is escaped: a log is anyone's input. The page is also
well-formed XML, so tools (and tests) can parse it with any XML parser.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import NamedTuple

from compare.charts import Mark, Panel, timeline_svg
from compare.explain import explain_record, row_lines
from compare.html_cells import code, escape, num, table, td, tr
from compare.records import DivergenceRecord, LogRecord, RunSummary
from compare.report import Report
from compare.wording import (
    coverage_line,
    coverage_note,
    first_reached,
    headline,
    overhead_line,
    plural,
    rate,
    sample_lines,
    step_range,
)

MAX_LISTED = 50  # divergences listed per run (every one is marked on its chart)
MAX_TOOLTIP = 3  # divergences a mark's tooltip details; it counts the rest
MAX_ROWS = 4  # rows of values (compare.explain) shown per divergence
# runs charted on one page, diverging ones first: a sweep's thousands would make it unreadable
MAX_CHARTED = 60


@dataclass(frozen=True, slots=True)
class PageBinding:
    """What a binding's page shows: which timeline counters go in which panel, their labels, and
    the command that replays one logged divergence."""

    title: str
    # the chart of each run, top to bottom; None: a panel per counter the run's timeline has
    panels: tuple[Panel, ...] | None
    labels: Mapping[str, str]  # counter or level name -> legend label (default: its name)
    # the command replaying one divergence ("{log}" and "{index}" are filled in); None: none
    replay: str | None

    @classmethod
    def plain(cls, binding: str) -> PageBinding:
        """The page of a binding that declares none: its name, its runs' counters as they are,
        no replay command. Pure."""
        return cls(f"{binding} compare report", None, {}, None)


class _Listed(NamedTuple):
    """A divergence as the page lists it."""

    record: DivergenceRecord
    row_id: str  # its row in the run's table, where its mark links to
    command: str | None  # the command that replays it (None: the binding has none)


@dataclass(slots=True)
class _Run:
    """One run of the logs, as the page lists it (local to one render)."""

    summary: RunSummary | None  # None: the run never ended
    workload: str
    divergences: list[_Listed] = field(default_factory=list)


def render_html(
    report: Report,
    logs: Sequence[tuple[str, Sequence[LogRecord]]],
    binding: PageBinding,
) -> str:
    """The page of ``report``, aggregated from ``logs`` (each: its path, as the replay command
    names it, and its records in log order). Pure."""
    runs = _runs(logs, binding)
    charted = _charted(runs)
    body = [
        f"<h1>{escape(binding.title)}</h1>",
        f'<p id="headline" class="{"bad" if report.num_divergences else ""}">'
        f"{escape(headline(report))}</p>",
        f'<p id="coverage-line">{escape(coverage_line(report))}</p>',
        f'<p id="overhead">{escape(overhead_line(report))}</p>',
        f'<p id="aa">{escape(_aa_line(runs))}</p>',
        _ops_table(report),
        "<h2>Runs</h2>",
        *(_run_section(index, runs[index], binding) for index in charted),
        _uncharted_line(len(runs) - len(charted)),
        "<h2>Divergences by field path</h2>",
        _paths_table(report) if report.paths else "<p>No divergence.</p>",
        "<h2>Decision coverage</h2>",
        _coverage_table(report),
        f'<p class="meta">Logs: {escape(", ".join(path for path, _ in logs))}</p>',
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"/>'
        '<meta name="viewport" content="width=device-width, initial-scale=1"/>'
        f"<title>{escape(binding.title)}</title><style>{_css()}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _runs(logs: Sequence[tuple[str, Sequence[LogRecord]]], binding: PageBinding) -> list[_Run]:
    """Every run of ``logs`` in the order it first logged, its divergences with their row ids
    and replay commands (indexes count a log's divergence records from 0). Pure."""
    runs: dict[tuple[int, str], _Run] = {}
    for log_index, (path, records) in enumerate(logs):
        index = 0  # of the log's next divergence record
        for record in records:
            run = runs.setdefault((log_index, record.run_id), _Run(None, record.workload))
            if isinstance(record, RunSummary):
                run.summary = record
                continue
            if not isinstance(record, DivergenceRecord):  # a sample rate change
                continue
            command = binding.replay and binding.replay.format(log=shlex.quote(path), index=index)
            run.divergences.append(_Listed(record, f"d-{log_index}-{index}", command))
            index += 1
    return list(runs.values())


def _charted(runs: Sequence[_Run]) -> list[int]:
    """The indexes of the runs charted, in log order: the diverging or unended ones first, then
    the rest, ``MAX_CHARTED`` in all. Pure."""
    flagged = [i for i, run in enumerate(runs) if run.divergences or run.summary is None]
    clean = [i for i, run in enumerate(runs) if not (run.divergences or run.summary is None)]
    return sorted((flagged + clean)[:MAX_CHARTED])


def _uncharted_line(num_uncharted: int) -> str:
    if not num_uncharted:
        return ""
    return (
        f'<p id="uncharted" class="meta">{plural(num_uncharted, "more run")} without a divergence'
        f" not charted (at most {MAX_CHARTED} charts a page); the tables count every run</p>"
    )


def _css() -> str:
    return resources.files("compare").joinpath("report.css").read_text(encoding="utf-8")


def _aa_line(runs: Sequence[_Run]) -> str:
    """The A/A noise check: divergences where the shadow ran the authoritative path itself."""
    aa = [r.summary for r in runs if r.summary and r.summary.shadow == r.summary.authoritative]
    if not aa:
        return "A/A noise check: no A/A run (shadow path = authoritative path) in these logs"
    diverged = sum(sum(summary.divergences.values()) for summary in aa)
    compared = sum(sum(summary.steps_compared.values()) for summary in aa)
    verdict = "clean" if not diverged else "NOISE: the harness differs from itself"
    return (
        f"A/A noise check: {plural(diverged, 'divergence')} in {plural(compared, 'compared op')}"
        f" over {plural(len(aa), 'A/A run')} ({verdict})"
    )


def _run_section(index: int, run: _Run, binding: PageBinding) -> str:
    """A run's heading, counts, chart and divergences. Pure."""
    summary = run.summary
    parts = [f'<section class="run" id="run-{index}"><h3>{escape(run.workload)}</h3>']
    if summary is None:
        parts.append('<p class="bad">No run summary: the run did not end.</p>')
    else:
        parts += _run_lines(summary)
    if summary is not None and summary.timeline is not None:
        marks = _marks(run.divergences)
        panels = binding.panels or tuple(Panel(name, (name,)) for name in summary.timeline.counters)
        svg = timeline_svg(summary.timeline, panels, binding.labels, marks, f"c{index}")
        parts.append(f'<figure class="chart">{svg}</figure>')
    else:
        parts.append('<p class="meta">No timeline recorded.</p>')
    if run.divergences:
        parts.append(_divergence_table(run.divergences, binding.replay is not None))
    return "\n".join(parts) + "</section>"


def _run_lines(summary: RunSummary) -> list[str]:
    """Who ran what; divergences, compared ops and overhead; why it stopped early. Pure."""
    aa = " (A/A noise check)" if summary.shadow == summary.authoritative else ""
    meta = (
        f"run {summary.run_id}, seed {summary.seed}: authoritative {summary.authoritative}, "
        f"shadow {summary.shadow}{aa}; {plural(summary.harness_errors, 'harness error')}"
    )
    diverged = sum(summary.divergences.values())
    counts = (
        f"{plural(diverged, 'divergence')} in "
        f"{plural(sum(summary.steps_compared.values()), 'compared op')}"
    )
    if summary.authoritative_seconds > 0:
        ratio = summary.compare_seconds / summary.authoritative_seconds
        counts += (
            f"; compare overhead {summary.compare_seconds:.3g} s on "
            f"{summary.authoritative_seconds:.3g} s authoritative ({ratio:.2f}x)"
        )
    bad = ' class="bad"' if diverged or summary.harness_errors else ""
    lines = [f'<p class="meta">{escape(meta)}</p>', f"<p{bad}>{escape(counts)}</p>"]
    if summary.stopped_by:
        lines.append(f'<p class="bad">Stopped early: {escape(summary.stopped_by)}</p>')
    return lines


def _marks(divergences: Sequence[_Listed]) -> list[Mark]:
    """One mark per step that diverged: its tooltip details the step's first divergences, its
    link goes to the first one's row. Pure."""
    by_step: dict[int, list[_Listed]] = {}
    for listed in divergences:
        by_step.setdefault(listed.record.step, []).append(listed)
    marks = []
    for step, at_step in sorted(by_step.items()):
        lines = [f"step {step}: {plural(len(at_step), 'divergence')}"]
        for record, _, command in at_step[:MAX_TOOLTIP]:
            lines += [f"{record.op} {record.kind}:", *(f"    {row}" for row in _rows(record))]
            lines += [f"  {command}"] if command else []
        if len(at_step) > MAX_TOOLTIP:
            lines.append(f"... and {len(at_step) - MAX_TOOLTIP} more (listed below)")
        marks.append(Mark(step, "\n".join(lines), f"#{at_step[0].row_id}"))
    return marks


def _ops_table(report: Report) -> str:
    rows = [
        tr(td(escape(s.op)), num(s.num_compared), num(s.num_divergences),
            num(rate(s.num_divergences, s.num_compared)))
        for s in report.ops
    ]  # fmt: skip
    return table("ops", ("op", "compared", "divergences", "rate"), rows)


def _divergence_table(divergences: Sequence[_Listed], replayable: bool) -> str:
    """The run's first divergences, each with its replay command when ``replayable``. Pure."""
    rows = [
        tr(num(record.step), td(escape(record.op)), td(escape(record.kind)),
            _code_lines(_rows(record)), code(command) if replayable else "", row_id=row_id)
        for record, row_id, command in divergences[:MAX_LISTED]
    ]  # fmt: skip
    columns = ("step", "op", "kind", "field paths and values", *(("replay",) * replayable))
    listed = table("", columns, rows)
    more = len(divergences) - MAX_LISTED
    return listed + (f"<p>... and {more} more divergences in the log.</p>" if more > 0 else "")


def _rows(record: DivergenceRecord) -> list[str]:
    """The record's first rows, each field path with both sides' values, or its exception when
    none differ. Pure."""
    return row_lines(explain_record(record), MAX_ROWS)


def _code_lines(lines: list[str], note: str = "") -> str:
    """A cell holding ``lines`` as code, one per line, then ``note`` as text. Pure."""
    coded = "<br/>".join(f"<code>{escape(line)}</code>" for line in lines)
    return td(coded + (f" {escape(note)}" if note else ""))


def _coverage_table(report: Report) -> str:
    """The coverage rows, those a run should have reached and did not highlighted. Pure."""
    if not report.coverage:
        return "<p>No decision outcome recorded.</p>"
    rows = []
    for row in report.coverage:
        unreached, unexpected = row.required and not row.count, row.count and not row.required
        rows.append(tr(
            code(row.outcome), td(escape(row.op)), num(row.count), num(row.num_runs),
            td(escape(first_reached(row))), td(escape(coverage_note(row))),
            td(escape(row.unreachable or row.meaning)),
            row_class="unreached" if unreached else "unexpected" if unexpected else "",
        ))  # fmt: skip
    columns = ("outcome", "op", "count", "runs", "first reached", "note", "meaning")
    return table("coverage", columns, rows)


def _paths_table(report: Report) -> str:
    rows = []
    for stats in report.paths:
        *lines, where = sample_lines(stats.samples[0])
        example = _code_lines(lines, where)
        rows.append(tr(
            td(escape(stats.op)), code(stats.path), num(stats.count), num(step_range(stats)),
            td(escape(", ".join(stats.workloads))), td(escape(", ".join(stats.kinds))), example,
        ))  # fmt: skip
    columns = ("op", "field path", "count", "steps", "workloads", "kinds", "first divergence")
    return table("paths", columns, rows)
