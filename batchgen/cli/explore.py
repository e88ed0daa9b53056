"""``batchgen explore``: search for workloads that reach the KV decisions not reached yet."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from functools import partial
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from batchgen.cli.arg_types import positive_int, seconds_float, seed_int
from batchgen.cli.backend_args import add_backend_args, backend_from_args, check_backend_args
from batchgen.cli.common import StdoutConsole, add_output_args, check_directory
from batchgen.cli.run_flags import (
    add_prefix_caching_args,
    prefix_caching_from_args,
    refuse_production_settings,
)
from batchgen.exit_codes import EXIT_FAILED, EXIT_OK
from batchgen.metrics.config import add_metrics_args, metrics_config_from_args
from batchgen.metrics.exporter import exporting
from batchgen.shadow.coverage import REQUIRED
from batchgen.validation.explore import (
    ExploreError,
    ExploreResult,
    explore,
    smallest_cover,
    write_corpus,
)

DEFAULT_CORPUS_DIR = "reports/explore"


def add_explore_command(commands) -> None:
    parser = commands.add_parser(
        "explore",
        help=(
            "search for workloads that reach every KV decision outcome and interaction; write "
            "them as a corpus"
        ),
        description=(
            "A coverage-guided search over workload and fault parameters (pool sizes, page size, "
            "watermark, max_num_seqs, token budget, prompt and output lengths, arrival waves, "
            "aborts, every fault kind, both load-failure policies). Each candidate runs in "
            "compare mode raise (plan authoritative, legacy shadowed) on a bookkeeping-only "
            "worker; one that reaches a decision outcome or an interaction (outcomes met in one "
            "op, after a history, or across one step's ops) no earlier one reached is kept. The "
            "search stops when every required outcome and interaction is reached, or the "
            "budget is spent, and writes the fewest kept workloads that reach everything it "
            "reached to --corpus-dir as corpus-NN.json (batchgen validate --corpus DIR runs them). "
            "A candidate that diverges is a bug: its workload and divergence log are kept in "
            "--corpus-dir/divergences for batchgen replay and minimize. Candidates run in "
            "batches of 8 (serially here, or on --backend processes or ray); a batch is drawn "
            "from what earlier batches kept, so a seed gives the same search on any backend. "
            "Exit 0 when every required outcome and interaction was reached and nothing "
            "diverged; 1 otherwise."
        ),
    )
    parser.add_argument(
        "--corpus-dir", default=DEFAULT_CORPUS_DIR, metavar="DIR",
        help="where the corpus goes; its earlier corpus-*.json files are replaced "
        "(default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-runs", type=positive_int, default=400, metavar="N",
        help="candidate workloads to run at most (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--time-budget", type=seconds_float, default=None, metavar="SECONDS",
        help="stop starting candidates after this long (default: no limit)",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=seed_int, default=0, help="search seed (default: %(default)s)"
    )
    add_prefix_caching_args(parser, default="the candidates' cache config: off")
    add_backend_args(parser, default="serial", serial=True)
    add_metrics_args(parser)
    add_output_args(parser)
    parser.set_defaults(handler=_explore)


def _explore(args: argparse.Namespace) -> int:
    refuse_production_settings("explore")
    prefix_caching = prefix_caching_from_args(args)
    check_backend_args(args)
    check_directory("--corpus-dir", args.corpus_dir)
    corpus_dir = Path(args.corpus_dir)
    backend = backend_from_args(args)
    metrics = metrics_config_from_args(os.environ, args)
    try:
        with (
            exporting(metrics) as worker_metrics,
            backend or contextlib.nullcontext(),
            _progress() as progress,
        ):
            task = progress.add_task("explore", total=args.max_runs, reached=0)
            result = explore(
                seed=args.seed,
                max_runs=args.max_runs,
                time_budget=args.time_budget,
                log_dir=corpus_dir / "divergences",
                on_run=lambda runs, reached: progress.update(task, completed=runs, reached=reached),
                backend=backend,
                on_log=None
                if worker_metrics is None
                else partial(worker_metrics.add_run, workload="explore"),
                prefix_caching=prefix_caching,
            )
    except ExploreError as error:  # a harness failure: no corpus is written from half a search
        print(f"batchgen: explore stopped: {error}", file=sys.stderr)
        return EXIT_FAILED
    written = write_corpus(smallest_cover(result.kept), corpus_dir)
    summary = _summary(result, written)
    if args.json:
        print(json.dumps(summary))
    else:
        _print(summary)
    return EXIT_FAILED if result.missed or result.divergences else EXIT_OK


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} candidates, {task.fields[reached]} ids reached"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )


def _summary(result: ExploreResult, written: list[Path]) -> dict:
    """What the search did, JSON-ready. Pure."""
    return {
        "runs": result.num_runs,
        "seconds": round(result.seconds, 1),
        "required": len(REQUIRED),
        "reached": dict(sorted(result.reached.items())),
        "missed": {
            outcome: {"runs": result.num_runs, "seconds": round(result.seconds, 1)}
            for outcome in result.missed
        },
        "corpus": [str(path) for path in written],
        "divergences": [
            {"workload": str(path), "divergence": text} for path, text in result.divergences
        ],
        "stalled": result.num_stalled,
    }


def _print(summary: dict) -> None:
    console = StdoutConsole()
    reached = len([o for o in summary["reached"] if o in REQUIRED])
    lines = [
        f"batchgen explore: {summary['runs']} candidates in {summary['seconds']} s; "
        f"{reached} of {summary['required']} required outcomes and interactions reached",
        *(f"  {outcome}: first by {name}" for outcome, name in summary["reached"].items()),
        *(
            f"  MISSED {outcome} after {spent['runs']} candidates ({spent['seconds']} s)"
            for outcome, spent in summary["missed"].items()
        ),
        f"corpus: {len(summary['corpus'])} workloads: {', '.join(summary['corpus'])}",
        f"stalled candidates (left out): {summary['stalled']}",
        *(f"DIVERGED {d['workload']}: {d['divergence']}" for d in summary["divergences"]),
    ]
    for line in lines:
        console.print(escape(line), highlight=False, soft_wrap=True)
    if summary["divergences"]:
        print(
            "batchgen: a candidate diverged: its workload and divergence log are in "
            "--corpus-dir/divergences (batchgen replay and minimize take the log)",
            file=sys.stderr,
        )
