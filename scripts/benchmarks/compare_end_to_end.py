"""Part 2 of ``bench.py compare``: L2-4096 end to end on the tiny model: compare off, compare on,
and the legacy path alone (plan / legacy end to end).

The variants run interleaved after a warm-up; on CPU the ratio is of the minimum process CPU
times (the run is compute-bound on one torch thread), with CUDA of the minimum wall times. The
KV ops are also timed on their own (thread CPU time, ``ab_timer.time_kv_ops``): compare's KV share,
the extra seconds its KV ops take over compare off's as a fraction of a compare-off run, is what
compare mode adds to a run, read without the run-to-run noise of the whole run's time.
"""

from __future__ import annotations

import gc
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, builtin_workload
from batchgen.kv.gate import KV_OPS, KvGateConfig
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import gated_worker

from .ab_timer import adding_to, interleaved, time_kv_ops, timed_run

VARIANTS = ("off", "on", "legacy")  # plan path alone, plan with the legacy shadow, legacy alone
LABELS = {"off": "compare off", "on": "compare on", "legacy": "legacy path"}


def e2e_worker(model, workload: Workload, variant: str, log: Path, device: str) -> Worker:
    gate = KvGateConfig(
        path="legacy" if variant == "legacy" else "plan",
        compare="log" if variant == "on" else "off",
        compare_log=str(log),
    )
    return gated_worker(
        model,
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_gate=gate,
        device=device,
    )


def one_run(model, workload: Workload, variant: str, log: Path, device: str) -> dict:
    """One L2-4096 run of ``variant`` on a fresh worker: process CPU, wall and KV-op seconds;
    SystemExit if compare mode saw a divergence."""
    worker = e2e_worker(model, workload, variant, log, device)
    kv_ns = dict.fromkeys(KV_OPS, 0)
    time_kv_ops(worker, adding_to(kv_ns))  # thread CPU time
    gc.collect()  # the same collector state for every run
    timed = timed_run(lambda: run_workload(worker, workload, source="L2-4096"))
    result = timed.result
    run = {"cpu": timed.cpu_s, "wall": result.wall_s, "kv": sum(kv_ns.values()) / 1e9}
    summary = result.compare_summary
    if summary is not None and any(summary.divergences.values()):
        raise SystemExit(f"L2-4096 diverged: {summary.divergences}")
    return run


def end_to_end(repeats: int, device: str, log: Path, console: Console) -> dict:
    """L2-4096 on the tiny model, each variant ``repeats`` times, interleaved (the order rotates);
    SystemExit if compare mode saw a divergence."""
    model = load_model("tiny", device=device)
    workload = builtin_workload("L2-4096")
    warm_up = workload.model_copy(update={"requests": workload.requests[:4]})
    for variant in VARIANTS:  # first forwards, lazy inits
        run_workload(e2e_worker(model, workload, variant, log, device), warm_up)

    def run(variant: str) -> dict:
        done = one_run(model, workload, variant, log, device)
        console.print(
            f"  L2-4096 {LABELS[variant]}: {done['wall']:.2f} s wall, {done['cpu']:.2f} s CPU,"
            f" {done['kv']:.3f} s in KV ops",
            highlight=False,
        )
        return done

    samples = interleaved(VARIANTS, repeats, run)
    runs = {
        v: {key: [r[key] for r in samples[v]] for key in ("cpu", "wall", "kv")} for v in VARIANTS
    }
    return summarise(runs, device)


def summarise(runs: dict[str, dict[str, list[float]]], device: str) -> dict:
    """The end-to-end ratios (of minimum times) and compare mode's KV share: the median extra
    seconds its KV ops take, as a fraction of the median compare-off run. Pure."""
    cpu = {variant: times["cpu"] for variant, times in runs.items()}
    wall = {variant: times["wall"] for variant, times in runs.items()}
    # compute-bound on one thread on CPU; with CUDA the work is asynchronous
    basis = cpu if device == "cpu" else wall
    kv_extra = statistics.median(runs["on"]["kv"]) - statistics.median(runs["off"]["kv"])
    return {
        "device": device,
        "cpu_s": cpu,
        "wall_s": wall,
        "kv_s": {variant: times["kv"] for variant, times in runs.items()},
        "cpu_ratio": min(cpu["on"]) / min(cpu["off"]),
        "wall_ratio": min(wall["on"]) / min(wall["off"]),
        "basis": "process CPU time" if device == "cpu" else "wall time",
        "ratio": min(basis["on"]) / min(basis["off"]),
        "plan_legacy_ratio": min(basis["off"]) / min(basis["legacy"]),
        "compare_kv_share": kv_extra / statistics.median(cpu["off"]),
    }


def e2e_table(e2e: dict) -> Table:
    runs = len(e2e["cpu_s"]["on"])
    basis = "CPU" if e2e["basis"] == "process CPU time" else "wall"
    columns = (*(f"{LABELS[v]} CPU s" for v in VARIANTS), "on/off CPU", "on/off wall")
    columns += (f"plan/legacy {basis}", "compare's KV share")
    title = f"L2-4096 end to end (tiny model on {e2e['device']}), min of {runs} runs each"
    table = Table(*columns, title=title)
    table.add_row(
        *(f"{min(e2e['cpu_s'][v]):.2f}" for v in VARIANTS),
        f"{e2e['cpu_ratio']:.3f}x",
        f"{e2e['wall_ratio']:.3f}x",
        f"{e2e['plan_legacy_ratio']:.3f}x",
        f"+{100 * e2e['compare_kv_share']:.1f}%",
    )
    return table
