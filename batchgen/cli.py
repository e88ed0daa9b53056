"""The ``batchgen`` command: flags -> library call -> rendering, nothing more.

::

    batchgen run --workload NAME|FILE [model flags] [KV flags] [--faults SPEC] [--json]   one workload, fresh worker
    batchgen validate [model flags] [--scale X] [--reports-dir DIR] [--json]             back-to-back, compare mode
    batchgen report LOG [LOG...] [--format text|md|junit|json] [--out FILE]              divergence logs -> report
    batchgen replay LOG --index N                                                        re-run one logged op
    batchgen minimize LOG --index N [--out-dir DIR]                                      shrink it, write a test

A subcommand is a ``_add_<name>_command`` (declares its flags, shares
``_add_model_args`` / ``_add_output_args``) and a handler ``args -> exit code``.
Exit codes: 0 done (report: no divergence; replay: reproduced), 1 failed
(validation failed, divergences found, not reproduced), 2 bad input (one
``batchgen: error:`` line on stderr naming what was wrong and what is allowed).
Progress and warnings go to stderr, results to stdout; ``--json`` prints
exactly one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from compare import DivergenceError, DivergenceRecord, RecordError, aggregate, read_log, read_logs, write_atomic
from compare.report import headline, render_json, render_junit, render_markdown, render_text
from batchgen.config import TINY_MODELS
from batchgen.minimize import MinimizeError, minimize_divergence, write_regression
from batchgen.model.loader import ModelLoadError, load_model
from batchgen.replay import ReplayError, ReplayOutcome, replay_record
from batchgen.runner import RunResult, run_workload
from batchgen.validation import DIRECTIONS, ProgressCallback, ValidationReport, compare_overhead, validate_back_to_back
from batchgen.worker import faults as faults_module
from batchgen.worker.faults import FaultInjector, FaultSpec, FaultSpecError
from batchgen.worker.kv_gate import GATE_FLAGS, GateError, KvGateConfig, gate_config
from batchgen.worker.state import Phase
from batchgen.worker.worker import PoolAllocationError, RequestError, Worker
from batchgen.workloads import BUILTIN_WORKLOADS, WorkloadError, load_workload

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
RENDERERS = {"text": render_text, "md": render_markdown, "junit": render_junit, "json": render_json}
STEP_SUMMARY_ENV = "GITHUB_STEP_SUMMARY"  # GitHub Actions' job summary file (markdown, appended to)

# Gate field -> (metavar, what the option means); the variable, option and allowed values come from GATE_FLAGS.
KV_FLAG_HELP = {
    "path": ("plan|legacy", "the authoritative KV path"),
    "compare": ("off|log|raise", "shadow the other path every step: log divergences, or stop at the first"),
    "compare_sample": ("P", "fraction of steps compared, in (0, 1]; seeded, so reproducible"),
    "compare_log": ("FILE", "divergence log, JSON Lines, appended to"),
    "compare_ops": ("OPS", "comma list of the ops compared: poll,release,evict,migrate,alloc"),
    "load_failure": ("recompute|fail", "after a failed load's last retry: recompute the request, or fail it"),
}


class UsageError(ValueError):
    """Flags this machine cannot serve (e.g. ``--device cuda`` without CUDA), or a bad index or file."""


INPUT_ERRORS = (UsageError, WorkloadError, ModelLoadError, RequestError, PoolAllocationError, GateError, FaultSpecError, RecordError,
                ReplayError)


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
    _add_report_command(commands)
    _add_replay_command(commands)
    _add_minimize_command(commands)
    return parser


# ---- run ---------------------------------------------------------------------------------------
def _add_run_command(commands) -> None:
    parser = commands.add_parser(
        "run", help="run one workload on a fresh worker and summarise it",
        description="Run one workload on a fresh worker (its cache sized by the workload), then summarise it.",
        epilog=_run_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", required=True, metavar="NAME|FILE",
                        help=f"a built-in workload ({', '.join(BUILTIN_WORKLOADS)}) or a workload JSON file")
    _add_model_args(parser)
    _add_scale_arg(parser)
    _add_kv_args(parser)
    parser.add_argument("--faults", metavar="SPEC", default=None,
                        help="inject a seeded fault schedule, e.g. 'seed=1,load_fail=0.2,abort=0.05'; SPEC grammar "
                             "below (default: no faults)")
    _add_output_args(parser)
    parser.set_defaults(handler=_run)


def _add_kv_args(parser: argparse.ArgumentParser) -> None:
    """The gate options (default None: the environment, then the built-in default, decides) and engine overrides."""
    for field, (env, option, _) in GATE_FLAGS.items():
        metavar, meaning = KV_FLAG_HELP[field]
        parser.add_argument(option, dest=f"kv_{field}", metavar=metavar, default=None,
                            help=f"{meaning} (default: ${env}, else {_gate_default(field)})")
    parser.add_argument("--kv-load-retries", type=_non_negative_int, metavar="N", default=None,
                        help="retries of a failed host->GPU load before the --kv-load-failure policy applies "
                             "(default: the workload's engine config)")
    parser.add_argument("--kv-load-timeout-steps", type=_positive_int, metavar="N", default=None,
                        help="steps a load may stay incomplete before it counts as failed "
                             "(default: the workload's engine config)")


def _gate_default(field: str) -> str:
    default = KvGateConfig.model_fields[field].default
    if default is None:
        return "the workload's engine config"
    return ",".join(default) if isinstance(default, tuple) else str(default)


def _run_epilog() -> str:
    return ("KV path options: the BATCHGEN_WORKER_KV_* environment overrides the defaults and an option overrides\n"
            "the environment; a bad value or an unknown BATCHGEN_WORKER_KV_* name exits 2.\n\n"
            f"fault SPEC (--faults): comma-separated KEY=VALUE\n{_fault_grammar()}\n"
            "Probabilities are in [0, 1]; the same SPEC replays the same faults.")


def _fault_grammar() -> str:
    """The SPEC table of ``batchgen.worker.faults``' docstring (its indented block after ``::``)."""
    block = (faults_module.__doc__ or "").partition("::")[2].strip("\n").splitlines()
    lines = []
    for line in block:
        if line.strip() and not line.startswith(" "):
            break
        lines.append(line)
    return "\n".join(lines).rstrip() + "\n"


