"""What the subcommands share: usage errors, output paths, the model and output flags, model
loading, progress bars, tables and warnings."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from batchgen.cli.arg_types import MAX_THREADS, scale_float, seed_int, threads_int
from batchgen.config import TINY_MODELS
from batchgen.engine.workloads import MAX_SCALE
from batchgen.model.loader import load_model
from batchgen.validation.validate import ProgressCallback

DEVICES = ("cpu", "cuda")


# every dtype a workload's cache.dtype may name (config.DTYPE_SIZES)
DTYPES = ("float32", "bfloat16", "float16")


class StdoutConsole(Console):
    """A rich console on stdout whose closed pipe reaches ``batchgen.cli.main`` as BrokenPipeError
    (one line on stderr, exit 1) instead of rich's own silent exit."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError("stdout was closed")


class UsageError(ValueError):
    """Flags this machine cannot serve (e.g. ``--device cuda`` without CUDA), or a bad index or
    file."""


def check_directory(flag: str, path: str) -> None:
    """UsageError when ``path`` (``flag``'s output directory) is empty, or it or a parent of it is a
    file. Pure."""
    if not path:
        raise UsageError(f"{flag} is empty; name a directory (. for the current one)")
    directory = Path(path)
    blocker = next(
        (p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None
    )
    if blocker is not None:
        raise UsageError(f"{flag} {path}: {blocker} is not a directory")


def check_output_file(flag: str, path: str, what: str) -> None:
    """UsageError when ``path`` (``flag``'s output file, holding ``what``) is empty, a directory, or
    under a file. Pure."""
    if not path:
        raise UsageError(f"{flag} is empty; name a file")
    blocker = next(
        (parent for parent in Path(path).parents if parent.exists() and not parent.is_dir()), None
    )
    if blocker is not None:
        raise UsageError(f"{flag} {path}: cannot write {what}: {blocker} is not a directory")
    if path.endswith(os.sep) or Path(path).is_dir():  # Path drops a trailing slash
        raise UsageError(f"{flag} {path}: cannot write {what}: Is a directory")


def missing_directories(path: str | Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first: what
    ``mkdir(parents=True)`` would create. Pure."""
    directory = Path(path).absolute()
    return [p for p in (directory, *directory.parents) if not os.path.lexists(p)]


def remove_empty(directories: list[Path]) -> None:
    """Remove each of ``directories`` (deepest first) that is still empty: what a failed step
    created. Mutates the file system."""
    for directory in directories:
        with suppress(OSError):
            directory.rmdir()


def make_directory(flag: str, path: str) -> list[Path]:
    """Create ``path`` and its parents for ``flag``'s output, and return those it created (deepest
    first); UsageError naming what is in the way, with the parents it made removed again. Mutates
    the file system."""
    check_directory(flag, path)
    missing = missing_directories(path)
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        remove_empty(missing)  # those created before the failure
        raise UsageError(
            f"{flag} {path}: cannot create the directory: {error.strerror or error}"
        ) from None
    return missing


def add_model_args(parser: argparse.ArgumentParser, *, workload_dtype: bool) -> None:
    """The model flags; ``workload_dtype``: whether ``--dtype`` defaults to the workload's
    cache.dtype (``None``, resolved by the command) instead of float32."""
    parser.add_argument(
        "--model",
        default="tiny",
        metavar="NAME|DIR|FILE.gguf",
        help=(
            f"a built-in model ({', '.join(TINY_MODELS)}; random weights drawn from --seed), "
            "an HF-format model directory, or a GGUF file (default: %(default)s)"
        ),
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the model and the GPU-tier KV pages live (default: %(default)s)",
    )
    _add_dtype_arg(parser, workload_dtype=workload_dtype)
    parser.add_argument(
        "--seed",
        type=seed_int,
        default=0,
        help=(
            "seeds the built-in model's weights and the built-in workloads' traces "
            "(default: %(default)s)"
        ),
    )
    parser.add_argument(
        "--threads",
        type=threads_int,
        default=None,
        metavar="N",
        help=(
            f"torch CPU threads, 1 to {MAX_THREADS} (default: 1 for --model tiny on --device cpu,"
            " whose small matmuls gain nothing from more and, on busy cores, stall in spin-waits;"
            " otherwise torch's default, one per core)"
        ),
    )


def _add_dtype_arg(parser: argparse.ArgumentParser, *, workload_dtype: bool) -> None:
    """``--dtype``, defaulting to float32 or (``workload_dtype``) to the workload's cache.dtype."""
    dtype_default = (
        "; given, it replaces a workload file's cache.dtype (default: the workload's cache.dtype:"
        " a file's, float32 for the built-in workloads)"
        if workload_dtype
        else " (default: %(default)s)"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None if workload_dtype else "float32",
        help=f"dtype of the weights and of the KV pages{dtype_default}",
    )


def add_scale_arg(parser: argparse.ArgumentParser, *, workload_files: bool) -> None:
    """``--scale``; ``workload_files``: whether the command also takes workload files (which it does
    not scale)."""
    parser.add_argument(
        "--scale",
        type=scale_float,
        default=1.0,
        metavar="X",
        help=(
            f"built-in workloads: multiplies the request count, in (0, {MAX_SCALE:g}] (and, above"
            " 1, the pools, the arrival waves and max_num_seqs together: more concurrency at the"
            " same KV pressure)"
        )
        + (
            "; a workload file runs as written (a warning says --scale is ignored)"
            if workload_files
            else (
                "; validate fails a run that never evicts to host, which "
                "a small scale can make too light"
            )
        )
        + " (default: %(default)s)",
    )


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout instead of a table (default: off)",
    )


