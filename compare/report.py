"""Aggregate divergence logs into a report, and render it for people and for CI.

Divergences are counted per op and per (op, field path with ids and indexes wildcarded):
`requests[r17].gpu_pages[3]` and `requests[r4].gpu_pages[0]` both count under
`requests[*].gpu_pages[*]`. A divergence without field paths (an exception) counts under
`<kind>`, e.g. `<exception>`. Compared-step counts come from the runs' `RunSummary` records.

    aggregate(records) -> Report -> render_text / render_markdown / render_junit / render_json

Everything here is pure: the report is immutable and renderers return strings (write them with
`compare.sink.write_atomic`).
"""

from __future__ import annotations

import io
import json
import re
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from rich.console import Console
from rich.table import Table
from rich.text import Text

from compare.canonical import wildcard
from compare.records import LogRecord, RunSummary

MAX_SAMPLES = 3  # concrete examples kept per (op, field path)
_TOP_PATHS = 5  # field paths listed per JUnit failure
# characters XML 1.0 cannot hold
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
# control characters a terminal acts on (not \t, \n)
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@dataclass(frozen=True, slots=True)
class PathSample:
    """One concrete occurrence of a wildcarded field path."""

    run_id: str
    workload: str
    step: int
    path: str  # concrete, e.g. "requests[r17].gpu_pages[3]"


@dataclass(frozen=True, slots=True)
class PathStats:
    """Divergences of one op at one wildcarded field path."""

    op: str
    path: str  # wildcarded, e.g. "requests[*].gpu_pages[*]"
    count: int  # divergence records touching the path
    first_step: int
    last_step: int
    workloads: tuple[str, ...]
    kinds: tuple[str, ...]
    samples: tuple[PathSample, ...]  # the first MAX_SAMPLES, in log order


@dataclass(frozen=True, slots=True)
class OpStats:
    op: str
    num_compared: int
    num_divergences: int


@dataclass(frozen=True, slots=True)
class PairStats:
    """One (workload, op) pair: a JUnit test case."""

    workload: str
    op: str
    num_compared: int
    num_divergences: int
    top_paths: tuple[tuple[str, int], ...]  # (wildcarded path, count), most frequent first


@dataclass(frozen=True, slots=True)
class Report:
    num_runs: int  # RunSummary records read
    num_compared: int
    num_divergences: int
    num_harness_errors: int
    compare_seconds: float
    authoritative_seconds: float
    ops: tuple[OpStats, ...]  # by op name
    paths: tuple[PathStats, ...]  # most frequent first
    pairs: tuple[PairStats, ...]  # by workload, then op


@dataclass(slots=True)
class _PathTally:
    """Accumulates one PathStats while `aggregate` reads records (local to one call)."""

    count: int = 0
    first_step: int = 0
    last_step: int = 0
    workloads: set[str] = field(default_factory=set)
    kinds: set[str] = field(default_factory=set)
    samples: list[PathSample] = field(default_factory=list)