def _run(args: argparse.Namespace) -> int:
    gate = gate_config(os.environ, {field: getattr(args, f"kv_{field}") for field in GATE_FLAGS})
    injector = FaultInjector(FaultSpec.parse(args.faults)) if args.faults is not None else None
    model = _load_model(args)
    workload = load_workload(args.workload, seed=args.seed, scale=args.scale, vocab_size=model.config.vocab_size)
    workload = workload.with_cache(dtype=args.dtype)
    worker = Worker(model, cache_config=workload.cache, engine_config=_engine_config(workload.engine, args),
                    kv_gate=gate, faults=injector, device=args.device)
    for request in workload.requests:  # reject a bad request before the progress bar opens
        worker.validate_request(request.to_request())
    source = args.workload if args.workload in BUILTIN_WORKLOADS else str(Path(args.workload).resolve())
    try:
        with _progress() as progress:
            on_progress = _progress_callback(progress)
            result = run_workload(worker, workload, source=source, scale=args.scale,
                                  on_step=lambda done, total: on_progress(workload.name, done, total))
    except DivergenceError as error:  # --kv-compare raise
        print(f"batchgen: divergence: {'; '.join(str(error).splitlines())} (logged to {gate.compare_log})",
              file=sys.stderr)
        return EXIT_FAILED
    finally:
        if worker.kv_compare is not None:
            worker.kv_compare.sink.close()
    summary = _run_summary(result, worker, args)
    if args.json:
        print(json.dumps(summary))
    else:
        Console().print(_key_value_table(f"batchgen run: {workload.name}", summary))
    return EXIT_OK


def _engine_config(engine, args: argparse.Namespace):
    overrides = {"max_load_retries": args.kv_load_retries, "load_timeout_steps": args.kv_load_timeout_steps}
    return engine.model_copy(update={name: value for name, value in overrides.items() if value is not None})


