"""Scale check: 4096 live requests over a 1,000,000-page GPU pool, bookkeeping only.

Runs a pressure workload on the null model (``kv_storage=False``) for exactly ``--steps`` steps
per KV mode (legacy; plan; compare = plan shadowed by legacy, divergences logged), each mode in a
fresh subprocess so one mode's memory does not pollute another's, and checks that memory stays
flat: the resident set read after ``gc.collect()`` at the last step is within
``--max-rss-ratio`` (1.05) of the one at ``--rss-from-step`` (100). Prints ``verdict: PASS`` or
``verdict: FAIL <modes>``; exit status 1 when a ratio is over or a mode fails (an exception, or
``Worker.check_integrity()`` failing at the end).

The workload (``pressure_workload`` in ``scale_workload.py``): every request arrives at step 0;
one in 256 is a long-context anchor holding its share of ~97% of the GPU pool throughout, the
rest are short decode-heavy requests asking for 1.2x the room the anchors leave; the host pool is
1/1000 of the GPU pool, so decode growth keeps evicting to host, or to recompute. The driver
(``ScaleRun`` in ``scale_run.py``) takes released outputs out of the worker after each step, as a
client would, and refills each slot with its next generation (``s17.g3``).

Per mode: step time (mean, p50, p99), KV-op time per step (in compare mode with the shadow run
and the comparison), where a step goes (KV ops, scheduling, the worker's other methods, the
cyclic collector), requests served per step, evictions, loads and recomputes, pages in use, the
resident set every 100 steps, CPU and wall seconds.

    python scripts/bench.py scale --json-out scale_check.json
    python scripts/bench.py scale --modes plan --steps 150 --profile 25
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

from batchgen.kv.gate import KvGateConfig

from .output_path import output_path, write_output
from .scale_report import print_report
from .scale_run import ScaleRun, resident_bytes
from .scale_workload import check_fits, pressure_workload

MODES = ("legacy", "plan", "compare")
RSS_EVERY = 100  # steps between resident-set readings
BENCH = Path(__file__).resolve().parents[1] / "bench.py"


# ---- one mode (child process) ----------------------------------------------------------------
def gate_for(mode: str, compare_log: str) -> KvGateConfig:
    if mode == "compare":
        return KvGateConfig(path="plan", compare="log", compare_log=compare_log)
    return KvGateConfig(path=mode)


def run_steps(run: ScaleRun, args: argparse.Namespace) -> dict:
    """Run ``--steps`` steps, reading the resident set at its checkpoints; seconds, integrity."""
    checkpoints = {args.rss_from_step, args.steps, *range(RSS_EVERY, args.steps + 1, RSS_EVERY)}
    profiler = cProfile.Profile() if args.profile else None
    started, cpu_started = time.perf_counter(), time.process_time()
    for step in range(1, args.steps + 1):
        if profiler is None:
            run.step()
        else:
            profiler.runcall(run.step)
        if step in checkpoints:
            run.series.rss_bytes[step] = resident_bytes()
    out = {"run_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu_started}
    try:
        run.worker.check_integrity()  # both pools, and every page table against them
        out["integrity"] = "ok"
    except AssertionError as error:
        out["integrity"] = f"FAILED: {error}"
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
        out["profile"] = text.getvalue()
    return out


def run_mode(args: argparse.Namespace) -> dict:
    """Run ``args.mode`` on the pressure workload; its figures as a dict."""
    setup_started = time.perf_counter()
    workload = pressure_workload(args.requests, args.gpu_pages, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="scale-check-") as tmp:
        run = ScaleRun(workload, gate_for(args.mode, str(Path(tmp) / "divergences.jsonl")))
        del workload  # its lists would inflate the resident set
        setup_s = time.perf_counter() - setup_started
        timings = run_steps(run, args)
        compared = run.worker.kv_compare
        summary = compared.end_run() if compared is not None else None
    result = {**summarise(run, args.mode, args.rss_from_step), **timings, "setup_s": setup_s}
    if summary is not None:
        result["compare"] = {
            "steps_compared": summary.steps_compared,
            "divergences": summary.divergences,
            "harness_errors": summary.harness_errors,
            "compare_s": round(summary.compare_seconds, 3),
        }
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def pages_used(used: list[int], peak: int) -> dict:
    return {"mean": statistics.fmean(used), "end": used[-1], "peak": peak}


def summarise(run: ScaleRun, mode: str, rss_from_step: int) -> dict:
    """The run's figures. Pure."""
    series, worker, stats = run.series, run.worker, run.worker.state.stats
    ms = [s * 1e3 for s in series.step_s]
    rss = series.rss_bytes
    return {
        "mode": mode,
        "num_requests": len(run.templates),
        "num_gpu_pages": worker.gpu_kv.num_pages,
        "num_host_pages": worker.host_kv.num_pages,
        "num_steps": len(ms),
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
        **{
            name: getattr(stats, name)
            for name in ("evictions", "loads", "recompute_preemptions", "tokens_generated")
        },
        "gpu_pages_used": pages_used(series.gpu_pages_used, stats.peak_gpu_pages),
        "host_pages_used": pages_used(series.host_pages_used, stats.peak_host_pages),
        "live_requests_end": len(worker.state.requests),
        "outputs_retained": len(worker.state.outputs),
        "rss_mib": {str(step): b / 2**20 for step, b in sorted(rss.items())},
        "rss_from_step": rss_from_step,
        "rss_ratio": rss[len(ms)] / rss[rss_from_step],
    }


