"""``batchgen run``: one workload on a fresh worker, with the KV gate flags and fault injection."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path

from batchgen.cli.common import (
    StdoutConsole,
    UsageError,
    add_model_args,
    add_output_args,
    add_scale_arg,
    check_output_file,
    context,
    key_value_table,
    model_from_args,
    non_negative_int,
    positive_int,
    progress_bar,
    progress_callback,
)
from batchgen.cli.outputs import OutputsFile, OutputsWriteError, check_outputs_path
from batchgen.config import CacheConfig
from batchgen.engine import faults as faults_module
from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.runner import MAX_IDLE_STEPS, RunResult, RunStalled, run_workload
from batchgen.engine.state import ABORT_REASON, Phase
from batchgen.engine.timeline import TimelineRecorder
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import BUILTIN_WORKLOADS, Workload, load_workload
from batchgen.exit_codes import EXIT_FAILED, EXIT_OK
from batchgen.kv.gate import GATE_FLAGS, KvGateConfig, gate_config
from batchgen.kv.plan_checks import PlanRejected
from batchgen.model.llama import LlamaForCausalLM
from batchgen.shadow.coverage import unreached_outcomes
from compare import DivergenceError, LogWriteError, write_atomic

# Gate field -> (metavar, what the option means); the variable, option and allowed values come from
# GATE_FLAGS.
KV_FLAG_HELP = {
    "path": ("plan|legacy", "the authoritative KV path"),
    "compare": (
        "off|log|raise",
        "shadow the other path every step: log divergences, or stop at the first",
    ),
    "compare_sample": (
        "P",
        (
            "fraction of steps compared (all ops of a compared step), in (0, 1]; seeded, so "
            "reproducible"
        ),
    ),
    "compare_log": ("FILE", "divergence log, JSON Lines, appended to"),
    "compare_ops": ("OPS", "comma list of the ops compared: poll,release,evict,migrate,alloc"),
    "load_failure": (
        "recompute|fail",
        "after a failed load's last retry: recompute the request, or fail it",
    ),
}


# ---- run ---------------------------------------------------------------------------------------
def add_run_command(commands) -> None:
    parser = commands.add_parser(
        "run",
        help="run one workload on a fresh worker and summarise it",
        description=(
            "Run one workload on a fresh worker (its cache sized by the workload), then"
            " summarise it."
        ),
        epilog=_run_epilog(),
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
    _add_kv_args(parser)
    parser.add_argument(
        "--faults",
        metavar="SPEC",
        default=None,
        help=(
            "inject a seeded fault schedule, e.g. 'seed=1,load_fail=0.2,abort=0.05'; SPEC grammar "
            "below (default: no faults)"
        ),
    )
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
    add_output_args(parser)
    parser.set_defaults(handler=_run)


def _add_kv_args(parser: argparse.ArgumentParser) -> None:
    """The gate options (default None: the environment, then the built-in default, decides) and
    engine overrides."""
    for field, (env, option, _) in GATE_FLAGS.items():
        metavar, meaning = KV_FLAG_HELP[field]
        parser.add_argument(
            option,
            dest=f"kv_{field}",
            metavar=metavar,
            default=None,
            help=f"{meaning} (default: ${env}, else {_gate_default(field)})",
        )
    parser.add_argument(
        "--kv-load-retries",
        type=non_negative_int,
        metavar="N",
        default=None,
        help=(
            "retries of a failed host->GPU load before the --kv-load-failure policy applies "
            "(default: the workload's engine config)"
        ),
    )
    parser.add_argument(
        "--kv-load-timeout-steps",
        type=positive_int,
        metavar="N",
        default=None,
        help=(
            "steps a load may stay incomplete before it counts as failed "
            "(default: the workload's engine config)"
        ),
    )


def _gate_default(field: str) -> str:
    default = KvGateConfig.model_fields[field].default
    if default is None:
        return "the workload's engine config"
    return ",".join(default) if isinstance(default, tuple) else str(default)


def _run_epilog() -> str:
    return (
        "KV path options: the BATCHGEN_WORKER_KV_* environment overrides the defaults and an"
        " option overrides\nthe environment; a bad value or an unknown BATCHGEN_WORKER_KV_* name"
        " exits 2.\n\nfault SPEC (--faults): comma-separated"
        f" KEY=VALUE\n{_fault_grammar()}\nProbabilities are in [0, 1], and load_fail +"
        " load_fail_late + load_hang <= 1; the same SPEC\nreplays the same faults.\n\noutputs FILE"
        ' (--outputs): one JSON line per released request, in release order, e.g.\n  {"uuid":'
        ' "smoke-r0", "phase": "finished", "finish_reason": "length", "output_ids": [413, 431,'
        " 16]}\nphase is finished (finish_reason length, eos or abort) or failed (finish_reason:"
        " the failure, e.g.\n'load failed: ...'); output_ids are the generated tokens, prompt"
        " excluded. The file is created or\ntruncated when the run starts, and each line is"
        " written as its request is released: a run stopped\nearly leaves a whole line for every"
        " request released before it stopped.\n\nExit status: 0 when the run finished, even where"
        " requests failed (a warning says how many and why;\nfailed_requests counts them); 1 on a"
        " divergence (--kv-compare raise), a plan the plan path\nrejected, a divergence log or"
        " --outputs file that stops taking writes (a full disk), or a run that\nstalls (requests"
        f" live and nothing progressing for {MAX_IDLE_STEPS} steps, or twice the load timeout"
        " if\nlonger; e.g. under gpu_refuse=1); 2 on bad input; 130 on Ctrl-C; 143 on SIGTERM."
    )


def _fault_grammar() -> str:
    """The SPEC table of ``batchgen.engine.faults``' docstring (its indented block after ``::``)."""
    block = (faults_module.__doc__ or "").partition("::")[2].strip("\n").splitlines()
    lines = []
    for line in block:
        if line.strip() and not line.startswith(" "):
            break
        lines.append(line)
    return "\n".join(lines).rstrip() + "\n"