def _run_summary(result: RunResult, worker: Worker, args: argparse.Namespace) -> dict:
    """The run's counters, what it ran on, its KV path, compare counts (compare mode) and fault counters."""
    gate, engine = worker.kv_gate, worker.engine_config
    summary = {**result.summary(), "live_requests": result.live_requests, **_context(args),
               "kv_path": gate.path, "kv_compare": gate.compare, "max_load_retries": engine.max_load_retries,
               "load_timeout_steps": engine.load_timeout_steps, "load_failure": engine.load_failure}
    compared = result.compare_summary
    if compared is not None:
        summary |= {"kv_shadow_path": compared.shadow, "kv_compare_sample": gate.compare_sample,
                    "steps_compared": dict(compared.steps_compared),
                    "divergences": sum(compared.divergences.values()),
                    "divergences_by_op": dict(compared.divergences),
                    "harness_errors": compared.harness_errors, "compare_log": gate.compare_log}
    num_failed = sum(output.phase is Phase.FAILED for output in result.outputs.values())
    if worker.faults is not None:
        summary |= {"faults": args.faults, "fault_aborts": worker.faults.num_aborts}
    if worker.faults is not None or num_failed:
        summary["failed_requests"] = num_failed
    return summary


# ---- validate ----------------------------------------------------------------------------------
def _add_validate_command(commands) -> None:
    parser = commands.add_parser(
        "validate", help="back-to-back L2-2048 + L2-4096 validation in compare mode, both directions",
        description="Run L2-2048 then L2-4096 on one worker (L2-4096's cache) in compare mode, once per direction: "
                    "legacy serving with the plan shadowed, plan serving with legacy shadowed, and plan shadowed "
                    "by plan (the A/A noise check). Check that no op diverges, that each run leaves nothing "
                    "behind, that tokens match a no-eviction reference (near-ties allowed) and that L2-4096 "
                    "matches a fresh plan-path worker exactly. The BATCHGEN_WORKER_KV_* environment does not "
                    "apply. Writes the divergence log and its reports into --reports-dir. Exit 0 when every "
                    "check passes, 1 otherwise.")
    _add_model_args(parser)
    _add_scale_arg(parser)
    parser.add_argument("--reports-dir", default="reports", metavar="DIR",
                        help="where divergences.jsonl (the log, replaced) and its .md, .xml (JUnit) and .json "
                             "reports go (default: %(default)s)")
    _add_output_args(parser)
    parser.set_defaults(handler=_validate)


def _validate(args: argparse.Namespace) -> int:
    model = _load_model(args)
    with _progress() as progress:
        report = validate_back_to_back(model, seed=args.seed, scale=args.scale, device=args.device,
                                       reports_dir=args.reports_dir, on_progress=_progress_callback(progress))
    if args.json:
        print(json.dumps({**report.to_dict(), **_context(args)}))
    else:
        _print_validation(report)
    return EXIT_OK if report.ok else EXIT_FAILED


