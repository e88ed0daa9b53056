"""A report for people and for CI: plain text, GitHub markdown, JUnit XML, JSON.

Every renderer is pure and returns a string (write it with ``compare.sink.write_atomic``). Ids
and paths come from logs, anyone's strings: text escapes control characters, markdown escapes
table syntax, JUnit escapes what XML cannot hold. The lines every format shares are worded by
``compare.wording``.
"""

from __future__ import annotations

import io
import json
import re
import xml.etree.ElementTree as ET
from dataclasses import asdict

from rich.console import Console
from rich.table import Table
from rich.text import Text

from compare.explain import Row
from compare.report import PairStats, PathSample, Report
from compare.wording import (
    coverage_line,
    coverage_note,
    data_line,
    first_reached,
    headline,
    overhead_line,
    plural,
    rate,
    sample_lines,
    step_range,
)

_TOP_PATHS = 5  # field paths listed per JUnit failure
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")  # not in XML 1.0
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # what a terminal acts on (not \t, \n)


# ---- text ----------------------------------------------------------------------------------
def render_text(report: Report, *, width: int = 120) -> str:
    """The report as plain-text rich tables (for terminals and CI logs)."""
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False)
    for line in (headline(report), coverage_line(report), data_line(report), overhead_line(report)):
        if line is not None:
            console.print(_terminal(line))
    console.print(
        _table(
            "By op",
            ("op", "compared", "divergences", "rate"),
            [
                (
                    s.op,
                    str(s.num_compared),
                    str(s.num_divergences),
                    rate(s.num_divergences, s.num_compared),
                )
                for s in report.ops
            ],
        )  # fmt: skip
    )
    if report.paths:
        columns = ("op", "field path", "count", "steps", "workloads", "kinds", "first divergence")
        rows = [
            (s.op, s.path, str(s.count), step_range(s), ", ".join(s.workloads), ", ".join(s.kinds),
             _stacked(s.samples[0]))
            for s in report.paths
        ]  # fmt: skip
        console.print(_table("By field path", columns, rows))
    if report.coverage:
        columns = ("outcome", "count", "runs", "first reached", "note")
        rows = [
            (r.outcome, str(r.count), str(r.num_runs), first_reached(r), coverage_note(r))
            for r in report.coverage
        ]
        console.print(_table("Decision coverage", columns, rows))
    return out.getvalue()


def _stacked(sample: PathSample) -> str:
    """An example divergence for a narrow cell: each row's path (the first with where it was),
    then each side's value on a line of its own. Pure."""
    lines = []
    for row in sample.rows or [Row(sample.path, ())]:
        where = "" if lines else f" ({sample.workload} step {sample.step})"
        lines += [row.path + where, *(f"  {name}: {value}" for name, value in row.values)]
    if sample.more_rows:
        lines.append(f"(+{sample.more_rows} more)")
    return "\n".join(lines)


def _table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    """A rich table; columns holding counts are right-aligned, every cell escaped. Pure."""
    table = Table(title=title)
    numeric = {"compared", "divergences", "rate", "count", "runs"}
    for column in columns:
        table.add_column(column, justify="right" if column in numeric else "left")
    for row in rows:
        table.add_row(*map(_terminal, row))
    return table


def _terminal(text: str) -> Text:
    """``text`` for a terminal: plain (no rich markup), each control character written as its
    escape (``\\x1b``), so ids from a log cannot move the cursor or recolour the screen."""
    return Text(_CONTROL.sub(_escaped, text))


def _escaped(match: re.Match) -> str:
    return match.group().encode("unicode_escape").decode("ascii")


# ---- markdown ------------------------------------------------------------------------------
def render_markdown(report: Report, *, max_paths: int = 50) -> str:
    """The report as GitHub-flavoured markdown, sized for a job summary: the divergence count,
    right under it the decision coverage, then the tables."""
    lines = [f"### {headline(report)}", "", _cell(coverage_line(report)), "", overhead_line(report)]
    if data_line(report) is not None:
        lines += ["", _cell(data_line(report))]
    lines += ["", "| op | compared | divergences | rate |", "|---|---:|---:|---:|"]
    lines += [
        f"| {_cell(s.op)} | {s.num_compared} | {s.num_divergences} | "
        f"{rate(s.num_divergences, s.num_compared)} |"
        for s in report.ops
    ]
    if report.paths:
        lines += ["", "| op | field path | count | steps | workloads | kinds | first divergence |"]
        lines.append("|---|---|---:|---|---|---|---|")
        for stats in report.paths[:max_paths]:
            *rows, where = sample_lines(stats.samples[0])
            lines.append(
                f"| {_cell(stats.op)} | {_code(stats.path)} | {stats.count} | "
                f"{step_range(stats)} | {_cell(', '.join(stats.workloads))} | "
                f"{_cell(', '.join(stats.kinds))} | {'<br>'.join(map(_code, rows))} "
                f"{_cell(where)} |"
            )
        if len(report.paths) > max_paths:
            lines += ["", f"... and {len(report.paths) - max_paths} more field paths."]
    if report.coverage:
        lines += [
            "",
            "| outcome | count | runs | first reached | note |",
            "|---|---:|---:|---|---|",
        ]
        lines += [
            f"| {_code(r.outcome)} | {r.count} | {r.num_runs} | {_cell(first_reached(r))} | "
            f"{_cell(coverage_note(r))} |"
            for r in report.coverage
        ]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """``text`` for one table cell: pipes escaped, line breaks (\\n and \\r alike) made spaces."""
    return text.replace("|", "\\|").replace("\n", " ").replace("\r", " ")