def aggregate(records: Iterable[LogRecord]) -> Report:
    """Count divergences and compared steps per op, per field path and per (workload, op)."""
    compared: Counter[tuple[str, str]] = Counter()  # (workload, op) -> steps
    diverged: Counter[tuple[str, str]] = Counter()
    pair_paths: dict[tuple[str, str], Counter[str]] = {}
    tallies: dict[tuple[str, str], _PathTally] = {}  # (op, wildcarded path)
    num_runs = num_harness_errors = 0
    compare_seconds = authoritative_seconds = 0.0
    for record in records:
        if isinstance(record, RunSummary):
            num_runs += 1
            num_harness_errors += record.harness_errors
            compare_seconds += record.compare_seconds
            authoritative_seconds += record.authoritative_seconds
            for op, steps in record.steps_compared.items():
                compared[(record.workload, op)] += steps
            continue
        pair = (record.workload, record.op)
        diverged[pair] += 1
        concrete_by_key: dict[str, str] = {}
        for path in record.field_paths or [f"<{record.kind}>"]:
            concrete_by_key.setdefault(wildcard(path), path)
        pair_paths.setdefault(pair, Counter()).update(concrete_by_key.keys())
        for key, concrete in concrete_by_key.items():
            tally = tallies.setdefault(
                (record.op, key), _PathTally(first_step=record.step, last_step=record.step)
            )
            tally.count += 1
            tally.first_step = min(tally.first_step, record.step)
            tally.last_step = max(tally.last_step, record.step)
            tally.workloads.add(record.workload)
            tally.kinds.add(record.kind)
            if len(tally.samples) < MAX_SAMPLES:
                tally.samples.append(
                    PathSample(record.run_id, record.workload, record.step, concrete)
                )
    pairs = sorted(compared.keys() | diverged.keys())
    ops = sorted({op for _, op in pairs})
    paths = [
        PathStats(
            op,
            key,
            t.count,
            t.first_step,
            t.last_step,
            tuple(sorted(t.workloads)),
            tuple(sorted(t.kinds)),
            tuple(t.samples),
        )
        for (op, key), t in tallies.items()
    ]
    paths.sort(key=lambda stats: (-stats.count, stats.op, stats.path))
    return Report(
        num_runs=num_runs,
        num_compared=sum(compared.values()),
        num_divergences=sum(diverged.values()),
        num_harness_errors=num_harness_errors,
        compare_seconds=compare_seconds,
        authoritative_seconds=authoritative_seconds,
        ops=tuple(
            OpStats(
                op,
                sum(n for (_, o), n in compared.items() if o == op),
                sum(n for (_, o), n in diverged.items() if o == op),
            )
            for op in ops
        ),
        paths=tuple(paths),
        pairs=tuple(
            PairStats(
                workload,
                op,
                compared[(workload, op)],
                diverged[(workload, op)],
                _most_common(pair_paths.get((workload, op), Counter())),
            )
            for workload, op in pairs
        ),
    )


def _most_common(counts: Counter[str]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def headline(report: Report) -> str:
    """ "N divergences in M compared ops" (an op compared at one step counts once), and the harness
    errors if any."""
    line = (
        f"{_plural(report.num_divergences, 'divergence')} in "
        f"{_plural(report.num_compared, 'compared op')}"
    )
    if report.num_harness_errors:
        line += f", {_plural(report.num_harness_errors, 'harness error')}"
    return line


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _rate(divergences: int, compared: int) -> str:
    return f"{divergences / compared:.2%}" if compared else "n/a"


def _steps(stats: PathStats) -> str:
    if stats.first_step == stats.last_step:
        return str(stats.first_step)
    return f"{stats.first_step}-{stats.last_step}"


def _overhead(report: Report) -> str:
    line = (
        f"{_plural(report.num_runs, 'run')}, {_plural(report.num_harness_errors, 'harness error')}"
    )
    if report.authoritative_seconds > 0:
        line += (
            f"; compare overhead {report.compare_seconds:.3g} s on "
            f"{report.authoritative_seconds:.3g} s authoritative "
            f"({report.compare_seconds / report.authoritative_seconds:.2f}x)"
        )
    return line


def render_text(report: Report, *, width: int = 120) -> str:
    """The report as plain-text rich tables (for terminals and CI logs)."""
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False)
    console.print(_terminal(headline(report)))
    console.print(_terminal(_overhead(report)))
    ops = Table(title="By op")
    for column in ("op", "compared", "divergences", "rate"):
        ops.add_column(column, justify="left" if column == "op" else "right")
    for stats in report.ops:
        ops.add_row(
            _terminal(stats.op),
            str(stats.num_compared),
            str(stats.num_divergences),
            _rate(stats.num_divergences, stats.num_compared),
        )
    console.print(ops)
    if report.paths:
        paths = Table(title="By field path")
        for column in ("op", "field path", "count", "steps", "workloads", "kinds", "example"):
            paths.add_column(column, justify="right" if column == "count" else "left")
        for stats in report.paths:
            sample = stats.samples[0]
            paths.add_row(
                _terminal(stats.op),
                _terminal(stats.path),
                str(stats.count),
                _steps(stats),
                _terminal(", ".join(stats.workloads)),
                _terminal(", ".join(stats.kinds)),
                _terminal(f"{sample.path} ({sample.workload} step {sample.step})"),
            )
        console.print(paths)
    return out.getvalue()


