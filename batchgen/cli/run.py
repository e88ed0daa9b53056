"""``batchgen run``: one workload on a fresh worker, with the KV gate flags and fault injection."""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

from batchgen.cli.common import (
    StdoutConsole,
    UsageError,
    add_model_args,
    add_output_args,
    add_scale_arg,
    key_value_table,
    model_from_args,
    progress_bar,
    progress_callback,
)
from batchgen.cli.outputs import OutputsFile, OutputsWriteError, check_outputs_path
from batchgen.cli.run_files import (
    add_file_args,
    check_timeline_path,
    closing_compare_log,
    open_compare_log,
    open_outputs,
    other_files,
    print_divergences_logged,
    writing_timeline,
)
from batchgen.cli.run_flags import (
    add_kv_args,
    applied_scale,
    engine_config_from_args,
    gate_from_args,
    run_epilog,
)
from batchgen.cli.run_summary import run_summary, warn_failed_requests
from batchgen.config import CacheConfig
from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.runner import RunResult, RunStalled, run_workload
from batchgen.engine.timeline import TimelineRecorder
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import BUILTIN_WORKLOADS, Workload, load_workload
from batchgen.exit_codes import EXIT_FAILED, EXIT_OK
from batchgen.finish.gate import FINISH_GATES
from batchgen.kv.gate import KvGateConfig
from batchgen.kv.plan_checks import PlanRejected
from batchgen.metrics.config import add_metrics_args, metrics_config_from_args
from batchgen.metrics.exporter import exporting
from batchgen.metrics.worker_metrics import WorkerMetrics
from batchgen.model.llama import LlamaForCausalLM
from batchgen.shadow.wiring import gated_worker
from compare import DivergenceError, LogWriteError


def add_run_command(commands) -> None:
    parser = commands.add_parser(
        "run",
        help="run one workload on a fresh worker and summarise it",
        description=(
            "Run one workload on a fresh worker (its cache sized by the workload), then"
            " summarise it."
        ),
        epilog=run_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workload",
        required=True,
        metavar="NAME|FILE",
        help=f"a built-in workload ({', '.join(BUILTIN_WORKLOADS)}) or a workload JSON file",
    )
    add_model_args(parser, workload_dtype=True)
    add_scale_arg(parser, workload_files=True)
    add_kv_args(parser)
    parser.add_argument(
        "--faults",
        metavar="SPEC",
        default=None,
        help=(
            "inject a seeded fault schedule, e.g. 'seed=1,load_fail=0.2,abort=0.05'; SPEC grammar "
            "below (default: no faults)"
        ),
    )
    add_file_args(parser)
    add_metrics_args(parser)
    add_output_args(parser)
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    gate = _checked_gate(args)
    finish_gate = FINISH_GATES.parse_options(os.environ, args)
    metrics = metrics_config_from_args(os.environ, args)
    workload, model = _workload_and_model(args)
    _warn_scale_ignored(args)
    faults = args.faults if args.faults is not None else workload.faults  # the option replaces
    worker = gated_worker(
        model,
        cache_config=workload.cache,
        engine_config=engine_config_from_args(workload.engine, args),
        kv_gate=gate,
        finish_gate=finish_gate,
        faults=FaultInjector(FaultSpec.parse(faults)) if faults is not None else None,
        device=args.device,
    )
    for request in workload.requests:  # reject a bad request before the progress bar opens
        worker.validate_request(request.to_request())
    outputs = _open_files(args, worker)
    try:
        with exporting(metrics) as worker_metrics:
            result = _run_to_the_end(args, worker, workload, outputs, worker_metrics)
    except STOPS as error:
        return _stopped(args, workload.name, *_why_stopped(error, worker))
    warn_failed_requests(result)
    summary = run_summary(result, worker, args, faults)
    if args.json:
        print(json.dumps(summary))
    else:
        StdoutConsole().print(key_value_table(f"batchgen run: {workload.name}", summary))
    print_divergences_logged(worker)
    return EXIT_OK


def _checked_gate(args: argparse.Namespace) -> KvGateConfig:
    """The KV gate from the flags over the environment, with every flag that names a file or a
    fault SPEC checked before the model loads (which can take a minute)."""
    gate = gate_from_args(args)
    if args.faults is not None:
        FaultSpec.parse(args.faults)
    if args.outputs is not None:
        check_outputs_path(args.outputs, other_files(args, gate))
    if args.timeline is not None:
        check_timeline_path(args, gate)
    return gate


