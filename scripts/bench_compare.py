"""Compare-mode cost: KV bookkeeping per step against plan-only, and end to end.

Part 1, bookkeeping. For each ``--sizes`` N, a synthetic trace keeps about N
requests concurrent on a bookkeeping-only worker (``NullModel``,
``kv_storage=False``) for ``--steps`` steps. Four variants run the same trace,
interleaved, ``--repeats`` times each (order rotating):

    plan     KvGateConfig(path="plan")                       plan-only
    legacy   KvGateConfig(path="legacy")                     legacy-only (what a shadow run costs)
    compare  KvGateConfig(path="plan", compare="log")        plan authoritative, legacy shadow
    rollout  KvGateConfig(path="legacy", compare="log")      legacy authoritative, plan shadow

Only the KV ops are timed (the worker's ``_kv_poll``, ``_kv_release``, ``_kv_evict``,
``_kv_migrate`` and ``_kv_allocate`` are wrapped), in thread CPU time (minus the cost of reading
that clock), per step; a step's cost is its minimum over the repeats. CPU time and the minimum keep
out most of what the other processes on shared cores do to wall time; garbage collections triggered
inside an op count toward it. "harness" = compare - plan - legacy (rollout - plan - legacy): what
compare mode adds beyond running both paths (fork, change detection, canonical forms, diff, context,
the forked pools' overlay). "harness in-run": each compared variant runs ``--repeats`` more times
with the paths' own op calls timed too (on the worker and on the fork), and is that run's time
outside them: no difference between separate runs, but the paths' slow-down on forks counts as
theirs. "floor": compare mode rerun the same way with its harness cut to what no compared op can
skip (fork, shadow path, authoritative path with its writes recorded, the check that neither side
wrote anything; nothing canonicalised or compared), shown for quiet steps only: how much of the
harness, and of its growth with N, any harness of this design pays. All variants make the same
decisions, so step i touches the same requests in each: an untimed probe run counts, per step, the
requests whose phase, page tables or retry count the KV ops changed, or that they released:
"touched".

The trace is built so that "touched" varies a lot at a fixed N: every prompt is
16k+1 tokens (page size 16), so all running requests need a new page on the same
decode steps (16, 32, ...) and almost none in between; the GPU pool holds the
prompts plus half a page per request, so those steps evict many requests, and
finishing requests (random output lengths) let migrations and releases happen
in between. Step 0 admits all N (touched = N).

Part 2, end to end: the tiny model runs L2-4096 with compare off (plan path)
and on (plan authoritative, legacy shadow, log mode), interleaved
``--e2e-repeats`` times after a short warm-up of each. The verdict is the ratio
of the minimum process CPU times on CPU (the run is compute-bound on one torch
thread; wall time here swings +-40% with the other processes' load), of the
minimum wall times with ``--device cuda``; shown beside it:
the ratio of minimum wall times, and an in-run accounting (the on-run's wall
time over itself minus the harness seconds its RunSummary reports).

Goals:

    compare KV bookkeeping <= 3x plan-only, at every N
    end-to-end L2-4096 time with compare on <= 1.15x off
    compare cost grows with what a step touched, not with N: on quiet steps (<= 4
    requests touched) the harness cost at the largest N is <= 2x the smallest N's
    (the shadow path's own run is left out: evict and migrate read every running
    request on either path)

Numbers are ratios measured side by side on one machine; absolute times are
only indicative (shared, noisy cores).

    python scripts/bench_compare.py --json-out bench_compare.json --md-out bench_compare.md
    python scripts/bench_compare.py --sizes 64,512 --steps 24 --repeats 3 --no-e2e
    python scripts/bench_compare.py --profile 4096      # cProfile of compare mode at N=4096
    python scripts/bench_compare.py --no-e2e --no-gc    # the collector off during the timed steps
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import platform
import pstats
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from output_path import output_path, write_output
from rich.console import Console
from rich.table import Table

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig
from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadRequest, builtin_workload
from batchgen.kv.gate import KvGateConfig
from batchgen.kv.legacy import LegacyKvPath
from batchgen.kv.plan_path import PlanKvPath
from batchgen.model.loader import load_model
from batchgen.model.null_model import NullModel
from batchgen.shadow.forms import fork_target
from batchgen.shadow.kv_compare import KvCompare, wrote_nothing
from compare import DivergenceRecord, read_log

KV_OPS = ("_kv_poll", "_kv_release", "_kv_evict", "_kv_migrate", "_kv_allocate")
PAGE_SIZE = 16
TOUCHED_BUCKETS = ((0, 4), (5, 32), (33, 256), (257, 2048), (2049, None))
QUIET = TOUCHED_BUCKETS[0]
GOALS = {"bookkeeping_ratio": 3.0, "end_to_end_ratio": 1.15, "quiet_harness_growth": 2.0}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Variants run interleaved in one process; read the ratios, not the absolute times.",
    )
    parser.add_argument(
        "--sizes",
        default="64,512,4096",
        help="comma list of concurrent request counts (default 64,512,4096)",
    )
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run (default 40)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per variant and size (default 3)"
    )
    parser.add_argument(
        "--e2e-repeats", type=int, default=3, help="L2-4096 runs per variant (default 3)"
    )
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end L2-4096 part")
    parser.add_argument(
        "--no-gc",
        action="store_true",
        help=(
            "turn the cyclic garbage collector off during the bookkeeping part's steps "
            "(separates the harness's own cost from collections that land inside KV ops)"
        ),
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the end-to-end part runs the model and GPU pool (default cpu)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the synthetic traces (default 0)"
    )
    parser.add_argument(
        "--profile",
        type=int,
        metavar="N",
        help="instead of benchmarking, cProfile compare mode at N requests and print the top",
    )
    parser.add_argument(
        "--json-out", type=output_path, help="write the figures as JSON to this path"
    )
    parser.add_argument(
        "--md-out", type=output_path, help="write the tables as markdown to this path"
    )
    args = parser.parse_args()
    try:
        args.sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
    except ValueError:
        parser.error(f"--sizes must be a comma list of integers, got {args.sizes!r}")
    if not args.sizes or min(args.sizes) < 1:
        parser.error("--sizes needs at least one size, each >= 1")
    if args.profile is not None and args.profile < 1:
        parser.error(f"--profile takes a request count >= 1, got {args.profile}")
    if args.profile is not None and (args.json_out or args.md_out):
        parser.error(
            "--profile prints a profile and measures nothing else; --json-out and --md-out would"
            " stay unwritten: leave them out"
        )
    if args.steps < 2 or args.repeats < 1 or args.e2e_repeats < 1:
        parser.error("--steps must be >= 2, --repeats and --e2e-repeats >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs CUDA, which this machine lacks")
    if args.json_out and args.md_out and args.json_out.resolve() == args.md_out.resolve():
        parser.error(
            f"--json-out and --md-out name the same file ({args.json_out}); the markdown would"
            " replace the JSON"
        )
    return args


# ---- part 1: bookkeeping per step ------------------------------------------------------------
def concurrent_workload(num_requests: int, steps: int, seed: int) -> Workload:
    """About ``num_requests`` concurrent requests for ``steps`` steps, with eviction pressure (see
    above)."""
    rng = random.Random(f"bench-compare:{num_requests}:{seed}")
    requests, prompt_pages = [], 0
    for i in range(num_requests):
        full_pages = rng.randint(1, 4)
        prompt_pages += full_pages + 1
        requests.append(
            WorkloadRequest(
                uuid=f"c{i}",
                prompt_ids=[rng.randrange(1, 512) for _ in range(full_pages * PAGE_SIZE + 1)],
                max_new_tokens=rng.randint(max(2, steps // 4), 4 * steps),
            )
        )
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
    return Workload(
        name=f"concurrent-{num_requests}", seed=seed, cache=cache, engine=engine, requests=requests
    )


def new_worker(workload: Workload, variant: str, log: Path) -> Worker:
    gate = KvGateConfig(
        path="legacy" if variant in ("legacy", "rollout") else "plan",
        compare="log" if variant in ("compare", "rollout") else "off",
        compare_log=str(log),
    )
    model = NullModel(TINY_MODELS["tiny"])
    worker = Worker(
        model,
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_gate=gate,
        kv_storage=False,
    )
    for request in workload.requests:
        worker.add_request(request.to_request())
    return worker


def clock_read_seconds() -> float:
    """What one ``time.thread_time()`` read costs (a system call); subtracted from every timed
    op."""
    samples = []
    for _ in range(2000):
        started = time.thread_time()
        samples.append(time.thread_time() - started)
    return statistics.median(samples)


CLOCK_READ_S = clock_read_seconds()


def wrap_kv_ops(worker: Worker, before: Callable[[], None], after: Callable[[float], None]) -> None:
    """Replace the worker's KV op methods by wrappers timing them; ``before``/``after`` run outside
    the timer."""
    for name in KV_OPS:
        op = getattr(worker, name)

        def timed(*args, _op=op):
            before()
            started = time.thread_time()
            try:
                return _op(*args)
            finally:
                after(max(0.0, time.thread_time() - started - CLOCK_READ_S))

        setattr(worker, name, timed)


@contextmanager
def path_calls_timed(per_step: list[float], step: list[int]):
    """While open, every KV op call on a path object (``PlanKvPath``, ``LegacyKvPath``: compare
    mode's authoritative and shadow sides alike) adds its thread CPU seconds to
    ``per_step[step[0]]``."""
    originals = [
        (cls, op, getattr(cls, op)) for cls in (PlanKvPath, LegacyKvPath) for op in PATH_OPS
    ]

    def timed(original):
        def call(*args):
            started = time.thread_time()
            try:
                return original(*args)
            finally:
                per_step[step[0]] += max(0.0, time.thread_time() - started - CLOCK_READ_S)

        return call

    for cls, op, original in originals:
        setattr(cls, op, timed(original))
    try:
        yield
    finally:
        for cls, op, original in originals:
            setattr(cls, op, original)


def _floor_compare(self: KvCompare, op: str, call: Callable, request: Callable):
    """The least a compared op can cost in this design: fork, the shadow path on the fork, the
    authoritative path with its writes recorded, and the check that neither side wrote anything.
    Nothing is canonicalised or compared, so it stands for the harness on quiet steps only."""
    fork = fork_target(self.target)
    call(self._new_shadow_path(fork))
    target = self.target
    target.record_op(True)
    try:
        result = call(self.authoritative)
        wrote_nothing(fork, fork.state.written, fork.dropped) and wrote_nothing(
            target, target.state.written, target.dropped
        )
        return result
    finally:
        target.record_op(False)


@contextmanager
def floor_harness():
    """While open, compare mode runs ``_floor_compare`` instead of its harness (a measurement, not a
    check)."""
    original = KvCompare._compare
    KvCompare._compare = _floor_compare
    try:
        yield
    finally:
        KvCompare._compare = original


def timed_steps(
    workload: Workload,
    variant: str,
    steps: int,
    log: Path,
    *,
    collector: bool = True,
    attributed: bool = False,
    floor: bool = False,
) -> list[float]:
    """Seconds spent in KV ops, per step, on a fresh worker (``collector=False``: the cyclic garbage
    collector off while the steps run). ``attributed``: minus the seconds inside the paths' own op
    calls, timed in the same run (for compare mode: the harness alone, measured in-run). ``floor``:
    compare mode with its harness cut to ``_floor_compare``."""
    worker = new_worker(workload, variant, log)
    per_step, in_paths = [0.0] * steps, [0.0] * steps
    step = [0]

    def add(seconds: float) -> None:
        per_step[step[0]] += seconds

    wrap_kv_ops(worker, lambda: None, add)
    # start each run from the same collector state; collections inside a KV op still count
    gc.collect()
    if not collector:
        gc.disable()
    try:
        with (
            path_calls_timed(in_paths, step) if attributed else nullcontext(),
            floor_harness() if floor else nullcontext(),
        ):
            for step[0] in range(steps):
                worker.step()
    finally:
        gc.enable()
    return [total - paths for total, paths in zip(per_step, in_paths)]


def touched_steps(workload: Workload, steps: int, log: Path) -> tuple[list[int], list[int]]:
    """Per step: requests whose KV state the KV ops changed or released, and requests alive
    (untimed)."""
    worker = new_worker(workload, "plan", log)
    touched: list[set[str]] = [set() for _ in range(steps)]
    step = [0]
    seen: dict = {}

    def key(req) -> tuple:
        return req.phase, req.gpu_page_ids, req.host_page_ids, req.num_load_retries

    def before() -> None:
        seen.clear()
        seen.update((uuid, key(req)) for uuid, req in worker.state.requests.items())

    def after(_: float) -> None:
        live = worker.state.requests
        touched[step[0]].update(u for u, k in seen.items() if u not in live or key(live[u]) != k)

    wrap_kv_ops(worker, before, after)
    alive = []
    for step[0] in range(steps):
        alive.append(len(worker.state.requests))
        worker.step()
    return [len(t) for t in touched], alive


VARIANTS = ("plan", "legacy", "compare", "rollout")
COMPARED = ("compare", "rollout")
# a compared variant rerun with its path calls timed: its harness, measured in-run
ATTRIBUTED = "-attributed"
# compare, its harness cut to _floor_compare, measured in-run: the least a harness costs
FLOOR = "floor"
RUNS = VARIANTS + tuple(variant + ATTRIBUTED for variant in COMPARED) + (FLOOR,)
PATH_OPS = ("poll", "release", "evict", "migrate", "allocate")


def bookkeeping(
    sizes: list[int],
    steps: int,
    repeats: int,
    seed: int,
    log: Path,
    console: Console,
    *,
    collector: bool = True,
) -> list[dict]:
    # warm-up: imports, caches
    timed_steps(concurrent_workload(min(sizes), steps, seed), "compare", steps, log)
    rows = []
    for size in sizes:
        workload = concurrent_workload(size, steps, seed)
        samples: dict[str, list[list[float]]] = {variant: [] for variant in RUNS}
        for repeat in range(repeats):
            for variant in RUNS[repeat % len(RUNS) :] + RUNS[: repeat % len(RUNS)]:
                compared = "compare" if variant == FLOOR else variant.removesuffix(ATTRIBUTED)
                samples[variant].append(
                    timed_steps(
                        workload,
                        compared,
                        steps,
                        log,
                        collector=collector,
                        attributed=variant != compared,
                        floor=variant == FLOOR,
                    )
                )
        touched, alive = touched_steps(workload, steps, log)
        row = {
            "num_requests": size,
            "touched": touched,
            "alive": alive,
            "num_gpu_pages": workload.cache.num_gpu_pages,
        }
        for variant, runs in samples.items():
            row[f"{variant}_s"] = [min(run[i] for run in runs) for i in range(steps)]
        rows.append(row)
        console.print(
            f"  N={size}: "
            + ", ".join(
                f"{variant} {sum(row[f'{variant}_s']) / steps * 1e3:.2f} ms/step"
                for variant in RUNS
            ),
            highlight=False,
        )
    return rows


def harness(row: dict, i: int, variant: str = "compare") -> float:
    return row[f"{variant}_s"][i] - row["plan_s"][i] - row["legacy_s"][i]


def direct_harness(row: dict, i: int, variant: str = "compare") -> float:
    return row[f"{variant}{ATTRIBUTED}_s"][i]


def summarise_sizes(rows: list[dict]) -> list[dict]:
    out = []
    for row in rows:
        steps, plan = len(row["plan_s"]), sum(row["plan_s"])
        summary = {
            "num_requests": row["num_requests"],
            "mean_alive": statistics.fmean(row["alive"]),
            "mean_touched": statistics.fmean(row["touched"]),
        }
        for variant in VARIANTS:
            summary[f"{variant}_us_per_step"] = sum(row[f"{variant}_s"]) / steps * 1e6
        for variant in COMPARED:
            extra = sum(harness(row, i, variant) for i in range(steps))
            summary[f"{variant}_ratio"] = sum(row[f"{variant}_s"]) / plan
            summary[f"{variant}_harness_us_per_step"] = extra / steps * 1e6
            summary[f"{variant}_harness_ns_per_alive_request"] = extra / sum(row["alive"]) * 1e9
            summary[f"{variant}_direct_harness_us_per_step"] = (
                sum(row[f"{variant}{ATTRIBUTED}_s"]) / steps * 1e6
            )
        out.append(summary)
    return out


def bucket_label(bucket: tuple[int, int | None]) -> str:
    low, high = bucket
    return f"{low}+" if high is None else f"{low}-{high}"


def summarise_touched(rows: list[dict]) -> list[dict]:
    """Median per-step figures of each (N, touched bucket) with at least one step."""
    out = []
    for row in rows:
        for bucket in TOUCHED_BUCKETS:
            low, high = bucket
            steps = [
                i for i, t in enumerate(row["touched"]) if t >= low and (high is None or t <= high)
            ]
            if not steps:
                continue
            out.append(
                {
                    "num_requests": row["num_requests"],
                    "touched": bucket_label(bucket),
                    "num_steps": len(steps),
                    "median_touched": statistics.median(row["touched"][i] for i in steps),
                    **{
                        f"{variant}_us": (
                            statistics.median(row[f"{variant}_s"][i] for i in steps) * 1e6
                        )
                        for variant in VARIANTS
                    },
                    **{
                        f"{variant}_harness_us": (
                            statistics.median(harness(row, i, variant) for i in steps) * 1e6
                        )
                        for variant in COMPARED
                    },
                    **{
                        f"{variant}_direct_harness_us": (
                            statistics.median(direct_harness(row, i, variant) for i in steps) * 1e6
                        )
                        for variant in COMPARED
                    },
                    "floor_us": statistics.median(row[f"{FLOOR}_s"][i] for i in steps) * 1e6,
                }
            )
    return out


def fit_harness(rows: list[dict]) -> dict | None:
    """Least squares: harness per step = a + b * requests alive + c * requests touched (all steps,
    all N); None with one size (the requests alive hardly vary: the fixed and per-alive terms cannot
    be told apart)."""
    import numpy as np

    if len({row["num_requests"] for row in rows}) < 2:
        return None
    x, y = [], []
    for row in rows:
        for i, touched in enumerate(row["touched"]):
            x.append([1.0, row["alive"][i], touched])
            y.append(harness(row, i))
    (a, b, c), *_ = np.linalg.lstsq(np.array(x), np.array(y), rcond=None)
    return {"fixed_us": a * 1e6, "us_per_alive_request": b * 1e6, "us_per_touched_request": c * 1e6}


# ---- part 2: end to end ----------------------------------------------------------------------
def end_to_end(repeats: int, device: str, log: Path, console: Console) -> dict:
    model = load_model("tiny", device=device)
    workload = builtin_workload("L2-4096")
    walls: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    compare_seconds = []
    # first forwards, lazy inits
    warm_up = workload.model_copy(update={"requests": workload.requests[:4]})
    for variant in ("off", "on"):
        gate = KvGateConfig(
            path="plan", compare="log" if variant == "on" else "off", compare_log=str(log)
        )
        run_workload(
            Worker(
                model,
                cache_config=workload.cache,
                engine_config=workload.engine,
                kv_gate=gate,
                device=device,
            ),
            warm_up,
        )
    for repeat in range(repeats):
        for variant in ("off", "on") if repeat % 2 == 0 else ("on", "off"):
            gate = KvGateConfig(
                path="plan", compare="log" if variant == "on" else "off", compare_log=str(log)
            )
            worker = Worker(
                model,
                cache_config=workload.cache,
                engine_config=workload.engine,
                kv_gate=gate,
                device=device,
            )
            started = time.process_time()
            result = run_workload(worker, workload, source="L2-4096")
            cpu[variant].append(time.process_time() - started)
            walls[variant].append(result.wall_s)
            if result.compare_summary is not None:
                compare_seconds.append(result.compare_summary.compare_seconds)
                if any(result.compare_summary.divergences.values()):
                    raise SystemExit(f"L2-4096 diverged: {result.compare_summary.divergences}")
            console.print(
                f"  L2-4096 compare {variant}: {result.wall_s:.2f} s wall, {cpu[variant][-1]:.2f}"
                " s CPU",
                highlight=False,
            )
    cpu_ratio, wall_ratio = min(cpu["on"]) / min(cpu["off"]), min(walls["on"]) / min(walls["off"])
    return {
        "device": device,
        "wall_s": walls,
        "cpu_s": cpu,
        "min_off_cpu_s": min(cpu["off"]),
        "min_on_cpu_s": min(cpu["on"]),
        "cpu_ratio": cpu_ratio,
        "wall_ratio": wall_ratio,
        # the verdict: CPU time on a CPU run (compute-bound, one thread), wall time with CUDA (async
        # work)
        "basis": "process CPU time" if device == "cpu" else "wall time",
        "ratio": cpu_ratio if device == "cpu" else wall_ratio,
        "median_harness_s": statistics.median(compare_seconds),
        # in-run accounting, immune to the noise between runs: the on-run's wall time over itself
        # minus what compare mode added inside it (shadow runs, forks, canonical forms, diffs)
        "accounted_ratio": statistics.median(
            w / (w - c) for w, c in zip(walls["on"], compare_seconds)
        ),
    }


# ---- report ------------------------------------------------------------------------------------
def verdicts(sizes: list[dict], touched: list[dict], e2e: dict | None) -> dict:
    ratio, size, variant = max(
        (row[f"{v}_ratio"], row["num_requests"], v) for row in sizes for v in COMPARED
    )
    out = {
        "bookkeeping_ratio": {
            "value": ratio,
            "at": f"{variant}, N = {size}",
            "goal": GOALS["bookkeeping_ratio"],
            "met": ratio <= GOALS["bookkeeping_ratio"],
        }
    }
    growth_columns = {
        "quiet_harness_growth": {variant: f"{variant}_harness_us" for variant in COMPARED},
        "quiet_direct_harness_growth": {
            variant: f"{variant}_direct_harness_us" for variant in COMPARED
        },
        "quiet_floor_growth": {"compare": "floor_us"},
    }
    for key, columns in growth_columns.items():
        growths = []
        for variant, column in columns.items():
            quiet = {
                row["num_requests"]: row[column]
                for row in touched
                if row["touched"] == bucket_label(QUIET)
            }
            if len(quiet) >= 2:
                small, large = min(quiet), max(quiet)
                growths.append(
                    (
                        quiet[large] / quiet[small] if quiet[small] > 0 else math.inf,
                        variant,
                        small,
                        large,
                    )
                )
        if growths:
            growth, variant, small, large = max(growths)
            out[key] = {
                "value": growth,
                "at": f"{variant}, N = {large} vs {small}",
                "goal": GOALS["quiet_harness_growth"],
                "met": growth <= GOALS["quiet_harness_growth"],
            }
    if e2e is not None:
        out["end_to_end_ratio"] = {
            "value": e2e["ratio"],
            "at": "compare",
            "goal": GOALS["end_to_end_ratio"],
            "met": e2e["ratio"] <= GOALS["end_to_end_ratio"],
        }
    return out


Rendered = tuple[str, tuple[str, ...], list[tuple[str, ...]]]  # title, columns, rows


def report_tables(
    sizes: list[dict],
    touched: list[dict],
    fit: dict | None,
    e2e: dict | None,
    results: dict,
    steps: int,
    repeats: int,
) -> list[Rendered]:
    tables: list[Rendered] = [
        (
            (
                f"KV bookkeeping, us per step (mean over {steps} steps of each step's minimum over"
                f" {repeats} interleaved runs); alive, touched: requests per step; compare = plan"
                " authoritative + legacy shadow, rollout = legacy authoritative + plan shadow;"
                " harness = compare (rollout) - plan - legacy"
            ),
            (
                "N",
                "alive",
                "touched",
                "plan",
                "legacy",
                "compare",
                "rollout",
                "compare/plan",
                "rollout/plan",
                "harness",
                "harness ns/alive req",
                "rollout harness",
                "harness in-run",
                "rollout harness in-run",
            ),
            [
                (
                    str(r["num_requests"]),
                    f"{r['mean_alive']:.0f}",
                    f"{r['mean_touched']:.1f}",
                    f"{r['plan_us_per_step']:.0f}",
                    f"{r['legacy_us_per_step']:.0f}",
                    f"{r['compare_us_per_step']:.0f}",
                    f"{r['rollout_us_per_step']:.0f}",
                    f"{r['compare_ratio']:.2f}x",
                    f"{r['rollout_ratio']:.2f}x",
                    f"{r['compare_harness_us_per_step']:.0f}",
                    f"{r['compare_harness_ns_per_alive_request']:.0f}",
                    f"{r['rollout_harness_us_per_step']:.0f}",
                    f"{r['compare_direct_harness_us_per_step']:.0f}",
                    f"{r['rollout_direct_harness_us_per_step']:.0f}",
                )
                for r in sizes
            ],
        ),
        (
            (
                "By requests touched: us per step, medians over the steps in each bucket; in-run:"
                " the compared run minus the time inside its two paths' op calls, timed in that"
                " run; floor: the same for compare mode cut to fork, both paths and the"
                " nothing-written check (the least a compared op costs; quiet steps only)"
            ),
            (
                "N",
                "touched",
                "steps",
                "plan",
                "legacy",
                "compare",
                "rollout",
                "harness",
                "rollout harness",
                "harness in-run",
                "rollout harness in-run",
                "floor in-run",
            ),
            [
                (
                    str(r["num_requests"]),
                    r["touched"],
                    str(r["num_steps"]),
                    f"{r['plan_us']:.0f}",
                    f"{r['legacy_us']:.0f}",
                    f"{r['compare_us']:.0f}",
                    f"{r['rollout_us']:.0f}",
                    f"{r['compare_harness_us']:.0f}",
                    f"{r['rollout_harness_us']:.0f}",
                    f"{r['compare_direct_harness_us']:.0f}",
                    f"{r['rollout_direct_harness_us']:.0f}",
                    f"{r['floor_us']:.0f}" if r["touched"] == bucket_label(QUIET) else "-",
                )
                for r in touched
            ],
        ),
    ]
    if e2e is not None:
        tables.append(
            (
                (
                    f"L2-4096 end to end (tiny model on {e2e['device']}), process CPU seconds, min"
                    f" of {len(e2e['cpu_s']['on'])} interleaved runs each"
                ),
                (
                    "compare off",
                    "compare on",
                    "on/off CPU",
                    "on/off wall",
                    "harness s in on-run",
                    "on/off accounted",
                ),
                [
                    (
                        f"{e2e['min_off_cpu_s']:.2f}",
                        f"{e2e['min_on_cpu_s']:.2f}",
                        f"{e2e['cpu_ratio']:.3f}x",
                        f"{e2e['wall_ratio']:.3f}x",
                        f"{e2e['median_harness_s']:.2f}",
                        f"{e2e['accounted_ratio']:.3f}x",
                    )
                ],
            )
        )
    names = {
        "bookkeeping_ratio": "compare / plan-only bookkeeping, worst",
        "end_to_end_ratio": f"L2-4096 end to end, compare on / off ({e2e['basis'] if e2e else ''})",
        "quiet_harness_growth": (
            "harness on quiet steps (<= 4 touched), largest N / smallest N, worst"
        ),
        "quiet_direct_harness_growth": (
            "the same, harness measured in-run (diagnostic: it leaves out the "
            "paths' own slow-down on forks)"
        ),
        "quiet_floor_growth": (
            "the same for the floor, in-run (diagnostic: the least any compared op costs: "
            "fork, both paths, the nothing-written check)"
        ),
    }
    fitted = (
        "needs two or more --sizes"
        if fit is None
        else (
            f"{fit['fixed_us']:.0f} us + {fit['us_per_alive_request']:.2f} us x alive "
            f"+ {fit['us_per_touched_request']:.2f} us x touched"
        )
    )
    tables.append(
        (
            f"Goals (compare harness, least-squares fit over all steps: {fitted})",
            ("goal", "measured", "at", "target", "verdict"),
            [
                (
                    names[key],
                    f"{v['value']:.2f}x",
                    v["at"],
                    f"<= {v['goal']}x",
                    "met" if v["met"] else "MISSED",
                )
                for key, v in results.items()
            ],
        )
    )
    return tables


def is_number(text: str) -> bool:
    try:
        float(text.rstrip("x"))
    except ValueError:
        return False
    return True


def to_rich(table: Rendered) -> Table:
    title, columns, rows = table
    out = Table(title=title)
    for i, column in enumerate(columns):
        out.add_column(column, justify="left" if i == 0 and not is_number(rows[0][0]) else "right")
    for row in rows:
        out.add_row(*row)
    return out


def to_markdown(table: Rendered) -> str:
    title, columns, rows = table
    first = "---|" if rows and not is_number(rows[0][0]) else "---:|"
    lines = [
        f"**{title}**",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + first + "---:|" * (len(columns) - 1),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def profile(size: int, steps: int, seed: int, log: Path) -> None:
    workload = concurrent_workload(size, steps, seed)
    profiler = cProfile.Profile()
    profiler.enable()
    timed_steps(workload, "compare", steps, log)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # the sampler's tiny ops only lose from threads on shared cores
    # whole tables in a pipe or a CI log too (rich assumes 80 columns there)
    console = Console(width=160)
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "divergences.jsonl"
        if args.profile is not None:
            profile(args.profile, args.steps, args.seed, log)
            return
        started = time.perf_counter()
        console.print("bookkeeping:", highlight=False)
        rows = bookkeeping(
            args.sizes, args.steps, args.repeats, args.seed, log, console, collector=not args.no_gc
        )
        e2e = None
        if not args.no_e2e:
            console.print("end to end:", highlight=False)
            e2e = end_to_end(args.e2e_repeats, args.device, log, console)
        diverged = [
            r
            for r in (read_log(log).records if log.exists() else ())
            if isinstance(r, DivergenceRecord)
        ]
        if diverged:
            raise SystemExit(
                f"compare mode logged {len(diverged)} divergences, first: {diverged[0]}"
            )
    sizes, touched, fit = summarise_sizes(rows), summarise_touched(rows), fit_harness(rows)
    results = verdicts(sizes, touched, e2e)
    tables = report_tables(sizes, touched, fit, e2e, results, args.steps, args.repeats)
    for table in tables:
        console.print(to_rich(table))
    console.print(
        f"total {time.perf_counter() - started:.0f} s on"
        f" {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 torch thread",
        highlight=False,
    )
    if args.json_out:
        record = {
            "machine": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "args": {
                "sizes": args.sizes,
                "steps": args.steps,
                "repeats": args.repeats,
                "e2e_repeats": args.e2e_repeats,
                "seed": args.seed,
                "no_gc": args.no_gc,
            },
            "sizes": sizes,
            "touched": touched,
            "harness_fit": fit,
            "end_to_end": e2e,
            "goals": results,
            "per_step": rows,
        }
        write_output(args.json_out, json.dumps(record, indent=2) + "\n")
    if args.md_out:
        write_output(args.md_out, "\n".join(to_markdown(table) for table in tables))


if __name__ == "__main__":
    main()