# ---- the parent: one subprocess per mode, a table ----------------------------------------------
def run_child(mode: str, args: argparse.Namespace) -> dict:
    """Run one mode in a fresh interpreter (``bench.py scale --mode``); its figures, or
    ``{"mode", "error"}``."""
    with tempfile.TemporaryDirectory(prefix="scale-check-") as tmp:
        out = Path(tmp) / f"{mode}.json"
        options = {
            "--mode": mode,
            "--requests": args.requests,
            "--gpu-pages": args.gpu_pages,
            "--steps": args.steps,
            "--rss-from-step": args.rss_from_step,
            "--seed": args.seed,
            "--profile": args.profile,
            "--json-out": out,
        }
        flags = (str(x) for item in options.items() for x in item)
        command = [sys.executable, str(BENCH), "scale", *flags]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            return {"mode": mode, "error": f"exit {proc.returncode}: " + " | ".join(tail)}
        return json.loads(out.read_text(encoding="utf-8"))


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog="Each mode runs in its own subprocess. Linux only (/proc/self/statm).",
    )
    add = parser.add_argument
    add("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)} (default all)")
    add("--requests", type=int, default=4096, help="live requests, max_num_seqs (default 4096)")
    add("--gpu-pages", type=int, default=1_000_000, help="GPU pool pages; host: 1/1000 of it")
    add("--steps", type=int, default=300, help="steps run per mode, exactly (default 300)")
    add("--rss-from-step", type=int, default=100, help="first RSS reading's step (default 100)")
    add("--max-rss-ratio", type=float, default=1.05, help="allowed RSS(last) / RSS(first)")
    add("--seed", type=int, default=0, help="workload and refill seed (default 0)")
    add("--profile", type=int, default=0, metavar="N", help="print each mode's top N functions")
    add("--json-out", type=output_path, help="write the figures as JSON to this path")
    add("--mode", choices=MODES, help=argparse.SUPPRESS)  # internal: run one mode here
    return parser


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        parser.error(f"--modes takes a comma list of {', '.join(MODES)}, got {args.modes!r}")
    if args.requests < 2 or args.gpu_pages < 1:
        parser.error("--requests must be >= 2 (an anchor and a crowd), --gpu-pages >= 1")
    if not (args.max_rss_ratio > 0 and math.isfinite(args.max_rss_ratio)):
        parser.error(f"--max-rss-ratio must be a positive number, got {args.max_rss_ratio}")
    if args.profile < 0:
        parser.error(f"--profile takes a function count >= 0 (0: no profile), got {args.profile}")
    if args.mode is not None and args.json_out is None:
        parser.error("--mode (internal) needs --json-out")
    if args.steps < 2:
        parser.error(
            f"--steps must be >= 2 (the resident set is compared between two steps), got"
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


def main(argv: list[str], prog: str) -> int:
    args = parse_args(argv, prog)
    if args.mode is not None:
        torch.set_num_threads(1)  # the null model's tensors are tiny; a thread pool only costs
        write_output(args.json_out, json.dumps(run_mode(args), indent=1))
        return 0
    results = [run_child(mode, args) for mode in args.modes]
    for result in results:
        if "profile" in result:
            print(f"--- {result['mode']}: top {args.profile} by own time ---\n{result['profile']}")
    print_report(results, args.max_rss_ratio)
    failed = [
        r["mode"]
        for r in results
        if "error" in r or r["rss_ratio"] > args.max_rss_ratio or r["integrity"] != "ok"
    ]
    if args.json_out is not None:
        report = {
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "command": " ".join(["python", "scripts/bench.py", "scale", *argv]),
            "max_rss_ratio": args.max_rss_ratio,
            "results": results,
            "failed": failed,
        }
        write_output(args.json_out, json.dumps(report, indent=1))
    verdict = (
        f"FAIL {', '.join(failed)}" if failed else f"PASS (every RSS ratio <= {args.max_rss_ratio})"
    )
    print(f"verdict: {verdict}")
    return 1 if failed else 0
