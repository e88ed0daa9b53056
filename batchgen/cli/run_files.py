"""The files ``batchgen run`` writes besides stdout: the ``--outputs`` file, the ``--timeline`` file
and the divergence log, each checked before the model loads and closed however the run ends; the
last stderr line of a run (or a ``generate`` job) that logged divergences."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from batchgen.cli.common import (
    UsageError,
    check_output_file,
)
from batchgen.cli.outputs import OutputsFile
from batchgen.engine.timeline import TimelineRecorder
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import BUILTIN_WORKLOADS
from batchgen.kv.gate import KvGateConfig
from compare import LogWriteError, write_atomic
from compare.wording import plural


def other_files(args: argparse.Namespace, gate: KvGateConfig) -> dict[str, str]:
    """The files of the run that ``--outputs`` must not name (what each is -> its path): the
    workload file, and the divergence log when compare mode writes one. Pure."""
    files = {} if args.workload in BUILTIN_WORKLOADS else {"the workload file": args.workload}
    if gate.compare != "off":
        files["the divergence log"] = gate.compare_log
    return files


def open_outputs(path: str) -> OutputsFile:
    """The ``--outputs`` file, opened (created if new; truncated by ``start``): UsageError, with
    nothing left behind, when it cannot be. Mutates the file system."""
    outputs = OutputsFile(path)
    try:
        outputs.open()
    except OSError as error:
        raise UsageError(
            f"--outputs {path}: cannot open it for writing: {error.strerror or error}"
        ) from None
    return outputs


def check_timeline_path(args: argparse.Namespace, gate: KvGateConfig) -> None:
    """UsageError when ``--timeline`` names no file it can replace, or another file of the run
    (the workload file, the divergence log, the outputs file). Pure."""
    check_output_file("--timeline", args.timeline, "the timeline")
    others = other_files(args, gate) | ({"the outputs file": args.outputs} if args.outputs else {})
    for what, other in others.items():
        if Path(other).resolve() == Path(args.timeline).resolve():
            raise UsageError(f"--timeline {args.timeline}: it is {what}; name another file")


@contextmanager
def writing_timeline(path: str | None, workload: str, recorder: TimelineRecorder) -> Iterator[None]:
    """Write the steps ``recorder`` recorded to ``path`` (None: nowhere) as JSON when the block
    ends, however it ends: a run stopped early keeps the steps it ran. A failed write raises
    OSError only when the block ended well: an error the block raised is the one reported."""
    try:
        yield
    except BaseException:
        if path is not None:
            with suppress(OSError):
                write_atomic(path, _timeline_json(workload, recorder))
        raise
    if path is not None:
        write_atomic(path, _timeline_json(workload, recorder))


def _timeline_json(workload: str, recorder: TimelineRecorder) -> str:
    return json.dumps({"workload": workload, **recorder.timeline().model_dump()}) + "\n"


def open_compare_log(worker: Worker) -> None:
    """Open the worker's divergence log now, if it has one, so an unwritable one fails before the
    work (UsageError naming it and the system's reason). Mutates the log's descriptor."""
    if worker.kv_compare is None:
        return
    try:
        worker.kv_compare.sink.open()
    except OSError as error:
        raise UsageError(
            f"divergence log {worker.kv_gate.compare_log}: cannot open it for writing: "
            f"{error.strerror or error}"
        ) from None


@contextmanager
def closing_compare_log(worker: Worker) -> Iterator[None]:
    """Close the worker's divergence log, if it has one, when the block ends. A failed flush raises
    LogWriteError only when the block ended well: an error the block raised (a failed write, say) is
    the one reported."""
    try:
        yield
    except BaseException:
        if worker.kv_compare is not None:
            with suppress(LogWriteError):
                worker.kv_compare.sink.close()
        raise
    if worker.kv_compare is not None:
        worker.kv_compare.sink.close()


def print_divergences_logged(worker: Worker) -> None:
    """When the worker's run logged divergences (compare mode ``log``, or the page-content oracle):
    one line on stderr saying how many, the log, and the command that reports them. The run still
    succeeded (its output is the authoritative path's); nothing else is printed."""
    compare, verify = worker.kv_compare, worker.kv_verify
    count = sum(compare.executor.stats().num_divergences.values()) if compare is not None else 0
    count += sum(verify.divergences.values()) if verify is not None else 0
    if count:
        log = worker.kv_gate.compare_log
        print(
            f"batchgen: {plural(count, 'divergence')} logged to {log}; see them:"
            f" batchgen report {shlex.quote(log)}",
            file=sys.stderr,
        )


def add_file_args(parser: argparse.ArgumentParser) -> None:
    """``--outputs`` and ``--timeline``. Mutates ``parser``."""
    parser.add_argument(
        "--outputs",
        metavar="FILE",
        default=None,
        help=(
            "write each request as it is released, one JSON line: uuid, phase, finish_reason, "
            "output_ids (format below); the file is replaced (default: not written)"
        ),
    )
    parser.add_argument(
        "--timeline",
        metavar="FILE",
        default=None,
        help=(
            "write the run's timeline as JSON when it ends, however it ends: GPU and host pages "
            "held, evictions, loads, load failures and recomputes, one value per step (compare "
            "mode also puts it in the run summary; `batchgen report --format html` charts it); "
            "the file is replaced (default: not written)"
        ),
    )
