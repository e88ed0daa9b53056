"""Part 2 of ``bench_compare.py``: L2-4096 end to end on the tiny model: compare off, compare on,
and the legacy path alone (plan / legacy end to end).

The variants run interleaved after a warm-up; on CPU the ratio is of the minimum process CPU
times (the run is compute-bound on one torch thread), with CUDA of the minimum wall times. The
KV ops are also timed on their own (thread CPU time): compare's KV share, the extra seconds its
KV ops take over compare off's as a fraction of a compare-off run, is what compare mode adds to a
run, read without the run-to-run noise of the whole run's time.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from compare_bookkeeping import wrap_kv_ops
from rich.console import Console
from rich.table import Table

from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, builtin_workload
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import gated_worker

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


def kv_timer(worker: Worker) -> list[float]:
    """A cell that sums the thread CPU seconds spent in the worker's KV ops (mutates
    ``worker._kv``: each op method becomes a timed instance attribute)."""
    spent = [0.0]

    def timer(call: Callable) -> Callable:
        def timed(*args):
            started = time.thread_time()
            try:
                return call(*args)
            finally:
                spent[0] += time.thread_time() - started

        return timed

    wrap_kv_ops(worker, timer)
    return spent


def end_to_end(repeats: int, device: str, log: Path, console: Console) -> dict:
    """L2-4096 on the tiny model, each variant ``repeats`` times, interleaved (the order rotates);
    SystemExit if compare mode saw a divergence."""
    model = load_model("tiny", device=device)
    workload = builtin_workload("L2-4096")
    warm_up = workload.model_copy(update={"requests": workload.requests[:4]})
    for variant in VARIANTS:  # first forwards, lazy inits
        run_workload(e2e_worker(model, workload, variant, log, device), warm_up)
    runs: dict[str, dict[str, list[float]]] = {
        variant: {"cpu": [], "wall": [], "kv": []} for variant in VARIANTS
    }
    for repeat in range(repeats):
        shift = repeat % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            worker = e2e_worker(model, workload, variant, log, device)
            kv_seconds = kv_timer(worker)
            gc.collect()  # the same collector state for every run
            started = time.process_time()
            result = run_workload(worker, workload, source="L2-4096")
            runs[variant]["cpu"].append(time.process_time() - started)
            runs[variant]["wall"].append(result.wall_s)
            runs[variant]["kv"].append(kv_seconds[0])
            summary = result.compare_summary
            if summary is not None and any(summary.divergences.values()):
                raise SystemExit(f"L2-4096 diverged: {summary.divergences}")
            console.print(
                f"  L2-4096 {LABELS[variant]}: {result.wall_s:.2f} s wall,"
                f" {runs[variant]['cpu'][-1]:.2f} s CPU, {kv_seconds[0]:.3f} s in KV ops",
                highlight=False,
            )
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
