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

Part 2, end to end: the tiny model runs L2-4096 with compare off (plan path) and on (plan
authoritative, legacy shadow, log mode), interleaved ``--e2e-repeats`` times after a warm-up.
The ratio is of the minimum process CPU times on CPU (the run is compute-bound on one torch
thread), of the minimum wall times with ``--device cuda``.

Goals (ratios measured side by side in this run):

    end to end, L2-4096 compare on / off                        <= 1.05x
    coverage classification: compare / coverage off, worst N    <= 1.05x
    harness on quiet steps (<= 4 touched), largest / smallest N <= 2x

    python scripts/bench_compare.py --json-out bench_compare.json
    python scripts/bench_compare.py --sizes 64,512 --steps 24 --no-e2e
    python scripts/bench_compare.py --profile 4096      # cProfile of compare mode at N=4096
    python scripts/bench_compare.py --no-e2e --collector off  # part 1 without the collector

The cyclic collector's scans cost in proportion to the live heap, so at large N they make part of
every variant's time, and compare mode, which allocates more, triggers more of them; ``--collector
off`` pauses it during the timed steps to show compare mode's own work apart.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import json
import math
import platform
import pstats
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from output_path import output_path, write_output
from rich import box
from rich.console import Console
from rich.table import Table

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig
from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadRequest, builtin_workload
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.model.null_model import NullModel
from compare import DivergenceRecord, read_log

KV_METHODS = ("poll", "release", "evict", "migrate", "allocate")
VARIANTS = ("plan", "legacy", "compare", "coverage_off")
LABELS = {"coverage_off": "coverage off"}
PAGE_SIZE = 16
TOUCHED_BUCKETS = ((0, 4), (5, 32), (33, 256), (257, 2048), (2049, None))
QUIET = "0-4"
GOALS = {"end_to_end": 1.05, "coverage": 1.05, "quiet_harness_growth": 2.0}


