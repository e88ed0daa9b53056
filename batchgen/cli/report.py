"""``batchgen report``: merge divergence logs into one report (text, md, junit, json, html)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from batchgen.cli.common import UsageError, check_output_file, print_warnings
from batchgen.exit_codes import EXIT_FAILED, EXIT_OK
from batchgen.kv.gate import KV_BINDING
from batchgen.shadow.report_page import catalog_of, render_page
from compare import LogReadResult, RunSummary, aggregate, read_log, write_atomic
from compare.render import headline, render_json, render_junit, render_markdown, render_text

RENDERERS = {"text": render_text, "md": render_markdown, "junit": render_junit, "json": render_json}


FORMATS = (*RENDERERS, "html")  # html also reads the logs' records: its charts and replay commands


STEP_SUMMARY_ENV = "GITHUB_STEP_SUMMARY"  # GitHub Actions' job summary file (markdown, appended to)


UNENDED = (
    "a run in it did not end (it stopped early, no run summary closes it, or its last line is cut"
    " short)"
)


EMPTY = "it holds no record (a run that stopped before its summary leaves its log so)"


NOTHING_COMPARED = (
    "every run ended having compared no op (a --kv-compare-sample too small for the run, or "
    "--kv-compare-ops naming ops that never ran)"
)


def add_report_command(commands) -> None:
    parser = commands.add_parser(
        "report",
        help="merge divergence logs into one report",
        description=(
            "Merge divergence logs (JSON Lines from compare mode) and report divergences per op and"
            " per field path. A last line cut short by a crash is skipped with a warning on stderr."
            " Exit 0 when every run in the logs ended and none diverged or hit a harness error (a"
            " failure inside compare mode, which leaves the op it hit uncompared); 1 when one did,"
            " or when a run did not end (it stopped early, no run summary closes it, or its last"
            " line is cut short: such a log vouches for nothing, and a warning says which), or when"
            " the runs compared nothing (compare mode sampled no op: the logs vouch for nothing"
            " either); 2 when an input is unreadable."
        ),
    )
    parser.add_argument(
        "logs",
        nargs="+",
        metavar="LOG",
        help=(
            "divergence log files, merged in the order given (a file named twice is read once; "
            "/dev/stdin reads one from a pipe)"
        ),
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help=(
            "text (terminal tables), md (GitHub markdown; also appended to $GITHUB_STEP_SUMMARY "
            "when it is set, with a warning if it cannot be), junit (XML, a test case per workload "
            "and op), json, or html (one self-contained page: per run, a timeline of pages held "
            "and KV events with its divergences marked; use --out) (default: %(default)s)"
        ),
    )
    parser.add_argument(
        "--out",
        metavar="FILE",
        default=None,
        help="write the report to FILE, replaced atomically, instead of stdout (default: stdout)",
    )
    parser.add_argument(
        "--require-coverage",
        action="store_true",
        help="also exit 1 when a required decision outcome of an op the logs compared was never "
        "reached (the report lists them either way)",
    )
    parser.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    if args.out is not None and any(
        Path(args.out).resolve() == Path(log).resolve() for log in args.logs
    ):
        raise UsageError(
            f"--out {args.out}: it is one of the logs being read; write the report elsewhere"
        )
    logs = _distinct(args.logs)
    results = [read_log(path) for path in logs]
    records = [record for result in results for record in result.records]
    binding = _binding(logs, results)
    unended = [path for path, result in zip(logs, results) if not _ended(result)]
    report = aggregate(records, catalog_of(binding))
    print_warnings([warning for result in results for warning in result.warnings])
    print_warnings(
        [
            f"{path}: {UNENDED if result.records else EMPTY}, so it vouches for nothing compared"
            for path, result in zip(logs, results)
            if path in unended
        ]
    )
    compared_nothing = not unended and not report.num_compared
    if compared_nothing:
        vouch = "they vouch" if len(logs) > 1 else "it vouches"
        print_warnings([f"{', '.join(logs)}: {NOTHING_COMPARED}, so {vouch} for nothing"])
    if args.format == "html":
        runs = [(path, result.records) for path, result in zip(logs, results)]
        text = render_page(report, runs, binding)
    else:
        text = RENDERERS[args.format](report)
    if args.out is not None:
        _write_out(args.out, text)
        print(f"batchgen: wrote {args.out}: {headline(report)}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if args.format == "md":
        _append_step_summary(text)
    failed = report.num_divergences or report.num_harness_errors or unended or compared_nothing
    if args.require_coverage and report.unreached:
        print_warnings([f"decision coverage: never reached: {', '.join(report.unreached)}"])
        failed = True
    return EXIT_FAILED if failed else EXIT_OK


def _binding(logs: Sequence[str], results: Sequence[LogReadResult]) -> str:
    """The binding every record of the logs names (the KV one when they hold none); UsageError
    naming the logs of each when they name several. Pure."""
    found: dict[str, list[str]] = {}
    for path, result in zip(logs, results):
        for binding in dict.fromkeys(record.binding for record in result.records):
            found.setdefault(binding, []).append(path)
    if len(found) > 1:
        each = "; ".join(f"{binding}: {', '.join(paths)}" for binding, paths in found.items())
        raise UsageError(f"the logs hold runs of several bindings ({each}); report each apart")
    return next(iter(found), KV_BINDING)


def _distinct(logs: Sequence[str]) -> list[str]:
    """``logs`` with each file once, where it is first named (a log read twice would count its runs
    twice), warning on stderr about each repeat."""
    first: dict[Path, str] = {}
    for log in logs:
        path = Path(log).resolve()
        if path in first:
            print_warnings([f"{log}: the same file as {first[path]}, given again; read once"])
        else:
            first[path] = log
    return list(first.values())


def _ended(log: LogReadResult) -> bool:
    """Whether every run that wrote to the log did all its work: the log ends in a whole run
    summary, each run that logged a record has a summary (a run that died can be followed by others
    appending to the same log), and no summary says its run stopped early. Pure."""
    records = log.records
    summaries = [record for record in records if isinstance(record, RunSummary)]
    summarised = {summary.run_id for summary in summaries}
    return (
        not log.num_skipped
        and bool(records)
        and isinstance(records[-1], RunSummary)
        and all(record.run_id in summarised for record in records)
        and not any(summary.stopped_by for summary in summaries)
    )


def _write_out(path: str, text: str) -> None:
    """``write_atomic`` for ``--out``; UsageError naming what is in the way when it cannot be
    written."""
    check_output_file("--out", path, "the report")  # os.replace would call "." or "/" busy
    try:
        write_atomic(path, text)
    except OSError as error:
        raise UsageError(
            f"--out {path}: cannot write the report: {error.strerror or error}"
        ) from None


def _append_step_summary(markdown: str) -> None:
    """Append ``markdown`` to the file ``$GITHUB_STEP_SUMMARY`` names, if set; a warning when it
    cannot (the report is written already, and its verdict stays the exit status)."""
    path = os.environ.get(STEP_SUMMARY_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as summary:
            summary.write(markdown)
    except OSError as error:
        print_warnings(
            [f"${STEP_SUMMARY_ENV}={path}: cannot append the report: {error.strerror or error}"]
        )
