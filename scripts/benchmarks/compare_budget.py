"""``bench.py compare --budget``: compare mode at sample 1.0 with a cost budget on L2-4096, beside
compare off and compare on every step.

Three variants of the tiny model's L2-4096 run, interleaved (the order rotates) after a warm-up,
each with a ``gc.collect()`` before it::

    off      KvGateConfig(path="plan")                                  no compare mode
    budget   ... compare="log", compare_sample=1.0, compare_budget=B    the budget moves the rate
    full     ... compare="log", compare_sample=1.0                      every step compared

Per run: process CPU seconds (the run is compute-bound on one torch thread), the share of steps
compared (the governor's count), and compare mode's share of step time as the budget measured it
(for ``full``: its harness seconds over the run's wall time). Ratios are of the minimum CPU times;
the spread is each variant's (max - min) / min over its runs.
"""

from __future__ import annotations

import gc
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from batchgen.engine.runner import run_workload
from batchgen.engine.workloads import builtin_workload
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import gated_worker

from .ab_timer import interleaved, timed_run

VARIANTS = ("off", "budget", "full")


def budget_gate(variant: str, budget: float, log: Path) -> KvGateConfig:
    if variant == "off":
        return KvGateConfig(path="plan")
    return KvGateConfig(
        path="plan",
        compare="log",
        compare_sample=1.0,
        compare_budget=budget if variant == "budget" else None,
        compare_log=str(log),
    )


def one_run(model, workload, variant: str, budget: float, log: Path) -> dict:
    """One L2-4096 run of ``variant``: its CPU and wall seconds and what compare mode compared."""
    worker = gated_worker(
        model,
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_gate=budget_gate(variant, budget, log),
    )
    gc.collect()  # the same collector state for every run
    timed = timed_run(lambda: run_workload(worker, workload, source="L2-4096"))
    result = timed.result
    run = {"cpu": timed.cpu_s, "wall": result.wall_s, "steps": result.num_steps}
    summary = result.compare_summary
    if summary is not None and any(summary.divergences.values()):
        raise SystemExit(f"L2-4096 diverged: {summary.divergences}")
    governor = worker.kv_compare.governor if worker.kv_compare is not None else None
    if governor is not None:
        run["compared_steps"] = governor.sampled_share
        run["compare_share"] = governor.budget.share
        run["final_rate"] = worker.kv_compare.executor.sample_rate
    elif summary is not None:
        run["compared_steps"] = 1.0
        run["compare_share"] = summary.compare_seconds / result.wall_s
    return run


def budget_runs(repeats: int, budget: float, log: Path, console: Console) -> dict:
    """Every variant ``repeats`` times, interleaved; the runs and their summary."""
    model = load_model("tiny")
    workload = builtin_workload("L2-4096")
    warm_up = workload.model_copy(update={"requests": workload.requests[:4]})
    for variant in VARIANTS:
        one_run(model, warm_up, variant, budget, log)

    def run(variant: str) -> dict:
        done = one_run(model, workload, variant, budget, log)
        share = f", {done['compared_steps']:.1%} of steps compared" if variant != "off" else ""
        console.print(f"  L2-4096 {variant}: {done['cpu']:.2f} s CPU{share}", highlight=False)
        return done

    runs = interleaved(VARIANTS, repeats, run)
    return {"budget": budget, "runs": runs, "summary": summarise(runs)}


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per variant: min CPU, spread, ratio to off, median compared share of steps and of time."""
    base = min(run["cpu"] for run in runs["off"])
    rows = {}
    for variant, mine in runs.items():
        cpu = sorted(run["cpu"] for run in mine)
        row = {"min_cpu": cpu[0], "spread": (cpu[-1] - cpu[0]) / cpu[0], "ratio": cpu[0] / base}
        if variant != "off":
            row["compared_steps"] = statistics.median(run["compared_steps"] for run in mine)
            row["compare_share"] = statistics.median(run["compare_share"] for run in mine)
        rows[variant] = row
    return rows


def budget_table(result: dict) -> Table:
    runs = len(result["runs"]["off"])
    title = (
        f"L2-4096 end to end (tiny model, CPU), compare budget {result['budget']:.0%}:"
        f" min of {runs} runs each"
    )
    columns = ("variant", "min CPU s", "spread", "/ off", "steps compared", "compare's share")
    table = Table(*columns, title=title)
    for variant, row in result["summary"].items():
        table.add_row(
            variant,
            f"{row['min_cpu']:.2f}",
            f"{row['spread']:.0%}",
            f"{row['ratio']:.3f}x",
            f"{row['compared_steps']:.1%}" if "compared_steps" in row else "-",
            f"{row['compare_share']:.2%}" if "compare_share" in row else "-",
        )
    return table
