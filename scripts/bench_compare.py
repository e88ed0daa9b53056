"""Compare-mode cost: its KV bookkeeping per step, its decision-coverage share, and end to end.

Part 1, bookkeeping. For each ``--sizes`` N, a synthetic trace keeps about N requests live on a
bookkeeping-only worker (``NullModel``, ``kv_storage=False``) for ``--steps`` steps. Four
variants run the same trace, interleaved, ``--repeats`` times each (the order rotates):

    plan           KvGateConfig(path="plan")
    legacy         KvGateConfig(path="legacy")                  what the shadow path costs alone
    compare        KvGateConfig(path="plan", compare="log")     plan authoritative, legacy shadow
    coverage off   compare, with KvCompare's ``_outcomes`` hook returning ()

Only the KV ops are timed (the methods of the worker's ``_kv`` object are wrapped), in thread CPU
time less the clock's read cost; a step's cost is its minimum over the repeats. harness =
compare - plan - legacy: what compare mode adds beyond running both paths (fork, canonical
forms, diff, coverage). coverage = compare / coverage off. An untimed probe counts per step the
requests whose phase, page tables or retry count the ops changed, or that they released:
"touched". Every prompt is 16k+1 tokens (page size 16), so all running requests need a new page
on the same decode steps and almost none in between, and the GPU pool holds the prompts plus half
a page per request: "touched" varies a lot at a fixed N. Step 0 admits all N.

Part 2, end to end: the tiny model runs L2-4096 with compare off (plan path), on (plan
authoritative, legacy shadow, log mode) and on the legacy path alone, interleaved
``--e2e-repeats`` times after a warm-up. The ratios are of the minimum process CPU times on CPU
(the run is compute-bound on one torch thread), of the minimum wall times with ``--device
cuda``; plan / legacy is shown beside the goal, as what the plan path costs a whole run.

Goals (ratios measured side by side in this run):

    end to end, L2-4096 compare on / off                        <= 1.05x
    coverage classification: compare / coverage off, worst N    <= 1.05x
    harness on quiet steps (<= 4 touched), largest / smallest N <= 2x

    python scripts/bench_compare.py --json-out bench_compare.json
    python scripts/bench_compare.py --sizes 64,512 --steps 24 --no-e2e
    python scripts/bench_compare.py --profile 4096      # cProfile of compare mode at N=4096
    python scripts/bench_compare.py --budget 0.02       # only: sample 1.0 under a 2% budget
    python scripts/bench_compare.py --no-e2e --collector off  # part 1 without the collector

The cyclic collector's scans cost in proportion to the live heap, so at large N they make part of
every variant's time, and compare mode, which allocates more, triggers more of them; ``--collector
off`` pauses it during the timed steps to show compare mode's own work apart.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch
from compare_bookkeeping import (
    LABELS,
    QUIET,
    VARIANTS,
    bookkeeping,
    profile,
    summarise_sizes,
    summarise_touched,
)
from compare_budget_run import budget_runs, budget_table
from compare_end_to_end import e2e_table, end_to_end
from output_path import output_path, write_output
from rich import box
from rich.console import Console
from rich.table import Table

from compare import DivergenceRecord, read_log

GOALS = {"end_to_end": 1.05, "coverage": 1.05, "quiet_harness_growth": 2.0}


# ---- report ------------------------------------------------------------------------------------
def goal(value: float | None, at: str, key: str) -> dict:
    """``met`` is None when there is no value to judge."""
    met = None if value is None else value <= GOALS[key]
    return {"value": value, "at": at, "goal": GOALS[key], "met": met}


def verdicts(sizes: list[dict], touched: list[dict], e2e: dict | None) -> dict:
    """Each goal's measured ratio, where it was worst, its target, and whether it was met. The
    quiet-step growth has no value when a quiet harness is <= 0: compare - plan - legacy is then
    within the noise of its three terms, and a ratio of it means nothing."""
    out = {}
    if e2e is not None:
        out["end_to_end"] = goal(e2e["ratio"], f"L2-4096, {e2e['basis']}", "end_to_end")
    worst = max(sizes, key=lambda row: row["coverage_ratio"])
    out["coverage"] = goal(worst["coverage_ratio"], f"N = {worst['num_requests']}", "coverage")
    quiet = {row["num_requests"]: row["harness_us"] for row in touched if row["touched"] == QUIET}
    if len(quiet) >= 2:
        small, large = min(quiet), max(quiet)
        at, growth = f"N = {large} vs {small}", None
        if quiet[small] > 0 and quiet[large] > 0:
            growth = quiet[large] / quiet[small]
        else:
            at += ": a harness <= 0, within the noise"
        out["quiet_harness_growth"] = goal(growth, at, "quiet_harness_growth")
    return out


GOAL_NAMES = {
    "end_to_end": "end to end, compare on / off",
    "coverage": "coverage classification: compare / coverage off, worst N",
    "quiet_harness_growth": "harness on quiet steps (<= 4 touched), largest N / smallest N",
}


def tables(sizes, touched, e2e, results, args) -> list[Table]:
    """The report's tables: per size, per touched bucket, end to end, goals."""
    names = [LABELS.get(v, v) for v in VARIANTS]
    title = (
        f"KV bookkeeping, us per step (mean over {args.steps} steps of each step's minimum over"
        f" {args.repeats} interleaved runs); harness = compare - plan - legacy"
    )
    columns = ("N", "alive", "touched", *names, "harness", "compare / coverage off")
    per_size = Table(*columns, title=title)
    for r in sizes:
        per_size.add_row(
            str(r["num_requests"]),
            f"{r['mean_alive']:.0f}",
            f"{r['mean_touched']:.1f}",
            *(f"{r[f'{v}_us_per_step']:.0f}" for v in VARIANTS),
            f"{r['harness_us_per_step']:.0f}",
            f"{r['coverage_ratio']:.3f}x",
        )
    title = "By requests touched: us per step, medians over the steps in each bucket"
    by_touched = Table("N", "touched", "steps", *names, "harness", title=title)
    for r in touched:
        by_touched.add_row(
            str(r["num_requests"]),
            r["touched"],
            str(r["num_steps"]),
            *(f"{r[f'{v}_us']:.0f}" for v in VARIANTS),
            f"{r['harness_us']:.0f}",
        )
    out = [per_size, by_touched]
    if e2e is not None:
        out.append(e2e_table(e2e))
    goals = Table("goal", "measured", "at", "target", "verdict", title="Goals")
    for key, v in results.items():
        verdict = {True: "met", False: "MISSED", None: "no verdict"}[v["met"]]
        measured = "-" if v["value"] is None else f"{v['value']:.3f}x"
        goals.add_row(GOAL_NAMES[key], measured, v["at"], f"<= {v['goal']}x", verdict)
    return [*out, goals]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Variants run interleaved in one process; read the ratios, not the absolute times.",
    )
    add = parser.add_argument
    add("--sizes", default="64,512,4096", help="comma list of request counts (default %(default)s)")
    add("--steps", type=int, default=40, help="timed steps per run (default 40)")
    add("--repeats", type=int, default=5, help="runs per variant and size (default 5)")
    add("--e2e-repeats", type=int, default=3, help="L2-4096 runs per variant (default 3)")
    add("--no-e2e", action="store_true", help="skip the end-to-end L2-4096 part")
    add("--device", choices=["cpu", "cuda"], default="cpu", help="end-to-end device (default cpu)")
    add("--seed", type=int, default=0, help="seed of the synthetic traces (default 0)")
    add("--profile", type=int, metavar="N", help="only cProfile compare mode at N requests")
    add(
        "--budget",
        type=float,
        metavar="FRACTION",
        help="only run L2-4096 with compare off, at sample 1.0 under this cost budget, and on every"
        " step, --e2e-repeats times each, interleaved (compare_budget_run.py)",
    )
    add(
        "--collector",
        choices=["on", "off"],
        default="on",
        help="off: pause the cyclic garbage collector during part 1's timed steps, which keeps its"
        " scans of the live heap (they grow with N) out of every variant (default %(default)s)",
    )
    add("--markdown", action="store_true", help="print the tables as Markdown")
    add("--json-out", type=output_path, help="write the figures as JSON to this path")
    args = parser.parse_args()
    try:
        args.sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
    except ValueError:
        parser.error(f"--sizes must be a comma list of integers, got {args.sizes!r}")
    if not args.sizes or min(args.sizes) < 1:
        parser.error("--sizes needs at least one size, each >= 1")
    if args.profile is not None and args.profile < 1:
        parser.error(f"--profile takes a request count >= 1, got {args.profile}")
    if args.profile is not None and args.json_out:
        parser.error("--profile prints a profile and measures nothing else: leave out --json-out")
    if args.budget is not None and not 0.0 < args.budget < 1.0:
        parser.error(f"--budget takes a fraction of step time in (0, 1), got {args.budget}")
    if args.steps < 2 or args.repeats < 1 or args.e2e_repeats < 1:
        parser.error("--steps must be >= 2, --repeats and --e2e-repeats >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs CUDA, which this machine lacks")
    return args