# read only while compare mode is on
COMPARE_SETTINGS = ("compare_sample", "compare_log", "compare_ops")


def _run(args: argparse.Namespace) -> int:
    cli = {field: getattr(args, f"kv_{field}") for field in GATE_FLAGS}
    gate = gate_config(os.environ, cli)
    _warn_unused_compare_settings(gate, cli)
    if args.faults is not None:
        FaultSpec.parse(args.faults)  # a bad SPEC stops the run before the model loads
    if args.outputs is not None:  # before the model loads, which can take a minute
        check_outputs_path(args.outputs, _other_files(args, gate))
    if args.timeline is not None:
        _check_timeline_path(args, gate)
    workload, model = _workload_and_model(args)
    _warn_scale_ignored(args)
    faults = args.faults if args.faults is not None else workload.faults  # the option replaces
    injector = FaultInjector(FaultSpec.parse(faults)) if faults is not None else None
    worker = Worker(
        model,
        cache_config=workload.cache,
        engine_config=_engine_config(workload.engine, args),
        kv_gate=gate,
        faults=injector,
        device=args.device,
    )
    for request in workload.requests:  # reject a bad request before the progress bar opens
        worker.validate_request(request.to_request())
    outputs = _open_outputs(args.outputs) if args.outputs is not None else None
    if worker.kv_compare is not None:  # an unwritable log fails now, not after the run
        try:
            worker.kv_compare.sink.open()
        except OSError as error:
            if outputs is not None:
                outputs.discard()  # an earlier outputs file stays whole; a new one goes
            raise UsageError(
                f"divergence log {gate.compare_log}: cannot open it for writing: "
                f"{error.strerror or error}"
            ) from None
    if outputs is not None:
        outputs.start()
    source = (
        args.workload if args.workload in BUILTIN_WORKLOADS else str(Path(args.workload).resolve())
    )
    recorder = TimelineRecorder(worker)
    try:
        with (
            _writing_timeline(args.timeline, workload.name, recorder),
            _closing_compare_log(worker),
            outputs or nullcontext(),
            progress_bar() as progress,
        ):
            on_progress = progress_callback(progress)
            result = run_workload(
                worker,
                workload,
                source=source,
                scale=_applied_scale(args),
                on_step=lambda done, total: on_progress(workload.name, done, total),
                on_release=outputs.write if outputs is not None else None,
                recorder=recorder,
            )
    except DivergenceError as error:  # --kv-compare raise
        return _stopped(
            args,
            workload.name,
            "divergence",
            f"{'; '.join(str(error).splitlines())} (compare log: {gate.compare_log})",
        )
    except RunStalled as error:
        return _stopped(args, workload.name, "stalled", str(error))
    except PlanRejected as error:  # the plan path rejected its own plan: a bug in the plan layer
        log = f" (compare log: {gate.compare_log})" if worker.kv_compare is not None else ""
        return _stopped(args, workload.name, "plan rejected", f"{error}{log}")
    except LogWriteError as error:  # the divergence log stopped taking writes mid-run (a full disk)
        return _stopped(
            args, workload.name, "compare log unwritable", f"divergence log {error.strerror}"
        )
    # the outputs file stopped taking writes mid-run (a full disk)
    except OutputsWriteError as error:
        return _stopped(
            args, workload.name, "outputs file unwritable", f"outputs file {error.strerror}"
        )
    _warn_failed_requests(result)
    summary = _run_summary(result, worker, args, faults)
    if args.json:
        print(json.dumps(summary))
    else:
        StdoutConsole().print(key_value_table(f"batchgen run: {workload.name}", summary))
    return EXIT_OK