def _open_files(args: argparse.Namespace, worker: Worker) -> OutputsFile | None:
    """Open the ``--outputs`` file and the divergence log, so an unwritable one fails now, not
    after the run; an outputs file is started (truncated) only once both opened."""
    outputs = open_outputs(args.outputs) if args.outputs is not None else None
    try:
        open_compare_log(worker)
    except UsageError:
        if outputs is not None:
            outputs.discard()  # an earlier outputs file stays whole; a new one goes
        raise
    if outputs is not None:
        outputs.start()
    return outputs


def _run_to_the_end(
    args: argparse.Namespace,
    worker: Worker,
    workload: Workload,
    outputs: OutputsFile | None,
    metrics: WorkerMetrics | None,
) -> RunResult:
    """``run_workload`` with a progress bar, the timeline, divergence log and outputs file each
    written and closed however the run ends, and ``metrics`` watching it."""
    source = (
        args.workload if args.workload in BUILTIN_WORKLOADS else str(Path(args.workload).resolve())
    )
    recorder = TimelineRecorder(worker)
    with (
        writing_timeline(args.timeline, workload.name, recorder),
        closing_compare_log(worker),
        outputs or nullcontext(),
        progress_bar() as progress,
    ):
        on_progress = progress_callback(progress)
        return run_workload(
            worker,
            workload,
            source=source,
            scale=applied_scale(args),
            on_step=lambda done, total: on_progress(workload.name, done, total),
            on_release=outputs.write if outputs is not None else None,
            recorder=recorder,
            metrics=metrics,
        )


# what ends a run before its work is done, with exit 1 and one line saying why (_why_stopped)
STOPS = (DivergenceError, RunStalled, PlanRejected, LogWriteError, OutputsWriteError)


def _why_stopped(error: Exception, worker: Worker) -> tuple[str, str]:
    """The reason and message of a run that ``error`` (one of ``STOPS``) stopped. Pure."""
    log = worker.kv_gate.compare_log
    if isinstance(error, DivergenceError):  # --kv-compare raise
        return "divergence", f"{'; '.join(str(error).splitlines())} (compare log: {log})"
    if isinstance(error, RunStalled):
        return "stalled", str(error)
    if isinstance(error, PlanRejected):  # the plan path rejected its own plan: a plan-layer bug
        return "plan rejected", f"{error} (compare log: {log})" if worker.kv_compare else str(error)
    if isinstance(error, LogWriteError):  # the divergence log stopped taking writes (a full disk)
        return "compare log unwritable", f"divergence log {error.strerror}"
    return "outputs file unwritable", f"outputs file {error.strerror}"  # OutputsWriteError


def _warn_scale_ignored(args: argparse.Namespace) -> None:
    """A warning on stderr when ``--scale`` is given (other than 1) with a workload file, which it
    does not scale."""
    if applied_scale(args) != args.scale:
        print(
            f"batchgen: warning: --workload is a file, so --scale {args.scale:g} is ignored and the"
            " file runs as written (--scale applies to the built-in workloads only)",
            file=sys.stderr,
        )


def _workload_and_model(args: argparse.Namespace) -> tuple[Workload, LlamaForCausalLM]:
    """The workload and the model, in one dtype for the weights and the KV pages: ``--dtype`` when
    given, else the workload's cache.dtype. A workload file is read first (its dtype is the
    model's); a built-in trace is drawn after the model loads (its token ids come from the model's
    vocabulary), in CacheConfig's default dtype."""
    if args.workload in BUILTIN_WORKLOADS:
        model = model_from_args(args, args.dtype or CacheConfig.model_fields["dtype"].default)
        workload = load_workload(
            args.workload, seed=args.seed, scale=args.scale, vocab_size=model.config.vocab_size
        )
    else:
        workload = load_workload(args.workload)
        model = model_from_args(args, args.dtype or workload.cache.dtype)
    return workload.with_cache(dtype=args.dtype or workload.cache.dtype), model


def _stopped(args: argparse.Namespace, workload: str, reason: str, message: str) -> int:
    """Report a run that stopped before its work was done: one line on stderr, and with ``--json``
    one object on stdout (``workload``, ``stopped``: the reason, ``message``). Returns the exit
    code."""
    print(f"batchgen: {reason}: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps({"workload": workload, "stopped": reason, "message": message}))
    return EXIT_FAILED