# ---- report ------------------------------------------------------------------------------------
def _add_report_command(commands) -> None:
    parser = commands.add_parser(
        "report", help="merge divergence logs into one report",
        description="Merge divergence logs (JSON Lines from compare mode) and report divergences per op and per "
                    "field path. A last line cut short by a crash is skipped with a warning on stderr. Exit 0 "
                    "when there is no divergence, 1 when there are, 2 when an input is unreadable.")
    parser.add_argument("logs", nargs="+", metavar="LOG", help="divergence log files, merged in the order given")
    parser.add_argument("--format", choices=tuple(RENDERERS), default="text",
                        help="text (terminal tables), md (GitHub markdown; also appended to $GITHUB_STEP_SUMMARY "
                             "when it is set), junit (XML, a test case per workload and op) or json "
                             "(default: %(default)s)")
    parser.add_argument("--out", metavar="FILE", default=None,
                        help="write the report to FILE, replaced atomically, instead of stdout (default: stdout)")
    parser.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    logs = read_logs(args.logs)
    _print_warnings(logs.warnings)
    report = aggregate(logs.records)
    text = RENDERERS[args.format](report)
    if args.out is not None:
        _write_out(args.out, text)
        print(f"batchgen: wrote {args.out}: {headline(report)}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if args.format == "md":
        _append_step_summary(text)
    return EXIT_FAILED if report.num_divergences else EXIT_OK


def _write_out(path: str, text: str) -> None:
    """``write_atomic`` for ``--out``; UsageError naming what is in the way when it cannot be written."""
    blocker = next((parent for parent in Path(path).parents if parent.exists() and not parent.is_dir()), None)
    if blocker is not None:
        raise UsageError(f"--out {path}: cannot write the report: {blocker} is not a directory")
    try:
        write_atomic(path, text)
    except OSError as error:
        raise UsageError(f"--out {path}: cannot write the report: {error.strerror or error}") from None


def _append_step_summary(markdown: str) -> None:
    path = os.environ.get(STEP_SUMMARY_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as summary:
            summary.write(markdown)
    except OSError as error:
        raise UsageError(f"${STEP_SUMMARY_ENV}={path}: cannot append the report: {error.strerror}") from None


# ---- replay and minimize -----------------------------------------------------------------------
def _add_replay_command(commands) -> None:
    parser = commands.add_parser(
        "replay", help="re-run one logged divergence from its record alone",
        description="Rebuild the pre-state of one logged divergence from its record, run both KV paths through "
                    "the op, and show the diff. Exit 0 when the divergence reproduces, 1 when it does not.")
    _add_record_args(parser)
    parser.set_defaults(handler=_replay)


def _add_minimize_command(commands) -> None:
    parser = commands.add_parser(
        "minimize", help="shrink a logged divergence to a minimal workload and a regression test",
        description="Delta-debug the workload of one logged divergence (requests, then their steps) down to a "
                    "minimal one that still diverges the same way on the tiny model, and write it with a pytest "
                    "regression test that fails until the bug is fixed. Exit 1 when the divergence does not "
                    "reproduce on its workload.")
    _add_record_args(parser)
    parser.add_argument("--out-dir", default="reports/minimized", metavar="DIR",
                        help="where the workload JSON and the test go (default: %(default)s)")
    parser.add_argument("--max-tests", type=_positive_int, default=400, metavar="N",
                        help="candidate workloads run at most (default: %(default)s)")
    parser.set_defaults(handler=_minimize)


def _add_record_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", metavar="LOG", help="a divergence log (JSON Lines)")
    parser.add_argument("--index", type=_non_negative_int, required=True, metavar="N",
                        help="which divergence: 0 is the log's first divergence record (run summary records are "
                             "not counted)")


def _replay(args: argparse.Namespace) -> int:
    record, count = _divergence_record(args.log, args.index)
    outcome = replay_record(record)
    print(f"record {args.index} of {count} divergence records in {args.log}: {_record_title(record)}")
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
        raise UsageError(f"{args.log}: divergence record {args.index} names no workload_source to minimize")
    original = load_workload(replay["workload_source"], seed=record.seed, scale=replay.get("scale", 1.0))
    print(f"minimizing record {args.index} of {count} in {args.log}: {_record_title(record)}", file=sys.stderr)
    try:
        result = minimize_divergence(record, max_tests=args.max_tests)
    except MinimizeError as error:
        print(f"batchgen: not reproduced: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_FAILED
    slug = result.signature.slug
    workload_path, test_path = Path(args.out_dir) / f"{slug}.json", Path(args.out_dir) / f"test_kv_{slug}.py"
    write_regression(result, workload_path, test_path)
    minimal = result.workload.requests
    print(f"{result.signature.op} {result.signature.kind} divergence ({', '.join(result.signature.field_paths) or '-'})"
          f": requests {len(original.requests)} -> {len(minimal)}, new tokens "
          f"{sum(r.max_new_tokens for r in original.requests)} -> {sum(r.max_new_tokens for r in minimal)}, "
          f"{result.num_tests} tests run")
    print(f"workload: {workload_path}")
    print(f"test:     {test_path}")
    return EXIT_OK


def _divergence_record(log: str, index: int) -> tuple[DivergenceRecord, int]:
    """The ``index``-th divergence record of ``log`` and how many it holds; UsageError when out of range."""
    result = read_log(log)
    _print_warnings(result.warnings)
    records = [record for record in result.records if isinstance(record, DivergenceRecord)]
    if not records:
        raise UsageError(f"{log}: no divergence record to pick; its {len(result.records)} records are all run "
                         f"summaries")
    if index >= len(records):
        raise UsageError(f"--index {index} is out of range: {log} holds {len(records)} divergence records, so "
                         f"--index is 0 to {len(records) - 1} (run summaries are not counted)")
    return records[index], len(records)


def _record_title(record: DivergenceRecord) -> str:
    return (f"{record.op} step {record.step} of {record.workload} (seed {record.seed}, run {record.run_id}), "
            f"authoritative {record.authoritative}, shadow {record.shadow}")


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
    return _int_at_least(text, 0)


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
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
        table.add_row(key, _by_op(value) if isinstance(value, dict) else str(value))
    return table


def _by_op(counts: dict) -> str:
    """``{"alloc": 3, "evict": 0}`` -> ``alloc 3, evict 0`` (``-`` when empty)."""
    return ", ".join(f"{op} {n}" for op, n in sorted(counts.items())) or "-"


# Rows of the validation tables: summary key -> row label (one column per run keeps them 80 columns wide).
VALIDATION_ROWS = {"requests": "requests", "steps": "steps", "tokens_generated": "tokens", "evictions": "evictions",
                   "loads": "loads", "load_failures": "load failures", "recompute_preemptions": "recomputes",
                   "leaked_gpu_pages": "GPU pages held", "leaked_host_pages": "host pages held",
                   "loads_in_flight": "loads in flight", "wall_s": "wall s"}
COMPARE_ROWS = {"steps_compared": "steps compared", "divergences": "divergences"}


def _print_validation(report: ValidationReport) -> None:
    console = Console()
    console.print(f"batchgen validate: {'PASSED' if report.ok else 'FAILED'} in {report.wall_s:.1f} s",
                  highlight=False)
    roles = [direction.role for direction in DIRECTIONS]
    compare_runs = [run for run in report.runs if run.role in roles]
    check_runs = [run for run in report.runs if run.role not in roles]
    if compare_runs:
        console.print(_runs_table("compare runs: workload, authoritative path, shadow path", compare_runs,
                                  {**VALIDATION_ROWS, **COMPARE_ROWS}))
    if check_runs:
        console.print(_runs_table("reference and fresh runs", check_runs, VALIDATION_ROWS))
    for line in _compare_lines(report):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    for failure in report.failures:  # one line each, unwrapped, so they grep well
        console.print(f"FAIL {failure}", highlight=False, markup=False, soft_wrap=True)


def _runs_table(title: str, runs: list, rows: dict[str, str]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD)
    table.add_column("after the run", no_wrap=True)
    for run in runs:
        kv = f"{run.kv_path}\n{run.shadow_path}" if run.shadow_path else run.role
        table.add_column(f"{run.workload}\n{kv}", justify="right")
    for key, label in rows.items():
        table.add_row(label, *(_cell(run.summary.get(key, "")) for run in runs))
    return table


def _cell(value) -> str:
    return str(sum(value.values())) if isinstance(value, dict) else str(value)


def _compare_lines(report: ValidationReport) -> list[str]:
    compare, cache = report.compare, report.cache
    lines = [f"steps compared: {_by_op({s.op: s.num_compared for s in compare.ops})}",
             f"divergences: {compare.num_divergences} ({_by_op({s.op: s.num_divergences for s in compare.ops})}); "
             f"harness errors: {compare.num_harness_errors}"]
    overhead = compare_overhead(compare)
    if overhead is not None:
        compare_wall_s = sum(run.summary["wall_s"] for run in report.runs if run.shadow_path is not None)
        share = f"; {compare.compare_seconds / compare_wall_s:.1%} of the compare runs' wall time" if compare_wall_s else ""
        lines.append(f"compare overhead: {compare.compare_seconds:.2f} s of harness on {compare.authoritative_seconds:.2f}"
                     f" s in the authoritative path ({overhead:.2f}x){share}")
    if report.reports:
        lines.append(f"reports: {', '.join(report.reports.values())}")
    lines.append(f"shared worker cache: {cache.num_gpu_pages} GPU + {cache.num_host_pages} host pages of "
                 f"{cache.page_size} tokens ({cache.dtype}); near-tie tolerance {report.near_tie_tolerance:g}")
    return lines
