"""``batchgen sweep``: compare mode over workloads x seeds x fault schedules x directions, as Ray
tasks or on local processes; one merged divergence log and its reports."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
from rich.text import Text

from batchgen.cli.arg_types import non_negative_int, positive_int, seconds_float, seed_list
from batchgen.cli.backend_args import add_backend_args, backend_from_args, check_backend_args
from batchgen.cli.common import add_output_args, add_scale_arg, check_directory, make_directory
from batchgen.cli.run_flags import (
    add_prefix_caching_args,
    prefix_caching_from_args,
    refuse_production_settings,
)
from batchgen.engine.workloads import BUILTIN_WORKLOADS
from batchgen.exit_codes import EXIT_FAILED, EXIT_OK
from batchgen.metrics.config import add_metrics_args, metrics_config_from_args
from batchgen.metrics.exporter import exporting
from batchgen.sweep.backends import SweepBackend
from batchgen.sweep.driver import (
    DEFAULT_MAX_RETRIES,
    SWEEP_REPORT_FILES,
    ProgressCallback,
    SweepResult,
    run_sweep,
)
from batchgen.sweep.matrix import (
    MAX_RUNS,
    SERVING_PATHS,
    SweepCell,
    SweepWorkload,
    run_cell,
    sweep_cells,
    sweep_directions,
    sweep_workloads,
)
from compare.render import headline, render_text

DEFAULT_WORKLOADS = ("L2-2048", "L2-4096")
NO_FAULTS = "none"


def add_sweep_command(commands) -> None:
    parser = commands.add_parser(
        "sweep",
        help="compare mode over workloads x seeds x faults x directions, on Ray or local processes",
        description=(
            "Run compare mode over a matrix of workloads, seeds, fault schedules and directions,"
            " one run per cell on a fresh worker (the tiny model, weights drawn from the seed), as"
            " Ray tasks or on local processes, and merge every run's records into one divergence"
            " log (in matrix order: the same matrix gives the same records on any backend and any"
            " number of workers) and its reports in --reports-dir. A task that raises, whose worker"
            " dies or whose node is lost is retried; one that fails every attempt is a harness"
            " error naming the run. Exit 0 when runs ended and none diverged, stopped early or was"
            " lost, 1 otherwise, 2 on bad input, 130 on Ctrl-C and 143 on SIGTERM (both after"
            " writing the log and reports of the runs that finished)."
        ),
    )
    _add_matrix_args(parser)
    _add_direction_args(parser)
    _add_backend_args(parser)
    parser.add_argument(
        "--reports-dir",
        default="reports/sweep",
        metavar="DIR",
        help=(
            "where the merged log (divergences.jsonl, replaced when the sweep ends) and its .txt,"
            " .md, .xml (JUnit) and .json reports go (default: %(default)s)"
        ),
    )
    add_metrics_args(parser)
    add_output_args(parser)
    parser.set_defaults(handler=_sweep)


def _add_matrix_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        action="append",
        metavar="NAME|FILE|DIR",
        help=(
            f"a built-in workload ({', '.join(BUILTIN_WORKLOADS)}), a workload JSON file, or a"
            " directory of them (a corpus: each *.json); repeat for more (default:"
            f" {' and '.join(DEFAULT_WORKLOADS)})"
        ),
    )
    parser.add_argument(
        "--seeds",
        type=seed_list,
        default=(0,),
        metavar="RANGE",
        help=(
            "seeds, as N, A-B (inclusive) or a comma list of both, e.g. 0-99,1000; a seed draws a"
            " built-in trace, the model's weights and a fault SPEC's schedule when the SPEC names"
            " no seed (default: 0)"
        ),
    )
    parser.add_argument(
        "--faults",
        action="append",
        metavar="SPEC",
        help=(
            "a fault schedule (batchgen run --help gives the SPEC grammar), or 'none' for a run"
            " without faults; repeat for more (default: none)"
        ),
    )
    add_scale_arg(parser, workload_files=True)
    add_prefix_caching_args(parser, default="each workload's cache config")


def _add_direction_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--directions",
        choices=SERVING_PATHS,
        default="both",
        help=(
            "the authoritative path of each run, the other one shadowed: plan, legacy, or both"
            " (a run of each) (default: %(default)s)"
        ),
    )
    parser.add_argument(
        "--aa",
        action="store_true",
        help=(
            "also run each authoritative path shadowed by itself (the A/A noise check: a"
            " divergence there is noise in the harness) (default: off)"
        ),
    )
    parser.add_argument(
        "--max-runs",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"run the first N runs of the matrix only (default: all, at most {MAX_RUNS})",
    )


def _add_backend_args(parser: argparse.ArgumentParser) -> None:
    add_backend_args(parser, default="ray", serial=False)
    parser.add_argument(
        "--max-retries",
        type=non_negative_int,
        default=DEFAULT_MAX_RETRIES,
        metavar="N",
        help=(
            "retries of a run whose task raised, whose worker process died or whose node was"
            " lost, before it counts as a harness error (default: %(default)s)"
        ),
    )
    parser.add_argument(
        "--time-budget",
        type=seconds_float,
        default=None,
        metavar="SECONDS",
        help=(
            "start no run after SECONDS and cancel those in flight; the log and reports hold the"
            " runs that finished (default: none)"
        ),
    )


def _matrix(args: argparse.Namespace) -> tuple[tuple[SweepWorkload, ...], tuple[SweepCell, ...]]:
    """The sweep's workloads and cells, from the flags (prefix caching's over the environment).
    Reads the workload files; GateError, SweepError, FaultSpecError for bad input."""
    prefix_caching = prefix_caching_from_args(args)
    workloads = sweep_workloads(args.workload or list(DEFAULT_WORKLOADS))
    faults = [None if spec == NO_FAULTS else spec for spec in args.faults or [NO_FAULTS]]
    directions = sweep_directions(args.directions, aa_check=args.aa)
    cells = sweep_cells(
        workloads,
        args.seeds,
        faults,
        directions,
        scale=args.scale,
        max_runs=args.max_runs,
        prefix_caching=prefix_caching,
    )
    return workloads, cells


def _sweep(args: argparse.Namespace) -> int:
    refuse_production_settings("sweep")
    check_backend_args(args)
    check_directory("--reports-dir", args.reports_dir)
    workloads, cells = _matrix(args)
    if args.scale != 1.0 and all(w.content is not None for w in workloads):
        print(
            f"batchgen: warning: every workload is a file, so --scale {args.scale:g} is ignored"
            " (--scale applies to the built-in workloads only)",
            file=sys.stderr,
        )
    make_directory("--reports-dir", args.reports_dir)
    metrics = metrics_config_from_args(os.environ, args)
    with (
        exporting(metrics) as worker_metrics,
        backend_from_args(args) as backend,
        _progress_bar() as progress,
    ):
        deadline = None if args.time_budget is None else time.monotonic() + args.time_budget
        result = run_sweep(
            cells,
            backend,
            reports_dir=args.reports_dir,
            run=run_cell,
            max_retries=args.max_retries,
            deadline=deadline,
            on_progress=_progress_callback(progress, len(cells)),
            on_run=worker_metrics.add_run if worker_metrics is not None else None,
        )
    if args.json:
        facts = {"backend": args.backend, "workers": backend.num_workers}
        print(json.dumps({**result.to_dict(), **facts}))
    else:
        _print_sweep(result, args, backend)
    if result.interrupt is not None:
        raise result.interrupt  # batchgen.cli.main: one line, exit 130 (143 for SIGTERM)
    return EXIT_OK if result.ok else EXIT_FAILED


# ---- rendering ---------------------------------------------------------------------------------
class _RateAndEta(ProgressColumn):
    """Runs ended per minute since the sweep started, and the time left at that rate."""

    def render(self, task) -> Text:
        if not task.completed or not task.elapsed:
            return Text("- runs/min, ETA -")
        per_second = task.completed / task.elapsed
        eta_s = round((task.total - task.completed) / per_second)
        minutes, seconds = divmod(eta_s, 60)
        return Text(
            f"{60 * per_second:.1f} runs/min, ETA {minutes // 60}:{minutes % 60:02}:{seconds:02}"
        )


def _progress_bar() -> Progress:
    return Progress(
        BarColumn(bar_width=20),
        TextColumn("{task.completed}/{task.total} runs, {task.fields[divergences]} divergences,"),
        _RateAndEta(),
        console=Console(stderr=True),
    )


def _progress_callback(progress: Progress, num_runs: int) -> ProgressCallback:
    """A bar of ``num_runs`` runs, and ``on_progress(done, total, divergences)`` that moves it.
    Mutates ``progress``."""
    task_id = progress.add_task("sweep", total=num_runs, divergences=0)

    def on_progress(num_done: int, num_runs: int, num_divergences: int) -> None:
        progress.update(task_id, completed=num_done, divergences=num_divergences)

    return on_progress


def _print_sweep(result: SweepResult, args: argparse.Namespace, backend: SweepBackend) -> None:
    verdict = "INTERRUPTED" if result.interrupt else "PASSED" if result.ok else "FAILED"
    lines = [
        f"batchgen sweep: {verdict}: {result.num_done} of {result.num_runs} runs in"
        f" {result.wall_s:.1f} s ({result.runs_per_minute:.1f} runs/min on {args.backend},"
        f" {backend.num_workers} at once); {headline(result.compare)}",
    ]
    if result.budget_spent:
        lines.append(
            f"time budget of {args.time_budget:g} s spent: {result.num_runs - result.num_done}"
            " runs did not run"
        )
    if result.num_retried:
        lines.append(f"retried: {result.num_retried} runs ended on a later attempt")
    lines += [f"FAIL {failure}" for failure in result.failures]
    lines.append(f"reports: {', '.join(result.reports[kind] for kind in SWEEP_REPORT_FILES)}")
    sys.stdout.write(render_text(result.compare) + "\n".join(lines) + "\n")
