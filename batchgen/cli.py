"""The ``batchgen`` command: flags -> library call -> rendering, nothing more.

::

    batchgen run --workload NAME|FILE [model flags] [--scale X] [--json]   one workload on a fresh worker
    batchgen validate [model flags] [--scale X] [--json]                   back-to-back L2-2048 + L2-4096

A subcommand is a ``_add_<name>_command`` (declares its flags, shares
``_add_model_args`` / ``_add_output_args``) and a handler ``args -> exit code``.
Exit codes: 0 done, 1 validation failed, 2 bad input (one ``batchgen: error:``
line on stderr naming what was wrong and what is allowed). Progress goes to
stderr, results to stdout; ``--json`` prints exactly one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

import torch
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from batchgen.config import TINY_MODELS
from batchgen.model.loader import ModelLoadError, load_model
from batchgen.runner import run_workload
from batchgen.validation import ProgressCallback, ValidationReport, validate_back_to_back
from batchgen.worker.worker import RequestError, Worker
from batchgen.workloads import BUILTIN_WORKLOADS, WorkloadError, load_workload

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")


class UsageError(ValueError):
    """Flags this machine cannot serve (e.g. ``--device cuda`` without CUDA)."""


INPUT_ERRORS = (UsageError, WorkloadError, ModelLoadError, RequestError)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are the same one ``batchgen: error:`` line as every bad input."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"batchgen: error: {message} (see '{self.prog} --help')\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's), run the subcommand, return its exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:  # --help (0), or a usage error already printed (2)
        return int(exit_request.code or 0)
    try:
        return args.handler(args)
    except INPUT_ERRORS as error:
        print(f"batchgen: error: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="batchgen", description="Batch-generation LLM worker with a paged two-tier (GPU + host) KV cache.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_command(commands)
    _add_validate_command(commands)
    return parser


# ---- subcommands -------------------------------------------------------------------------------
def _add_run_command(commands) -> None:
    parser = commands.add_parser(
        "run", help="run one workload on a fresh worker and summarise it",
        description="Run one workload on a fresh worker (its cache sized by the workload), then summarise it.")
    parser.add_argument("--workload", required=True, metavar="NAME|FILE",
                        help=f"a built-in workload ({', '.join(BUILTIN_WORKLOADS)}) or a workload JSON file")
    _add_model_args(parser)
    _add_scale_arg(parser)
    _add_output_args(parser)
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    model = _load_model(args)
    workload = load_workload(args.workload, seed=args.seed, scale=args.scale, vocab_size=model.config.vocab_size)
    workload = workload.with_cache(dtype=args.dtype)
    worker = Worker(model, cache_config=workload.cache, engine_config=workload.engine, device=args.device)
    with _progress() as progress:
        on_progress = _progress_callback(progress)
        result = run_workload(worker, workload, on_step=lambda done, total: on_progress(workload.name, done, total))
    summary = {**result.summary(), "live_requests": result.live_requests, **_context(args)}
    if args.json:
        print(json.dumps(summary))
    else:
        Console().print(_key_value_table(f"batchgen run: {workload.name}", summary))
    return EXIT_OK


def _add_validate_command(commands) -> None:
    parser = commands.add_parser(
        "validate", help="back-to-back L2-2048 + L2-4096 validation on one worker",
        description="Run L2-2048 then L2-4096 on one worker (L2-4096's cache), check that each leaves nothing "
                    "behind, that tokens match a no-eviction reference (near-ties allowed) and that L2-4096 "
                    "matches a fresh worker exactly. Exit 0 when every check passes, 1 otherwise.")
    _add_model_args(parser)
    _add_scale_arg(parser)
    _add_output_args(parser)
    parser.set_defaults(handler=_validate)


def _validate(args: argparse.Namespace) -> int:
    model = _load_model(args)
    with _progress() as progress:
        report = validate_back_to_back(model, seed=args.seed, scale=args.scale, device=args.device,
                                       on_progress=_progress_callback(progress))
    if args.json:
        print(json.dumps({**report.to_dict(), **_context(args)}))
    else:
        _print_validation(report)
    return EXIT_OK if report.ok else EXIT_FAILED


# ---- shared flags ------------------------------------------------------------------------------
def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", metavar="NAME|DIR",
                        help=f"a built-in model ({', '.join(TINY_MODELS)}; random weights drawn from --seed) "
                             f"or an HF-format model directory (default: %(default)s)")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where the model and the GPU-tier KV pages live (default: %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="dtype of the weights and of the KV pages (default: %(default)s)")
    parser.add_argument("--seed", type=_non_negative_int, default=0,
                        help="seeds the built-in model's weights and the built-in workloads' traces "
                             "(default: %(default)s)")


def _add_scale_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale", type=_positive_float, default=1.0,
                        help="built-in workloads: multiplies the request count (and, above 1, the pools and "
                             "max_num_seqs); ignored for workload files (default: %(default)s)")


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout instead of a table (default: off)")


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


# ---- library glue ------------------------------------------------------------------------------
def _load_model(args: argparse.Namespace):
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine; allowed here: --device cpu")
    return load_model(args.model, device=args.device, dtype=args.dtype, seed=args.seed)


def _context(args: argparse.Namespace) -> dict:
    """The flags a result depends on, recorded next to it."""
    return {"model": args.model, "device": args.device, "dtype": args.dtype, "seed": args.seed, "scale": args.scale}


# ---- rendering ---------------------------------------------------------------------------------
def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total} requests released"), TimeElapsedColumn(),
                    console=Console(stderr=True))


def _progress_callback(progress: Progress) -> ProgressCallback:
    """``on_progress(label, released, total)`` that keeps one bar per label. Mutates ``progress``."""
    task_ids = {}

    def on_progress(label: str, num_released: int, num_requests: int) -> None:
        if label not in task_ids:
            task_ids[label] = progress.add_task(label, total=num_requests)
        progress.update(task_ids[label], completed=num_released)

    return on_progress


def _key_value_table(title: str, values: dict) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in values.items():
        table.add_row(key, str(value))
    return table


# Rows of the validation table: summary key -> row label (one column per run keeps it 80 columns wide).
VALIDATION_ROWS = {"requests": "requests", "steps": "steps", "tokens_generated": "tokens", "evictions": "evictions",
                   "loads": "loads", "load_failures": "load failures", "recompute_preemptions": "recomputes",
                   "leaked_gpu_pages": "GPU pages held", "leaked_host_pages": "host pages held",
                   "loads_in_flight": "loads in flight", "wall_s": "wall s"}


def _print_validation(report: ValidationReport) -> None:
    console = Console()
    table = Table(title=f"batchgen validate: {'PASSED' if report.ok else 'FAILED'} in {report.wall_s:.1f} s",
                  box=box.SIMPLE_HEAD)
    table.add_column("after the run")
    for run in report.runs:
        table.add_column(f"{run.workload}\n{run.role}", justify="right")
    for key, label in VALIDATION_ROWS.items():
        table.add_row(label, *(str(run.summary[key]) for run in report.runs))
    console.print(table)
    cache = report.cache
    console.print(f"shared worker cache: {cache.num_gpu_pages} GPU + {cache.num_host_pages} host pages of "
                  f"{cache.page_size} tokens ({cache.dtype}); near-tie tolerance {report.near_tie_tolerance:g}",
                  highlight=False, soft_wrap=True)
    for failure in report.failures:  # one line each, unwrapped, so they grep well
        console.print(f"FAIL {failure}", highlight=False, markup=False, soft_wrap=True)
