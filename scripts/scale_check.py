"""Scale check: 4096 live requests over a 1,000,000-page GPU pool, bookkeeping only.

Runs a pressure workload on the null model (``kv_storage=False``) for exactly
``--steps`` steps per KV mode (legacy; plan; compare = plan shadowed by legacy,
divergences logged), each mode in a fresh subprocess so one mode's memory does
not pollute another's, and checks that memory stays flat: the resident set read
after ``gc.collect()`` at the last step is within ``--max-rss-ratio`` (1.05) of
the one at ``--rss-from-step`` (100). Exit status 1 when a ratio is over or a
mode fails (an exception, or ``Worker.check_integrity()`` failing at the end).

The workload (``pressure_workload`` in ``scale_workload.py``, details there):
every request arrives at step 0; one in 256 is a long-context anchor that holds
its share of ~97% of the GPU pool for the whole run, the rest are short
decode-heavy requests that ask for 1.2x the room the anchors leave; the host
pool is 1/1000 of the GPU pool. Decode growth keeps evicting the youngest
requests to host, or to recompute when the host pool is full, and finishes let
them back. The driver (``ScaleRun`` in ``scale_run.py``, which also times each
step) keeps the live set at ``--requests``: after each step it takes
the released outputs out of the worker, as a client collecting results would
(the worker itself keeps every output it ever released), and refills each slot
with its next generation (``s17.g3``). ``max_num_seqs`` equals ``--requests``
and the token budget admits the whole initial wave at step 0.

Per mode: step time (mean, p50, p99; the refill's ``add_request`` calls are
timed apart as client time), KV-op time per step (poll, release, evict,
migrate, alloc; in compare mode with the shadow run and the comparison), the
time of the worker's other methods and of the cyclic collector inside steps,
requests served per step, evictions, loads and recompute preemptions, GPU and
host pages in use, the resident set every 100 steps, CPU and wall seconds.

The default (300 steps per mode) takes 2-4 minutes on 2 shared cores, the
figure in docs/benchmarks.md (``--steps 1000``) 7-12 minutes, depending on their load (see
its "Scale" section):

    python scripts/scale_check.py --json-out scale_check.json
    python scripts/scale_check.py --steps 1000 --json-out scale_check_1000.json
    python scripts/scale_check.py --modes plan --steps 150 --profile 25
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from output_path import output_path, write_output
from scale_run import KV_PHASES, WORKER_PHASES, ScaleRun, resident_bytes
from scale_workload import check_fits, pressure_workload

from batchgen.kv.gate import KvGateConfig

MODES = ("legacy", "plan", "compare")
RSS_EVERY = 100  # steps between resident-set readings


# ---- one mode (child process) ----------------------------------------------------------------
def gate_for(mode: str, compare_log: str) -> KvGateConfig:
    if mode == "compare":
        return KvGateConfig(path="plan", compare="log", compare_log=compare_log)
    return KvGateConfig(path=mode)


def run_mode(
    mode: str,
    *,
    num_requests: int,
    num_gpu_pages: int,
    num_steps: int,
    rss_from_step: int,
    seed: int = 0,
    drain_outputs: bool = True,
    profile_top: int = 0,
) -> dict:
    """Run ``num_steps`` steps of the pressure workload in ``mode``; returns the figures as a
    dict."""
    setup_started = time.perf_counter()
    workload = pressure_workload(num_requests, num_gpu_pages, seed=seed)
    with tempfile.TemporaryDirectory(prefix="scale-check-") as tmp:
        run = ScaleRun(
            workload,
            gate_for(mode, str(Path(tmp) / "divergences.jsonl")),
            drain_outputs=drain_outputs,
        )
        del workload
        setup_s = time.perf_counter() - setup_started
        checkpoints = {rss_from_step, num_steps, *range(RSS_EVERY, num_steps + 1, RSS_EVERY)}
        profiler = cProfile.Profile() if profile_top else None
        started, cpu_started = time.perf_counter(), time.process_time()
        for step in range(1, num_steps + 1):
            if profiler is not None:
                profiler.enable()
            run.step()
            if profiler is not None:
                profiler.disable()
            if step in checkpoints:
                run.series.rss_bytes[step] = resident_bytes()
        run_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        try:
            run.worker.check_integrity()  # both pools, and every page table against them
            integrity = "ok"
        except AssertionError as error:
            integrity = f"FAILED: {error}"
        summary = run.worker.kv_compare.end_run() if run.worker.kv_compare is not None else None
    result = summarise(run, mode, rss_from_step=rss_from_step, setup_s=setup_s, run_s=run_s)
    result["cpu_s"], result["integrity"] = cpu_s, integrity
    if summary is not None:
        result["compare"] = {
            "steps_compared": summary.steps_compared,
            "divergences": summary.divergences,
            "harness_errors": summary.harness_errors,
            "compare_s": round(summary.compare_seconds, 3),
        }
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(profile_top)
        result["profile"] = out.getvalue()
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarise(
    run: ScaleRun, mode: str, *, rss_from_step: int, setup_s: float, run_s: float
) -> dict:
    series, worker = run.series, run.worker
    stats = worker.state.stats
    rss_first, rss_last = series.rss_bytes[rss_from_step], series.rss_bytes[len(series.step_s)]
    ms = [s * 1e3 for s in series.step_s]
    return {
        "mode": mode,
        "num_requests": len(run.templates),
        "num_gpu_pages": worker.gpu_kv.num_pages,
        "num_host_pages": worker.host_kv.num_pages,
        "num_steps": len(series.step_s),
        "step_ms": {
            "mean": statistics.fmean(ms),
            "p50": percentile(ms, 0.5),
            "p99": percentile(ms, 0.99),
            "max": max(ms),
        },
        "kv_ms_per_step": statistics.fmean(series.kv_s) * 1e3,
        # gc: collections that ran inside the step, already counted in the phase they interrupted
        "phase_ms_per_step": {
            **{phase: s * 1e3 / len(ms) for phase, s in run.timer.seconds.items()},
            "other": (sum(series.step_s) - run.timer.step_seconds()) * 1e3 / len(ms),
        },
        "client_ms_per_step": statistics.fmean(series.client_s) * 1e3,
        "served_per_step": statistics.fmean(series.num_served),
        "finished": run.num_finished,
        "evictions": stats.evictions,
        "loads": stats.loads,
        "recompute_preemptions": stats.recompute_preemptions,
        "tokens_generated": stats.tokens_generated,
        "gpu_pages_used": {
            "mean": statistics.fmean(series.gpu_pages_used),
            "end": series.gpu_pages_used[-1],
            "peak": stats.peak_gpu_pages,
        },
        "host_pages_used": {
            "mean": statistics.fmean(series.host_pages_used),
            "end": series.host_pages_used[-1],
            "peak": stats.peak_host_pages,
        },
        "live_requests_end": len(worker.state.requests),
        "outputs_retained": len(worker.state.outputs),
        "rss_mib": {str(step): b / 2**20 for step, b in sorted(series.rss_bytes.items())},
        "rss_from_step": rss_from_step,
        "rss_ratio": rss_last / rss_first,
        "setup_s": setup_s,
        "run_s": run_s,
    }


# ---- the parent: one subprocess per mode, a table ----------------------------------------------
def run_child(mode: str, args: argparse.Namespace) -> dict:
    """Run one mode in a fresh interpreter; its figures, or ``{"mode", "error"}``."""
    with tempfile.TemporaryDirectory(prefix="scale-check-") as tmp:
        out = Path(tmp) / f"{mode}.json"
        command = [
            sys.executable,
            __file__,
            "--mode",
            mode,
            "--requests",
            str(args.requests),
            "--gpu-pages",
            str(args.gpu_pages),
            "--steps",
            str(args.steps),
            "--rss-from-step",
            str(args.rss_from_step),
            "--seed",
            str(args.seed),
            "--profile",
            str(args.profile),
            "--torch-threads",
            str(args.torch_threads),
            "--json-out",
            str(out),
        ]
        if args.keep_outputs:
            command.append("--keep-outputs")
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            return {"mode": mode, "error": f"exit {proc.returncode}: " + " | ".join(tail)}
        return json.loads(out.read_text(encoding="utf-8"))


def print_table(results: list[dict], max_ratio: float) -> None:
    from rich.console import Console
    from rich.table import Table

    first = next((r for r in results if "error" not in r), None)
    title = (
        "scale check"
        if first is None
        else (
            f"scale check: {first['num_requests']} requests, {first['num_gpu_pages']:,} GPU / "
            f"{first['num_host_pages']:,} host pages, {first['num_steps']} steps per mode"
        )
    )
    table = Table(title=title)
    columns = (
        "mode",
        "step ms\nmean/p50/p99",
        "KV ms\n/step",
        "client\nms/step",
        "served\n/step",
        "evict / load /\nrecompute",
        "GPU pages\nused (mean)",
        "host pages\nused (mean)",
        "RSS MiB\nfirst -> last",
        "RSS\nratio",
        "integrity",
        "CPU s /\nwall s",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in results:
        if "error" in r:
            table.add_row(r["mode"], f"[red]FAILED: {r['error']}[/red]", *[""] * (len(columns) - 2))
            continue
        step, rss = r["step_ms"], r["rss_mib"]
        ok = r["rss_ratio"] <= max_ratio
        table.add_row(
            r["mode"],
            f"{step['mean']:.0f} / {step['p50']:.0f} / {step['p99']:.0f}",
            f"{r['kv_ms_per_step']:.1f}",
            f"{r['client_ms_per_step']:.1f}",
            f"{r['served_per_step']:,.0f}",
            f"{r['evictions']:,} / {r['loads']:,} / {r['recompute_preemptions']:,}",
            f"{r['gpu_pages_used']['mean']:,.0f}",
            f"{r['host_pages_used']['mean']:,.0f}",
            f"{rss[str(r['rss_from_step'])]:.1f} -> {rss[str(r['num_steps'])]:.1f}",
            f"[{'green' if ok else 'red'}]{r['rss_ratio']:.4f}[/]",
            r["integrity"],
            f"{r['cpu_s']:.0f} / {r['run_s']:.0f}",
        )
    phases = Table(
        title=(
            "where a step goes: ms per step (gc: collections inside the phases, counted in them"
            " too)"
        )
    )
    names = [*KV_PHASES, *WORKER_PHASES, "other", "gc"]
    for column in ("mode", *names):
        phases.add_column(column, justify="left" if column == "mode" else "right")
    for r in results:
        if "error" not in r:
            phases.add_row(r["mode"], *(f"{r['phase_ms_per_step'][name]:.1f}" for name in names))
    console = Console()
    console.width = max(console.width, 150)
    console.print(table)
    console.print(phases)
    for r in results:
        if "compare" in r:
            c = r["compare"]
            console.print(
                f"{r['mode']}: {sum(c['steps_compared'].values()):,} ops compared,"
                f" {sum(c['divergences'].values())} divergences, {c['harness_errors']} harness"
                " errors"
            )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "Each mode runs in its own subprocess; the resident set is read after gc.collect(). "
            "Linux only (/proc/self/statm)."
        ),
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=(
            f"comma list of {', '.join(MODES)} (default all; compare = plan shadowed by legacy,"
            " log)"
        ),
    )
    parser.add_argument(
        "--requests", type=int, default=4096, help="live requests and max_num_seqs (default 4096)"
    )
    parser.add_argument(
        "--gpu-pages",
        type=int,
        default=1_000_000,
        help="GPU pool pages; the host pool is 1/1000 of it (default 1,000,000)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=300,
        help="steps run per mode, exactly (default 300; docs/benchmarks.md's figures use 1000)",
    )
    parser.add_argument(
        "--rss-from-step",
        type=int,
        default=100,
        help="step whose resident set the last step's is compared with (default 100)",
    )
    parser.add_argument(
        "--max-rss-ratio",
        type=float,
        default=1.05,
        help="allowed RSS(last) / RSS(first) (default 1.05)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload and refill seed (default 0)")
    parser.add_argument(
        "--keep-outputs",
        action="store_true",
        help="leave released outputs in the worker (measures what keeping them costs)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help=(
            "cProfile the steps; print the top N functions by own time per mode (default 0: no "
            "profile)"
        ),
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help=(
            "torch intra-op threads in each mode's process (default 1: the null model's tensors "
            "are tiny, and on busy shared cores a thread pool costs more than it gives)"
        ),
    )
    parser.add_argument(
        "--json-out", type=output_path, help="write the figures as JSON to this path"
    )
    # internal: run one mode in this process
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes takes a comma list of {', '.join(MODES)}, got {args.modes!r}")
    args.modes = modes
    if args.requests < 2 or args.gpu_pages < 1 or args.torch_threads < 1:
        parser.error(
            "--requests must be >= 2 (an anchor and a crowd), --gpu-pages and --torch-threads >= 1"
        )
    if not (args.max_rss_ratio > 0 and math.isfinite(args.max_rss_ratio)):
        parser.error(f"--max-rss-ratio must be a positive number, got {args.max_rss_ratio}")
    if args.profile < 0:
        parser.error(f"--profile takes a function count >= 0 (0: no profile), got {args.profile}")
    if args.mode is not None and args.json_out is None:
        parser.error("--mode (internal) needs --json-out")
    if args.steps < 2:
        parser.error(
            "--steps must be >= 2 (the resident set is compared between two steps), got"
            f" {args.steps}"
        )
    if not 1 <= args.rss_from_step < args.steps:
        parser.error(
            f"--rss-from-step must be in [1, --steps), got {args.rss_from_step} with --steps"
            f" {args.steps}"
        )
    if args.mode is None:  # once, before the modes' subprocesses start
        try:
            check_fits(args.requests, args.gpu_pages, seed=args.seed)
        except ValueError as error:
            parser.error(f"--requests {args.requests} with --gpu-pages {args.gpu_pages}: {error}")
    return args


def main() -> int:
    args = parse_args()
    if args.mode is not None:
        torch.set_num_threads(args.torch_threads)
        result = run_mode(
            args.mode,
            num_requests=args.requests,
            num_gpu_pages=args.gpu_pages,
            num_steps=args.steps,
            rss_from_step=args.rss_from_step,
            seed=args.seed,
            drain_outputs=not args.keep_outputs,
            profile_top=args.profile,
        )
        write_output(args.json_out, json.dumps(result, indent=1))
        return 0
    results = []
    for mode in args.modes:
        result = run_child(mode, args)
        results.append(result)
        if "profile" in result:
            print(f"--- {mode}: top {args.profile} functions by own time ---\n{result['profile']}")
    print_table(results, args.max_rss_ratio)
    failed = [
        r["mode"]
        for r in results
        if "error" in r or r["rss_ratio"] > args.max_rss_ratio or r["integrity"] != "ok"
    ]
    if args.json_out is not None:
        report = {
            "machine": {
                "platform": platform.platform(),
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
            },
            "command": " ".join(["python", "scripts/scale_check.py", *sys.argv[1:]]),
            "max_rss_ratio": args.max_rss_ratio,
            "results": results,
            "failed": failed,
        }
        write_output(args.json_out, json.dumps(report, indent=1))
    print(
        "verdict: "
        + (
            "FAIL " + ", ".join(failed)
            if failed
            else f"PASS (every RSS ratio <= {args.max_rss_ratio})"
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
