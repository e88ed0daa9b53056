"""The page-content oracle's cost: one workload with BATCHGEN_WORKER_KV_VERIFY=all against off.

Each repeat runs the workload twice on fresh workers of the tiny model, verify ``off`` then ``all``
(the order alternates between repeats), compare mode off: the plain production path with and
without the oracle. The table shows the median wall and process CPU time of each (CPU time is
less disturbed by other processes), the medians of the per-repeat ratios all/off, and the
oracle's own seconds (its hooks, timed inside the run) with the pages it checked. On ``--device
cuda`` the GPU pool lives on the device (CUDA-synchronized timings); the default is CUDA when
there is one. The benchmark exits 1 if the two runs' tokens differ or the oracle logged a
divergence.

    python scripts/bench.py kv-verify --workload L2-2048 --repeats 5 --json-out bench_kv_verify.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from batchgen.engine.runner import run_workload
from batchgen.engine.workloads import BUILTIN_WORKLOADS, load_workload
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import gated_worker

from .ab_timer import interleaved, median_ratio, timed_run
from .output_path import output_path, write_output

MODES = ("off", "all")


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog="Both variants run interleaved in one process; compare the ratio, not the seconds.",
    )
    parser.add_argument(
        "--workload",
        choices=sorted(BUILTIN_WORKLOADS),
        default="L2-2048",
        help="built-in workload (default L2-2048)",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="the workload's --scale (default 1.0)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="pairs of runs, medians shown (default 3)"
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the model and the GPU pool are (default: cuda when available, else cpu)",
    )
    parser.add_argument(
        "--json-out", type=output_path, help="write the figures as JSON to this path"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if not args.scale > 0:
        parser.error(f"--scale must be > 0, not {args.scale}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs CUDA, which this machine lacks")
    return args


def verify_run(model, workload, mode: str, device: str, log: Path) -> dict:
    """One run on a fresh worker with verify ``mode``: wall seconds, the oracle's seconds and
    counts, the tokens. Mutates nothing outside the worker it builds (and ``log``, on a data
    divergence)."""
    gate = KvGateConfig(verify=mode, compare_log=str(log))
    worker = gated_worker(
        model,
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_gate=gate,
        device=device,
    )
    gc.collect()
    timed = timed_run(lambda: run_workload(worker, workload), cuda=device == "cuda")
    result = timed.result
    data = worker.kv_verify.summary() if worker.kv_verify is not None else None
    return {
        "wall_s": timed.wall_s,
        "cpu_s": timed.cpu_s,
        "verify_s": data.seconds if data else 0.0,
        "checked": data.checked if data else {},
        "divergences": sum(data.divergences.values()) if data else 0,
        "tokens": {uuid: list(out.output_ids) for uuid, out in result.outputs.items()},
        "evictions": result.stats.evictions,
    }


def measure(args: argparse.Namespace) -> dict:
    """``--repeats`` pairs of runs, alternating which mode goes first. Pure but for the runs."""
    model = load_model("tiny", device=args.device)
    workload = load_workload(args.workload, scale=args.scale, vocab_size=model.config.vocab_size)
    with tempfile.TemporaryDirectory(prefix="bench-kv-verify-") as directory:
        log = Path(directory) / "kv-divergences.jsonl"  # written only on a data divergence
        runs = interleaved(
            MODES,
            args.repeats,
            lambda mode: verify_run(model, workload, mode, args.device, log),
            rotate=False,
        )

    def column(mode: str, key: str) -> list[float]:
        return [run[key] for run in runs[mode]]

    ratio, ratios = median_ratio(column("all", "wall_s"), column("off", "wall_s"))
    cpu_ratio, _ = median_ratio(column("all", "cpu_s"), column("off", "cpu_s"))
    verified = runs["all"]
    return {
        "workload": args.workload,
        "scale": args.scale,
        "device": args.device,
        "repeats": args.repeats,
        "evictions": verified[0]["evictions"],
        "median_wall_s": {mode: statistics.median(column(mode, "wall_s")) for mode in MODES},
        "median_cpu_s": {mode: statistics.median(column(mode, "cpu_s")) for mode in MODES},
        "ratio_all_off": ratio,
        "ratios": ratios,
        "cpu_ratio_all_off": cpu_ratio,
        "median_verify_s": statistics.median(r["verify_s"] for r in verified),
        "checked": verified[0]["checked"],
        "data_divergences": sum(r["divergences"] for r in verified),
        "tokens_equal": all(
            r["tokens"] == runs["off"][0]["tokens"] for r in runs["off"] + verified
        ),
        "machine": (
            f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
        ),
    }


def print_table(figures: dict) -> None:
    console = Console()
    table = Table(title=f"{figures['workload']} (scale {figures['scale']}), {figures['device']}")
    for column in ("verify", "median wall s", "median CPU s", "oracle s", "pages checked"):
        table.add_column(column, justify="right")
    walls, cpus = figures["median_wall_s"], figures["median_cpu_s"]
    checked = ", ".join(f"{n} {check}" for check, n in sorted(figures["checked"].items()))
    table.add_row("off", f"{walls['off']:.3f}", f"{cpus['off']:.3f}", "-", "-")
    verify_s = f"{figures['median_verify_s']:.3f}"
    table.add_row("all", f"{walls['all']:.3f}", f"{cpus['all']:.3f}", verify_s, checked)
    console.print(table)
    console.print(
        f"ratio all/off: wall {figures['ratio_all_off']:.3f}x, CPU"
        f" {figures['cpu_ratio_all_off']:.3f}x (medians of {figures['repeats']});"
        f" oracle's own share of a verified run: {figures['median_verify_s'] / walls['all']:.1%};"
        f" {figures['evictions']} evictions; {figures['machine']}"
    )


def main(argv: list[str], prog: str) -> int:
    args = parse_args(argv, prog)
    figures = measure(args)
    print_table(figures)
    if args.json_out is not None:
        write_output(args.json_out, json.dumps(figures, indent=2) + "\n")
    if not figures["tokens_equal"] or figures["data_divergences"]:
        print(
            f"{prog}: error: verify changed the tokens or found a data divergence",
            file=sys.stderr,
        )
        return 1
    return 0