def measure(args: argparse.Namespace, log: Path, console: Console) -> tuple[list, dict | None]:
    """Both parts; SystemExit when compare mode logged a divergence."""
    console.print("bookkeeping:", highlight=False)
    rows = bookkeeping(args, log, console)
    e2e = None
    if not args.no_e2e:
        console.print("end to end:", highlight=False)
        e2e = end_to_end(args.e2e_repeats, args.device, log, console)
    records = read_log(log).records if log.exists() else ()
    diverged = [r for r in records if isinstance(r, DivergenceRecord)]
    if diverged:
        raise SystemExit(f"compare mode logged {len(diverged)} divergences, first: {diverged[0]}")
    return rows, e2e


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # the sampler's tiny ops only lose from threads on shared cores
    console = Console(width=200 if args.markdown else 160)
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "divergences.jsonl"
        if args.profile is not None:
            profile(args.profile, args.steps, args.seed, log)
            return
        if args.budget is not None:
            result = budget_runs(args.e2e_repeats, args.budget, log, console)
            table = budget_table(result)
            table.box = box.MARKDOWN if args.markdown else box.HEAVY_HEAD
            console.print(table)
            if args.json_out:
                write_output(args.json_out, json.dumps(result, indent=2) + "\n")
            return
        rows, e2e = measure(args, log, console)
    sizes, touched = summarise_sizes(rows), summarise_touched(rows)
    results = verdicts(sizes, touched, e2e)
    for table in tables(sizes, touched, e2e, results, args):
        table.box = box.MARKDOWN if args.markdown else box.HEAVY_HEAD
        console.print(table)
    if args.json_out:
        record = {
            "machine": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "args": {
                name: getattr(args, name)
                for name in (
                    "sizes",
                    "steps",
                    "repeats",
                    "e2e_repeats",
                    "no_e2e",
                    "seed",
                    "collector",
                )
            },
            "sizes": sizes,
            "touched": touched,
            "end_to_end": e2e,
            "goals": results,
            "per_step": rows,
        }
        write_output(args.json_out, json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
