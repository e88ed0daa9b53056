"""Divergence logs: ``batchgen report``, ``replay`` and ``minimize``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from batchgen.cli.common import (
    UsageError,
    check_output_file,
    make_directory,
    non_negative_int,
    positive_int,
    remove_empty,
)
from batchgen.engine.workloads import Workload
from batchgen.exit_codes import EXIT_FAILED, EXIT_OK
from batchgen.shadow.coverage import CATALOG
from batchgen.shadow.minimize import NotReproduced, minimize_divergence, recorded_run
from batchgen.shadow.minimize_search import MinimizeResult, TestCallback
from batchgen.shadow.regression import write_regression_into
from batchgen.shadow.replay import ReplayOutcome, replay_record
from compare import (
    DivergenceRecord,
    LogReadResult,
    RunSummary,
    aggregate,
    read_log,
    write_atomic,
)
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
# minimize's default --out-dir: git-ignored, and `make clean` deletes reports/
MINIMIZED_DIR = "reports/minimized"


# ---- report ------------------------------------------------------------------------------------
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
    unended = [path for path, result in zip(logs, results) if not _ended(result)]
    report = aggregate(records, CATALOG)
    _print_warnings([warning for result in results for warning in result.warnings])
    _print_warnings(
        [
            f"{path}: {UNENDED if result.records else EMPTY}, so it vouches for nothing compared"
            for path, result in zip(logs, results)
            if path in unended
        ]
    )
    compared_nothing = not unended and not report.num_compared
    if compared_nothing:
        vouch = "they vouch" if len(logs) > 1 else "it vouches"
        _print_warnings([f"{', '.join(logs)}: {NOTHING_COMPARED}, so {vouch} for nothing"])
    if args.format == "html":
        from batchgen.shadow.report_page import render_page  # loads matplotlib: only for a page

        text = render_page(report, [(path, result.records) for path, result in zip(logs, results)])
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
        _print_warnings([f"decision coverage: never reached: {', '.join(report.unreached)}"])
        failed = True
    return EXIT_FAILED if failed else EXIT_OK


def _distinct(logs: Sequence[str]) -> list[str]:
    """``logs`` with each file once, where it is first named (a log read twice would count its runs
    twice), warning on stderr about each repeat."""
    first: dict[Path, str] = {}
    for log in logs:
        path = Path(log).resolve()
        if path in first:
            _print_warnings([f"{log}: the same file as {first[path]}, given again; read once"])
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
        _print_warnings(
            [f"${STEP_SUMMARY_ENV}={path}: cannot append the report: {error.strerror or error}"]
        )


# ---- replay and minimize -----------------------------------------------------------------------
def add_replay_command(commands) -> None:
    parser = commands.add_parser(
        "replay",
        help="re-run one logged divergence from its record alone",
        description=(
            "Rebuild the pre-state of one logged divergence from its record, run both KV paths"
            " through the op, and show the diff. Exit 0 when the divergence reproduces, 1 when it"
            " does not, 2 on bad input (an unreadable log, an --index out of range, a record replay"
            " cannot use)."
        ),
    )
    _add_record_args(parser)
    parser.set_defaults(handler=_replay)


def add_minimize_command(commands) -> None:
    parser = commands.add_parser(
        "minimize",
        help="shrink a logged divergence to a minimal workload and a regression test",
        description=(
            "Delta-debug the workload of one logged divergence (requests, then their steps) down to"
            " a minimal one that still diverges the same way on the tiny model, and write it with a"
            " pytest regression test that fails until the bug is fixed. When --max-tests runs out"
            " first, it writes the smallest diverging workload found so far and warns that it may"
            " not be minimal (exit 0). Ctrl-C or SIGTERM during the search writes that smallest"
            " workload and its test the same way, says so, and exits 130 or 143; if no candidate"
            " has diverged yet, nothing is written. Exit 0 when it wrote them, 1 when the"
            " divergence does not reproduce on its workload, 2 on bad input (an unreadable log, an"
            " --index out of range, a record minimize cannot use)."
        ),
    )
    _add_record_args(parser)
    parser.add_argument(
        "--out-dir",
        default=MINIMIZED_DIR,
        metavar="DIR",
        help=(
            "where the workload JSON and the test go; reports/ is git-ignored and `make clean` "
            "deletes it, and `make test` runs tests/ only: move both files into tests/ to keep "
            "the test (default: %(default)s)"
        ),
    )
    parser.add_argument(
        "--max-tests",
        type=positive_int,
        default=400,
        metavar="N",
        help=(
            "candidate workloads run at most; the result may not be minimal when they run out "
            "(default: %(default)s)"
        ),
    )
    parser.set_defaults(handler=_minimize)


def _add_record_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", metavar="LOG", help="a divergence log (JSON Lines)")
    parser.add_argument(
        "--index",
        type=non_negative_int,
        required=True,
        metavar="N",
        help=(
            "which divergence: 0 is the log's first divergence record (run summary records are "
            "not counted)"
        ),
    )


def _replay(args: argparse.Namespace) -> int:
    record, count = _divergence_record(args.log, args.index)
    outcome = replay_record(record)
    print(
        f"record {args.index} of {count} divergence records in {args.log}: {_record_title(record)}"
    )
    print(f"logged:   {_divergence_line(record.kind, tuple(record.field_paths))}")
    _print_paths(record.field_paths)
    print(f"replayed: {_divergence_line(outcome.kind, outcome.field_paths)}")
    _print_paths(outcome.field_paths)
    _print_replay_detail(outcome)
    print(f"reproduced: {'yes' if outcome.reproduced else 'no'}")
    return EXIT_OK if outcome.reproduced else EXIT_FAILED


def _minimize(args: argparse.Namespace) -> int:
    record, count = _divergence_record(args.log, args.index)
    replay = record.replay
    if not replay.get("workload_source"):
        raise UsageError(
            f"{args.log}: divergence record {args.index} names no workload_source to minimize"
        )
    # a payload the search cannot use fails before --out-dir is made
    original, _, _ = recorded_run(record)
    made = make_directory("--out-dir", args.out_dir)  # before the search, which takes minutes
    print(
        f"minimizing record {args.index} of {count} in {args.log}: {_record_title(record)}",
        file=sys.stderr,
    )
    # the smallest diverging workload when Ctrl-C or SIGTERM ends the search
    interrupted: list[MinimizeResult] = []
    try:
        with _candidate_progress(args.max_tests, len(original.requests)) as on_test:
            result = minimize_divergence(
                record, max_tests=args.max_tests, on_test=on_test, on_interrupt=interrupted.append
            )
    except BaseException as error:  # not reproduced, a payload it cannot use, Ctrl-C or SIGTERM
        # a candidate diverged before the interrupt: keep the smallest, then exit 130 or 143
        if interrupted:
            try:
                _write_minimized(args, original, interrupted[0])
            except OSError as failed:  # the interrupt stays what ends the command
                print(
                    "batchgen: warning: cannot write the smallest diverging workload found: "
                    f"{failed.strerror or failed}",
                    file=sys.stderr,
                )
            raise
        remove_empty(made)  # nothing was written
        if not isinstance(error, NotReproduced):
            raise
        print(f"batchgen: not reproduced: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_FAILED
    _write_minimized(args, original, result)
    return EXIT_OK


def _write_minimized(args: argparse.Namespace, original: Workload, result: MinimizeResult) -> None:
    """Write ``result``'s workload and regression test into ``--out-dir``, print what shrank and the
    two paths on stdout, and on stderr why the search stopped early (it may not be minimal) and
    where to keep the test."""
    workload_path, test_path = write_regression_into(args.out_dir, result)
    minimal = result.workload.requests
    print(
        f"{result.signature.op} {result.signature.kind} divergence"
        f" ({', '.join(result.signature.field_paths) or '-'}): requests {len(original.requests)} ->"
        f" {len(minimal)}, new tokens {sum(r.max_new_tokens for r in original.requests)} ->"
        f" {sum(r.max_new_tokens for r in minimal)}, {result.num_tests} tests run"
        + (f", under faults {result.faults}" if result.faults else "")
    )
    print(f"workload: {workload_path}")
    print(f"test:     {test_path}")
    sys.stdout.flush()  # stdout and stderr sent to one file keep this order
    if result.stopped_by == "interrupted":
        print(
            f"batchgen: minimize was interrupted after {result.num_tests} tests: the workload"
            f" written is the smallest that diverged so far ({len(minimal)} of"
            f" {len(original.requests)} requests) and may not be minimal; delete its two files and"
            " run minimize again to search to the end",
            file=sys.stderr,
        )
    elif result.stopped_by == "max_tests":
        _print_warnings(
            [
                f"the --max-tests budget ({args.max_tests}) ran out before the search finished: the"
                " workload may not be minimal; delete its two files and rerun with a larger"
                " --max-tests"
            ]
        )
    if Path(args.out_dir).resolve() == Path(MINIMIZED_DIR).resolve():
        print(
            f"batchgen: {MINIMIZED_DIR} is git-ignored and `make clean` deletes it: to keep the"
            " regression test, move both files into tests/, where `make test` runs it (it fails"
            " until the bug is fixed)",
            file=sys.stderr,
        )


@contextmanager
def _candidate_progress(max_tests: int, num_requests: int) -> Iterator[TestCallback]:
    """A progress bar on stderr over the candidate workloads minimize runs, naming the smallest that
    diverged; yields its ``on_test``."""
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} candidates"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    ) as progress:
        task = progress.add_task(f"minimizing {num_requests} requests", total=max_tests)

        def on_test(num_tests: int, smallest: int | None) -> None:
            shrunk = (
                f"diverges with {smallest} of {num_requests} requests"
                if smallest is not None
                else (f"minimizing {num_requests} requests")
            )
            progress.update(task, completed=num_tests, description=shrunk)

        yield on_test


def _divergence_record(log: str, index: int) -> tuple[DivergenceRecord, int]:
    """The ``index``-th divergence record of ``log`` and how many it holds; UsageError when out of
    range."""
    result = read_log(log)
    _print_warnings(result.warnings)
    records = [record for record in result.records if isinstance(record, DivergenceRecord)]
    if not records:
        held = (
            f"its {len(result.records)} records are all run summaries"
            if result.records
            else "it holds no record"
        )
        raise UsageError(f"{log}: no divergence record to pick; {held}")
    if index >= len(records):
        raise UsageError(
            f"--index {index} is out of range: {log} holds {len(records)} divergence records, so "
            f"--index is 0 to {len(records) - 1} (run summaries are not counted)"
        )
    return records[index], len(records)


def _record_title(record: DivergenceRecord) -> str:
    return (
        f"{record.op} step {record.step} of {record.workload} (seed {record.seed}, run"
        f" {record.run_id}), authoritative {record.authoritative}, shadow {record.shadow}"
    )


def _divergence_line(kind: str | None, paths: tuple[str, ...]) -> str:
    if kind is None:
        return "no divergence: the two paths agree"
    return f"{kind} divergence at {len(paths)} field paths" if paths else f"{kind} divergence"


def _print_paths(paths: Sequence[str]) -> None:
    for path in paths:
        print(f"    {path}")


def _print_replay_detail(outcome: ReplayOutcome) -> None:
    for exception in outcome.exceptions:
        print(f"raised:   {exception}")
    if outcome.diff:
        print("diff:")
        print(json.dumps(outcome.diff, indent=2, sort_keys=True, default=str))


def _print_warnings(warnings: Sequence[str]) -> None:
    for warning in warnings:
        print(f"batchgen: warning: {warning}", file=sys.stderr)
