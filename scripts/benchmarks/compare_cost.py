"""Compare-mode cost: its KV bookkeeping per step, its decision-coverage share, and end to end.

Part 1, bookkeeping (``compare_bookkeeping.py``). For each ``--sizes`` N, a synthetic trace keeps
about N requests live on a bookkeeping-only worker (``NullModel``, ``kv_storage=False``) for
``--steps`` steps. Four variants run the same trace, interleaved, ``--repeats`` times each (the
order rotates):

    plan           KvGateConfig(path="plan")
    legacy         KvGateConfig(path="legacy")                  what the shadow path costs alone
    compare        KvGateConfig(path="plan", compare="log")     plan authoritative, legacy shadow
    coverage off   compare, with KvCompare's ``_outcomes`` hook returning ()

Only the KV ops are timed, in thread CPU time less the clock's read cost; a step's cost is its
minimum over the repeats. harness = compare - plan - legacy: what compare mode adds beyond running
both paths (fork, canonical forms, diff, coverage). coverage = compare / coverage off. An untimed
probe counts per step the requests whose phase, page tables or retry count the ops changed, or
that they released: "touched". Every prompt is 16k+1 tokens (page size 16), so all running
requests need a new page on the same decode steps and almost none in between, and the GPU pool
holds the prompts plus half a page per request: "touched" varies a lot at a fixed N. Step 0
admits all N.

Part 2, end to end (``compare_end_to_end.py``): the tiny model runs L2-4096 with compare off
(plan path), on (plan authoritative, legacy shadow, log mode) and on the legacy path alone,
interleaved ``--e2e-repeats`` times after a warm-up. The ratios are of the minimum process CPU
times on CPU (the run is compute-bound on one torch thread), of the minimum wall times with
``--device cuda``; plan / legacy is shown beside the goal, as what the plan path costs a whole run.

Goals (ratios measured side by side in this run):

    end to end, L2-4096 compare on / off                        <= 1.05x
    coverage classification: compare / coverage off, worst N    <= 1.05x
    harness on quiet steps (<= 4 touched), largest / smallest N <= 2x

    python scripts/bench.py compare --json-out bench_compare.json
    python scripts/bench.py compare --sizes 64,512 --steps 24 --no-e2e
    python scripts/bench.py compare --profile 4096      # cProfile of compare mode at N=4096
    python scripts/bench.py compare --budget 0.02       # only: sample 1.0 under a 2% budget
    python scripts/bench.py compare --no-e2e --collector off  # part 1 without the collector

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
from rich import box
from rich.console import Console

from compare import DivergenceRecord, read_log

from .compare_bookkeeping import bookkeeping, profile, summarise_sizes, summarise_touched
from .compare_budget import budget_runs, budget_table
from .compare_end_to_end import end_to_end
from .compare_report import tables, verdicts
from .output_path import output_path, write_output

RECORDED_ARGS = ("sizes", "steps", "repeats", "e2e_repeats", "no_e2e", "seed", "collector")


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
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
        " step, --e2e-repeats times each, interleaved (compare_budget.py)",
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
    return parser


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
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


def run_budget(args: argparse.Namespace, log: Path, console: Console) -> None:
    """``--budget``: the three L2-4096 variants, their table and (``--json-out``) their JSON."""
    result = budget_runs(args.e2e_repeats, args.budget, log, console)
    table = budget_table(result)
    table.box = box.MARKDOWN if args.markdown else box.HEAVY_HEAD
    console.print(table)
    if args.json_out:
        write_output(args.json_out, json.dumps(result, indent=2) + "\n")


def report(args: argparse.Namespace, rows: list, e2e: dict | None, console: Console) -> None:
    """Both parts' tables and goals, and (``--json-out``) every figure behind them."""
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
            "args": {name: getattr(args, name) for name in RECORDED_ARGS},
            "sizes": sizes,
            "touched": touched,
            "end_to_end": e2e,
            "goals": results,
            "per_step": rows,
        }
        write_output(args.json_out, json.dumps(record, indent=2) + "\n")


def main(argv: list[str], prog: str) -> int:
    args = parse_args(argv, prog)
    torch.set_num_threads(1)  # the sampler's tiny ops only lose from threads on shared cores
    console = Console(width=200 if args.markdown else 160)
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "divergences.jsonl"
        if args.profile is not None:
            profile(args.profile, args.steps, args.seed, log)
            return 0
        if args.budget is not None:
            run_budget(args, log, console)
            return 0
        rows, e2e = measure(args, log, console)
    report(args, rows, e2e, console)
    return 0