def _applied_scale(args: argparse.Namespace) -> float:
    """``--scale`` for a built-in workload; 1.0 for a workload file, which runs as written. Pure."""
    return args.scale if args.workload in BUILTIN_WORKLOADS else 1.0


def _warn_scale_ignored(args: argparse.Namespace) -> None:
    """A warning on stderr when ``--scale`` is given (other than 1) with a workload file, which it
    does not scale."""
    if _applied_scale(args) != args.scale:
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


def _other_files(args: argparse.Namespace, gate: KvGateConfig) -> dict[str, str]:
    """The files of the run that ``--outputs`` must not name (what each is -> its path): the
    workload file, and the divergence log when compare mode writes one. Pure."""
    files = {} if args.workload in BUILTIN_WORKLOADS else {"the workload file": args.workload}
    if gate.compare != "off":
        files["the divergence log"] = gate.compare_log
    return files


def _open_outputs(path: str) -> OutputsFile:
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


def _check_timeline_path(args: argparse.Namespace, gate: KvGateConfig) -> None:
    """UsageError when ``--timeline`` names no file it can replace, or another file of the run
    (the workload file, the divergence log, the outputs file). Pure."""
    check_output_file("--timeline", args.timeline, "the timeline")
    others = _other_files(args, gate) | ({"the outputs file": args.outputs} if args.outputs else {})
    for what, other in others.items():
        if Path(other).resolve() == Path(args.timeline).resolve():
            raise UsageError(f"--timeline {args.timeline}: it is {what}; name another file")


@contextmanager
def _writing_timeline(
    path: str | None, workload: str, recorder: TimelineRecorder
) -> Iterator[None]:
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


@contextmanager
def _closing_compare_log(worker: Worker) -> Iterator[None]:
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


