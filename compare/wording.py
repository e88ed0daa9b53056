"""The lines every format of a report shares, worded once: the text, markdown and JUnit renderers
(``compare.render``) and the HTML page (``compare.html``) call these. Each is pure.
"""

from __future__ import annotations

from compare.coverage import CoverageRow
from compare.report import PathSample, PathStats, Report


def headline(report: Report) -> str:
    """ "N divergences in M compared ops" (an op compared at one step counts once), and the harness
    errors if any."""
    line = (
        f"{plural(report.num_divergences, 'divergence')} in "
        f"{plural(report.num_compared, 'compared op')}"
    )
    if report.num_harness_errors:
        line += f", {plural(report.num_harness_errors, 'harness error')}"
    return line


def coverage_line(report: Report) -> str:
    """ "decision coverage: R of N required outcomes reached", and "interaction coverage: ..."
    when the catalog lists interactions, then those missed, if any."""
    required = [row for row in report.coverage if row.required]
    if not required:
        return f"decision coverage: {plural(len(report.coverage), 'outcome')} reached"
    parts = []
    for kind, label in (("outcome", "decision"), ("interaction", "interaction")):
        rows = [row for row in required if row.kind == kind]
        if rows or kind == "outcome":
            num_reached = sum(1 for row in rows if row.count)
            parts.append(f"{label} coverage: {num_reached} of {len(rows)} required {kind}s reached")
    line = "; ".join(parts)
    if report.unreached:
        line += f"; never reached: {', '.join(report.unreached)}"
    if report.unexpected:
        line += f"; reached but ruled out or unknown: {', '.join(report.unexpected)}"
    return line


def plural(n: int, noun: str) -> str:
    """ "1 run", "2 runs". Pure."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def rate(divergences: int, compared: int) -> str:
    """Divergences per compared op as a percentage; "n/a" when nothing was compared. Pure."""
    return f"{divergences / compared:.2%}" if compared else "n/a"


def step_range(stats: PathStats) -> str:
    """ "7" or "7-19": the steps where a field path diverged. Pure."""
    if stats.first_step == stats.last_step:
        return str(stats.first_step)
    return f"{stats.first_step}-{stats.last_step}"


def sample_lines(sample: PathSample) -> list[str]:
    """An example divergence at a field path: its rows (each path with both sides' values,
    ``compare.explain``), ``(+N more)``, and where it was. Pure."""
    lines = [row.text for row in sample.rows] or [sample.path]
    if sample.more_rows:
        lines.append(f"(+{sample.more_rows} more)")
    return [*lines, f"({sample.workload} step {sample.step})"]


def first_reached(row: CoverageRow) -> str:
    """ "<workload> step N" where an outcome was first reached; "-" when never. Pure."""
    return "-" if row.first_workload is None else f"{row.first_workload} step {row.first_step}"


def coverage_note(row: CoverageRow) -> str:
    """NOT REACHED for a required outcome no run reached; unreachable for one the catalog rules
    out (its reason: the JSON report and the catalog)."""
    if row.unreachable is not None:
        return "unreachable" + (" but REACHED" if row.count else "")
    return "NOT REACHED" if row.required and not row.count else ""


def data_line(report: Report) -> str | None:
    """ "data oracle: N load, M append checked, K data divergences; patterns issued: ..." when a
    run had a data oracle (None otherwise). Pure."""
    if not (report.data_checked or report.data_patterns):
        return None
    checked = ", ".join(f"{n} {check}" for check, n in report.data_checked) or "nothing"
    line = f"data oracle: {checked} checked in {report.data_seconds:.2f} s, "
    line += plural(dict(report.kinds).get("data", 0), "data divergence")
    if report.data_patterns:
        line += "; patterns issued: " + ", ".join(f"{p} {n}" for p, n in report.data_patterns)
    return line


def overhead_line(report: Report) -> str:
    """Runs, harness errors, and the harness's seconds over the authoritative path's on the
    compared ops: the cost of the bookkeeping compared, not the job's slowdown (a run's wall time
    with compare mode on and off says that). Pure."""
    line = f"{plural(report.num_runs, 'run')}, "
    line += plural(report.num_harness_errors, "harness error")
    if report.authoritative_seconds > 0:
        line += (
            f"; compare harness {report.compare_seconds:.3g} s on "
            f"{report.authoritative_seconds:.3g} s of authoritative ops "
            f"({report.compare_seconds / report.authoritative_seconds:.2f}x the ops compared,"
            " not of the job)"
        )
    return line