def _terminal(text: str) -> Text:
    """``text`` for a terminal: plain (no rich markup), each control character written as its escape
    (``\\x1b``), so ids from a log (anyone's strings) cannot move the cursor or recolour the
    screen."""
    return Text(_CONTROL.sub(_escaped, text))


def _escaped(match: re.Match) -> str:
    return match.group().encode("unicode_escape").decode("ascii")


def render_markdown(report: Report, *, max_paths: int = 50) -> str:
    """The report as GitHub-flavoured markdown, sized for a job summary."""
    lines = [
        f"### {headline(report)}",
        "",
        _overhead(report),
        "",
        "| op | compared | divergences | rate |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {_cell(s.op)} | {s.num_compared} | {s.num_divergences} | "
        f"{_rate(s.num_divergences, s.num_compared)} |"
        for s in report.ops
    ]
    if report.paths:
        lines += [
            "",
            "| op | field path | count | steps | workloads | kinds | example |",
            "|---|---|---:|---|---|---|---|",
        ]
        for stats in report.paths[:max_paths]:
            sample = stats.samples[0]
            lines.append(
                f"| {_cell(stats.op)} | {_code(stats.path)} | {stats.count} | "
                f"{_steps(stats)} | {_cell(', '.join(stats.workloads))} | "
                f"{_cell(', '.join(stats.kinds))} | {_code(sample.path)} "
                f"({_cell(sample.workload)} step {sample.step}) |"
            )
        if len(report.paths) > max_paths:
            lines += ["", f"... and {len(report.paths) - max_paths} more field paths."]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """``text`` for one table cell: pipes escaped, line breaks (\\n and \\r alike) made spaces."""
    return text.replace("|", "\\|").replace("\n", " ").replace("\r", " ")


def _code(text: str) -> str:
    """``text`` as a code span in a table cell, fenced by more backticks than it holds in a row (a
    path may hold backticks: ids are anyone's strings)."""
    fence = "`" * (1 + max(map(len, re.findall("`+", text)), default=0))
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{_cell(text)}{pad}{fence}"


def render_junit(report: Report) -> str:
    """JUnit XML: one test case per (workload, op), failing where divergences exist, and a failing
    `harness` case when the harness itself failed (those ops were not compared)."""
    failed = [pair for pair in report.pairs if pair.num_divergences]
    harness_failed = report.num_harness_errors > 0
    suites = ET.Element("testsuites")
    suite = ET.SubElement(
        suites,
        "testsuite",
        name="compare",
        tests=str(len(report.pairs) + harness_failed),
        failures=str(len(failed) + harness_failed),
        errors="0",
        skipped="0",
        time=f"{report.compare_seconds:.3f}",
    )
    properties = ET.SubElement(suite, "properties")
    ET.SubElement(
        properties, "property", name="harness_errors", value=str(report.num_harness_errors)
    )
    for pair in report.pairs:
        case = ET.SubElement(
            suite, "testcase", classname="compare", name=_xml(f"{pair.workload}.{pair.op}")
        )
        if pair.num_divergences:
            failure = ET.SubElement(
                case,
                "failure",
                type="divergence",
                message=(
                    f"{_plural(pair.num_divergences, 'divergence')} in "
                    f"{_plural(pair.num_compared, 'compared step')}"
                ),
            )
            failure.text = _xml(
                "\n".join(f"{count} x {path}" for path, count in pair.top_paths[:_TOP_PATHS])
            )
    if harness_failed:
        case = ET.SubElement(suite, "testcase", classname="compare", name="harness")
        ET.SubElement(
            case,
            "failure",
            type="harness_error",
            message=(
                f"{_plural(report.num_harness_errors, 'harness error')}: the ops they hit "
                "were not compared"
            ),
        )
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def _xml(text: str) -> str:
    """``text`` with each character XML 1.0 cannot hold (control characters, say) written as its
    escape (``\\x1b``): ElementTree would write them raw, making the document unreadable."""
    return _NOT_XML.sub(_escaped, text)


def render_json(report: Report) -> str:
    """The whole report as JSON (sorted keys, stable across runs)."""
    return json.dumps(asdict(report), indent=2, sort_keys=True) + "\n"