def _stopped(args: argparse.Namespace, workload: str, reason: str, message: str) -> int:
    """Report a run that stopped before its work was done: one line on stderr, and with ``--json``
    one object on stdout (``workload``, ``stopped``: the reason, ``message``). Returns the exit
    code."""
    print(f"batchgen: {reason}: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps({"workload": workload, "stopped": reason, "message": message}))
    return EXIT_FAILED


def _warn_unused_compare_settings(gate: KvGateConfig, cli: dict[str, object]) -> None:
    """A warning on stderr naming each compare setting given (option or variable) while compare mode
    is off."""
    if gate.compare != "off":
        return
    given = [
        GATE_FLAGS[field][1] if cli[field] is not None else GATE_FLAGS[field][0]
        for field in COMPARE_SETTINGS
        if cli[field] is not None or GATE_FLAGS[field][0] in os.environ
    ]
    if given:
        print(
            f"batchgen: warning: compare mode is off, so {', '.join(given)}"
            f" {'is' if len(given) == 1 else 'are'} ignored and no divergence log is written"
            " (--kv-compare log or raise turns it on)",
            file=sys.stderr,
        )


def _engine_config(engine, args: argparse.Namespace):
    overrides = {
        "max_load_retries": args.kv_load_retries,
        "load_timeout_steps": args.kv_load_timeout_steps,
    }
    return engine.model_copy(
        update={name: value for name, value in overrides.items() if value is not None}
    )


def _warn_failed_requests(result: RunResult) -> None:
    """A warning on stderr when requests failed: how many, and each failure with its count."""
    reasons = Counter(
        output.finish_reason for output in result.outputs.values() if output.phase is Phase.FAILED
    )
    if reasons:
        num_failed, why = (
            sum(reasons.values()),
            ", ".join(f"{reason} ({n})" for reason, n in reasons.most_common()),
        )
        print(
            f"batchgen: warning: {num_failed} of {len(result.outputs)} requests failed: {why}; the"
            " run still exits 0 (failed_requests counts them, --outputs names each)",
            file=sys.stderr,
        )


def _request_outcomes(result: RunResult) -> dict[str, int]:
    """How the workload's requests ended: finished (length or eos), aborted (finished by an abort),
    failed. Pure."""
    outputs = result.outputs.values()
    num_failed = sum(output.phase is Phase.FAILED for output in outputs)
    num_aborted = sum(
        output.phase is Phase.FINISHED and output.finish_reason == ABORT_REASON
        for output in outputs
    )
    return {
        "finished_requests": len(outputs) - num_failed - num_aborted,
        "aborted_requests": num_aborted,
        "failed_requests": num_failed,
    }


def _run_summary(
    result: RunResult, worker: Worker, args: argparse.Namespace, faults: str | None
) -> dict:
    """The run's counters (requests by outcome after their total), what it ran on, its KV path,
    compare counts and decision coverage (compare mode) and the fault SPEC it ran under."""
    gate, engine = worker.kv_gate, worker.engine_config
    counters = result.summary()
    requests = {"requests": counters.pop("requests"), **_request_outcomes(result)}
    applied = context(args, dtype=worker.cache_config.dtype, scale=_applied_scale(args))
    summary = {
        "workload": counters.pop("workload"),
        **requests,
        **counters,
        "live_requests": result.live_requests,
        **applied,
        "kv_path": gate.path,
        "kv_compare": gate.compare,
        "max_load_retries": engine.max_load_retries,
        "load_timeout_steps": engine.load_timeout_steps,
        "load_failure": engine.load_failure,
    }
    compared = result.compare_summary
    if compared is not None:
        summary |= {
            "kv_shadow_path": compared.shadow,
            "kv_compare_sample": gate.compare_sample,
            "kv_compare_ops": list(gate.compare_ops),
            "steps_compared": dict(compared.steps_compared),
            "divergences": sum(compared.divergences.values()),
            "divergences_by_op": dict(compared.divergences),
            "harness_errors": compared.harness_errors,
            "coverage": {
                outcome: tally.model_dump() for outcome, tally in compared.coverage.items()
            },
            "coverage_unreached": list(unreached_outcomes(compared)),
            "compare_log": gate.compare_log,
        }
    if worker.faults is not None:
        summary |= {"faults": faults, "fault_aborts": worker.faults.num_aborts}
    return summary