def cpu_threads(args: argparse.Namespace) -> int:
    """The torch CPU thread count the run uses: ``--threads``, else 1 for the tiny model on the CPU,
    else torch's own default. Pure."""
    if args.threads is not None:
        return args.threads
    return 1 if args.model == "tiny" and args.device == "cpu" else torch.get_num_threads()


def model_from_args(args: argparse.Namespace, dtype: str | None = None):
    """The model ``--model`` names, on ``--device``, in ``dtype`` (default: ``--dtype``); sets
    torch's CPU thread count (``cpu_threads``) first."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--device cuda: CUDA is not available on this machine; allowed here: --device cpu"
        )
    torch.set_num_threads(cpu_threads(args))
    return load_model(args.model, device=args.device, dtype=dtype or args.dtype, seed=args.seed)


def context(args: argparse.Namespace, **applied) -> dict:
    """The flags a result depends on, recorded next to it; ``applied`` gives the value a run used
    where it is not the flag's (``dtype``, ``scale``)."""
    return {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "seed": args.seed,
        "scale": args.scale,
        "threads": torch.get_num_threads(),
        **applied,
    }


def progress_bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} requests released"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )


def progress_callback(progress: Progress) -> ProgressCallback:
    """``on_progress(label, released, total)`` that keeps one bar per label. Mutates
    ``progress``."""
    task_ids = {}

    def on_progress(label: str, num_released: int, num_requests: int) -> None:
        if label not in task_ids:  # a workload's name is text, not rich markup
            task_ids[label] = progress.add_task(escape(label), total=num_requests)
        progress.update(task_ids[label], completed=num_released)

    return on_progress


def key_value_table(title: str, values: dict) -> Table:
    table = Table(title=escape(title))  # names and paths are text, not rich markup
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in values.items():
        table.add_row(escape(key), escape(by_op(value) if isinstance(value, dict) else str(value)))
    return table


def by_op(counts: dict) -> str:
    """``{"alloc": 3, "evict": 0}`` -> ``alloc 3, evict 0`` (``-`` when empty)."""
    return ", ".join(f"{op} {n}" for op, n in sorted(counts.items())) or "-"


# Rows of the validation tables: summary key -> row label (one column per run keeps them 80 columns
# wide).
VALIDATION_ROWS = {
    "requests": "requests",
    "steps": "steps",
    "tokens_generated": "tokens",
    "evictions": "evictions",
    "loads": "loads",
    "load_failures": "load failures",
    "recompute_preemptions": "recomputes",
    "leaked_gpu_pages": "GPU pages held",
    "leaked_host_pages": "host pages held",
    "loads_in_flight": "loads in flight",
    "wall_s": "wall s",
}


COMPARE_ROWS = {"steps_compared": "steps compared", "divergences": "divergences"}


def cell(value) -> str:
    return str(sum(value.values())) if isinstance(value, dict) else str(value)


def print_warnings(warnings: Sequence[str]) -> None:
    """Each warning as one ``batchgen: warning:`` line on stderr."""
    for warning in warnings:
        print(f"batchgen: warning: {warning}", file=sys.stderr)