# ---- part 1: bookkeeping per step ------------------------------------------------------------
def concurrent_workload(num_requests: int, steps: int, seed: int) -> Workload:
    """About ``num_requests`` live requests for ``steps`` steps, with eviction pressure."""
    rng = random.Random(f"bench-compare:{num_requests}:{seed}")
    requests, prompt_pages = [], 0
    for i in range(num_requests):
        full_pages = rng.randint(1, 4)
        prompt_pages += full_pages + 1
        prompt = [rng.randrange(1, 512) for _ in range(full_pages * PAGE_SIZE + 1)]
        max_new = rng.randint(max(2, steps // 4), 4 * steps)
        requests.append(WorkloadRequest(uuid=f"c{i}", prompt_ids=prompt, max_new_tokens=max_new))
    num_gpu_pages = math.ceil((prompt_pages + num_requests // 2) / 0.98) + 1
    cache = CacheConfig(
        page_size=PAGE_SIZE,
        num_gpu_pages=num_gpu_pages,
        num_host_pages=num_gpu_pages // 10,
        watermark=0.02,
    )
    engine = EngineConfig(
        max_num_seqs=num_requests, max_num_batched_tokens=prompt_pages * PAGE_SIZE + num_requests
    )
    name = f"concurrent-{num_requests}"
    return Workload(name=name, seed=seed, cache=cache, engine=engine, requests=requests)


def no_outcomes(op_name: str, op) -> tuple:
    return ()


def new_worker(workload: Workload, variant: str, log: Path) -> Worker:
    """A bookkeeping-only worker holding every request of ``workload``, set up as ``variant``."""
    gate = KvGateConfig(
        path="legacy" if variant == "legacy" else "plan",
        compare="off" if variant in ("plan", "legacy") else "log",
        compare_log=str(log),
    )
    worker = Worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_gate=gate,
        kv_storage=False,
    )
    if variant == "coverage_off":
        # begin_run hands the executor the instance's hook
        worker.kv_compare._outcomes = no_outcomes
        worker.kv_compare.begin_run(workload.name, seed=workload.seed)
    for request in workload.requests:
        worker.add_request(request.to_request())
    return worker


def wrap_kv_ops(worker: Worker, wrapper: Callable[[Callable], Callable]) -> None:
    """Mutates ``worker._kv``: each KV op method becomes the instance attribute ``wrapper(op)``."""
    for method in KV_METHODS:
        setattr(worker._kv, method, wrapper(getattr(worker._kv, method)))


@functools.cache
def clock_read_seconds() -> float:
    """What one ``time.thread_time()`` read costs (a system call); taken off every timed op."""
    return statistics.median(-time.thread_time() + time.thread_time() for _ in range(2000))


def timed_steps(
    workload: Workload, variant: str, steps: int, log: Path, collector: bool = True
) -> list[float]:
    """Seconds spent in the KV ops, per step, on a fresh worker; with ``collector`` False the
    cyclic garbage collector is paused for the steps."""
    worker = new_worker(workload, variant, log)
    per_step, state, clock_read = [0.0] * steps, worker.state, clock_read_seconds()

    def timer(call: Callable) -> Callable:
        def timed(*args):
            started = time.thread_time()
            result = call(*args)
            per_step[state.step] += max(0.0, time.thread_time() - started - clock_read)
            return result

        return timed

    wrap_kv_ops(worker, timer)
    gc.collect()  # the same collector state for every run; collections inside an op still count
    if not collector:
        gc.disable()
    try:
        for _ in range(steps):
            worker.step()
    finally:
        gc.enable()
    return per_step


def touched_steps(workload: Workload, steps: int, log: Path) -> tuple[list[int], list[int]]:
    """Per step, untimed: the requests the KV ops changed or released, and the requests alive."""
    worker = new_worker(workload, "plan", log)
    state, touched = worker.state, [set() for _ in range(steps)]

    def key(req) -> tuple:
        return req.phase, req.gpu_page_ids, req.host_page_ids, req.num_load_retries

    def probe(call: Callable) -> Callable:
        def probed(*args):
            before = {uuid: key(req) for uuid, req in state.requests.items()}
            result = call(*args)
            live = state.requests
            changed = (u for u, k in before.items() if u not in live or key(live[u]) != k)
            touched[state.step].update(changed)
            return result

        return probed

    wrap_kv_ops(worker, probe)
    alive = []
    for _ in range(steps):
        alive.append(len(state.requests))
        worker.step()
    return [len(t) for t in touched], alive


def bookkeeping(args: argparse.Namespace, log: Path, console: Console) -> list[dict]:
    """Per size: every variant's per-step seconds (minimum over the repeats), touched, alive."""
    timed_steps(concurrent_workload(min(args.sizes), args.steps, args.seed), "compare", 2, log)
    rows = []
    for size in args.sizes:
        workload = concurrent_workload(size, args.steps, args.seed)
        samples: dict[str, list[list[float]]] = {variant: [] for variant in VARIANTS}
        for repeat in range(args.repeats):
            shift = repeat % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                samples[variant].append(
                    timed_steps(workload, variant, args.steps, log, args.collector == "on")
                )
        touched, alive = touched_steps(workload, args.steps, log)
        row = {"num_requests": size, "touched": touched, "alive": alive}
        for variant, runs in samples.items():
            row[f"{variant}_s"] = [min(column) for column in zip(*runs)]
        rows.append(row)
        figures = (
            f"{LABELS.get(v, v)} {sum(row[f'{v}_s']) / args.steps * 1e6:.0f}" for v in VARIANTS
        )
        console.print(f"  N={size}, us/step: " + ", ".join(figures), highlight=False)
    return rows


def harness(row: dict, i: int) -> float:
    return row["compare_s"][i] - row["plan_s"][i] - row["legacy_s"][i]


def summarise_sizes(rows: list[dict]) -> list[dict]:
    """Per size: mean alive and touched, us per step of each variant and of the harness, and the
    coverage ratio compare / coverage off. Pure."""
    out = []
    for row in rows:
        steps = len(row["plan_s"])
        summary = {
            "num_requests": row["num_requests"],
            "mean_alive": statistics.fmean(row["alive"]),
            "mean_touched": statistics.fmean(row["touched"]),
            **{f"{v}_us_per_step": sum(row[f"{v}_s"]) / steps * 1e6 for v in VARIANTS},
            "harness_us_per_step": sum(harness(row, i) for i in range(steps)) / steps * 1e6,
            "coverage_ratio": sum(row["compare_s"]) / sum(row["coverage_off_s"]),
        }
        out.append(summary)
    return out


def bucket_label(low: int, high: int | None) -> str:
    return f"{low}+" if high is None else f"{low}-{high}"


def summarise_touched(rows: list[dict]) -> list[dict]:
    """Median per-step figures of each (N, touched bucket) holding a step. Pure."""
    out = []
    for row in rows:
        for low, high in TOUCHED_BUCKETS:
            steps = [
                i for i, t in enumerate(row["touched"]) if t >= low and (high is None or t <= high)
            ]
            if not steps:
                continue
            medians = {
                f"{v}_us": statistics.median(row[f"{v}_s"][i] for i in steps) * 1e6
                for v in VARIANTS
            }
            out.append(
                {
                    "num_requests": row["num_requests"],
                    "touched": bucket_label(low, high),
                    "num_steps": len(steps),
                    **medians,
                    "harness_us": statistics.median(harness(row, i) for i in steps) * 1e6,
                }
            )
    return out


# ---- part 2: end to end ----------------------------------------------------------------------
def e2e_worker(model, workload: Workload, compare: bool, log: Path, device: str) -> Worker:
    gate = KvGateConfig(path="plan", compare="log" if compare else "off", compare_log=str(log))
    return Worker(
        model,
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_gate=gate,
        device=device,
    )


def end_to_end(repeats: int, device: str, log: Path, console: Console) -> dict:
    """L2-4096 on the tiny model, compare off and on, interleaved; SystemExit if it diverged."""
    model = load_model("tiny", device=device)
    workload = builtin_workload("L2-4096")
    warm_up = workload.model_copy(update={"requests": workload.requests[:4]})
    for on in (False, True):  # first forwards, lazy inits
        run_workload(e2e_worker(model, workload, on, log, device), warm_up)
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    wall: dict[str, list[float]] = {"off": [], "on": []}
    for repeat in range(repeats):
        for variant in ("off", "on") if repeat % 2 == 0 else ("on", "off"):
            worker = e2e_worker(model, workload, variant == "on", log, device)
            started = time.process_time()
            result = run_workload(worker, workload, source="L2-4096")
            cpu[variant].append(time.process_time() - started)
            wall[variant].append(result.wall_s)
            summary = result.compare_summary
            if summary is not None and any(summary.divergences.values()):
                raise SystemExit(f"L2-4096 diverged: {summary.divergences}")
            console.print(
                f"  L2-4096 compare {variant}: {wall[variant][-1]:.2f} s wall,"
                f" {cpu[variant][-1]:.2f} s CPU",
                highlight=False,
            )
    cpu_ratio, wall_ratio = min(cpu["on"]) / min(cpu["off"]), min(wall["on"]) / min(wall["off"])
    return {
        "device": device,
        "cpu_s": cpu,
        "wall_s": wall,
        "cpu_ratio": cpu_ratio,
        "wall_ratio": wall_ratio,
        # compute-bound on one thread on CPU; with CUDA the work is asynchronous
        "basis": "process CPU time" if device == "cpu" else "wall time",
        "ratio": cpu_ratio if device == "cpu" else wall_ratio,
    }


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


def e2e_table(e2e: dict) -> Table:
    runs = len(e2e["cpu_s"]["on"])
    columns = ("compare off CPU s", "compare on CPU s", "on/off CPU", "on/off wall")
    title = f"L2-4096 end to end (tiny model on {e2e['device']}), min of {runs} runs each"
    table = Table(*columns, title=title)
    table.add_row(
        f"{min(e2e['cpu_s']['off']):.2f}",
        f"{min(e2e['cpu_s']['on']):.2f}",
        f"{e2e['cpu_ratio']:.3f}x",
        f"{e2e['wall_ratio']:.3f}x",
    )
    return table


def profile(size: int, steps: int, seed: int, log: Path) -> None:
    """Print the top 30 functions by own time of compare mode's steps at ``size`` requests."""
    workload = concurrent_workload(size, steps, seed)
    profiler = cProfile.Profile()
    profiler.runcall(timed_steps, workload, "compare", steps, log)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


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