def _code(text: str) -> str:
    """``text`` as a code span in a table cell, fenced by more backticks than it holds in a row
    (a path may hold backticks: ids are anyone's strings)."""
    fence = "`" * (1 + max(map(len, re.findall("`+", text)), default=0))
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{_cell(text)}{pad}{fence}"


# ---- JUnit ---------------------------------------------------------------------------------
def render_junit(report: Report) -> str:
    """JUnit XML. Suite ``compare``: one test case per (workload, op), failing where divergences
    exist, and a failing ``harness`` case when the harness itself failed (those ops were not
    compared). Suite ``coverage``: one case per required outcome (class ``coverage``) and
    interaction (class ``coverage.interaction``), failing when no run reached it."""
    suites = ET.Element("testsuites")
    _compare_suite(suites, report)
    required = [row for row in report.coverage if row.required]
    if required:
        suite = _suite(suites, "coverage", len(required), len(report.unreached), 0.0)
        for row in required:
            classname = "coverage" if row.kind == "outcome" else f"coverage.{row.kind}"
            case = ET.SubElement(suite, "testcase", classname=classname, name=xml_safe(row.outcome))
            if not row.count:
                message = f"no compared {row.op} op reached it: {row.meaning}"
                ET.SubElement(case, "failure", type="not_reached", message=xml_safe(message))
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def _compare_suite(suites: ET.Element, report: Report) -> None:
    failed = [pair for pair in report.pairs if pair.num_divergences]
    harness_failed = report.num_harness_errors > 0
    num_tests, num_failures = len(report.pairs) + harness_failed, len(failed) + harness_failed
    suite = _suite(suites, "compare", num_tests, num_failures, report.compare_seconds)
    properties = ET.SubElement(suite, "properties")
    errors = str(report.num_harness_errors)
    ET.SubElement(properties, "property", name="harness_errors", value=errors)
    for pair in report.pairs:
        name = xml_safe(f"{pair.workload}.{pair.op}")
        case = ET.SubElement(suite, "testcase", classname="compare", name=name)
        if pair.num_divergences:
            message = (
                f"{plural(pair.num_divergences, 'divergence')} in "
                f"{plural(pair.num_compared, 'compared step')}"
            )
            failure = ET.SubElement(case, "failure", type="divergence", message=message)
            failure.text = xml_safe("\n".join(_failure_lines(pair)))
    if harness_failed:
        case = ET.SubElement(suite, "testcase", classname="compare", name="harness")
        message = (
            f"{plural(report.num_harness_errors, 'harness error')}: the ops they hit were not "
            "compared"
        )
        ET.SubElement(case, "failure", type="harness_error", message=message)


def _failure_lines(pair: PairStats) -> list[str]:
    """A failing pair's most frequent field paths, each with its first divergence's values. Pure."""
    lines = []
    for (path, count), sample in zip(pair.top_paths[:_TOP_PATHS], pair.samples):
        lines += [f"{count} x {path}", *(f"    {line}" for line in sample_lines(sample))]
    return lines


def _suite(parent: ET.Element, name: str, tests: int, failures: int, seconds: float) -> ET.Element:
    attributes = {"tests": str(tests), "failures": str(failures), "errors": "0", "skipped": "0"}
    return ET.SubElement(parent, "testsuite", name=name, **attributes, time=f"{seconds:.3f}")


def xml_safe(text: str) -> str:
    """``text`` with each character XML 1.0 cannot hold (control characters, say) written as its
    escape (``\\x1b``): ElementTree would write them raw, making the document unreadable."""
    return _NOT_XML.sub(_escaped, text)


# ---- JSON ----------------------------------------------------------------------------------
def render_json(report: Report) -> str:
    """The whole report as JSON (sorted keys, stable across runs)."""
    return json.dumps(asdict(report), indent=2, sort_keys=True) + "\n"
