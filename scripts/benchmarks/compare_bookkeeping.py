"""Part 1 of ``bench.py compare``: KV bookkeeping per step of four variants on one trace.

Variants: plan, legacy, compare (plan authoritative, legacy shadow) and compare with coverage
off. Only the KV ops are timed (``ab_timer.time_kv_ops``), in thread CPU time less the clock's
read cost; an untimed probe counts the requests each step's ops touched. See ``compare_cost.py``
for what the figures mean.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import math
import pstats
import random
import statistics
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadRequest
from batchgen.kv.gate import KvGateConfig
from batchgen.model.null_model import NullModel
from batchgen.shadow.wiring import gated_worker

from .ab_timer import CLOCKS, clock_overhead_ns, interleaved, time_kv_ops, wrap_kv_ops

VARIANTS = ("plan", "legacy", "compare", "coverage_off")
LABELS = {"coverage_off": "coverage off"}
PAGE_SIZE = 16
TOUCHED_BUCKETS = ((0, 4), (5, 32), (33, 256), (257, 2048), (2049, None))
QUIET = "0-4"


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


def no_outcomes(op_name: str, op, *observations) -> tuple:
    return ()


def new_worker(workload: Workload, variant: str, log: Path) -> Worker:
    """A bookkeeping-only worker holding every request of ``workload``, set up as ``variant``."""
    gate = KvGateConfig(
        path="legacy" if variant == "legacy" else "plan",
        compare="off" if variant in ("plan", "legacy") else "log",
        compare_log=str(log),
    )
    worker = gated_worker(
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


@functools.cache
def clock_read_ns() -> int:
    """What one thread CPU time read costs (a system call); taken off every timed op."""
    return clock_overhead_ns(CLOCKS["cpu"])


def timed_steps(
    workload: Workload, variant: str, steps: int, log: Path, collector: bool = True
) -> list[float]:
    """Seconds spent in the KV ops, per step, on a fresh worker; with ``collector`` False the
    cyclic garbage collector is paused for the steps."""
    worker = new_worker(workload, variant, log)
    per_step, state = [0.0] * steps, worker.state

    def add(op: str, ns: int) -> None:
        per_step[state.step] += ns / 1e9

    time_kv_ops(worker, add, CLOCKS["cpu"], clock_read_ns())
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

    def probe(op: str, call: Callable) -> Callable:
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
    collector = args.collector == "on"
    rows = []
    for size in args.sizes:
        workload = concurrent_workload(size, args.steps, args.seed)
        run = functools.partial(
            timed_steps, workload, steps=args.steps, log=log, collector=collector
        )
        samples = interleaved(VARIANTS, args.repeats, run)
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


def profile(size: int, steps: int, seed: int, log: Path) -> None:
    """Print the top 30 functions by own time of compare mode's steps at ``size`` requests."""
    workload = concurrent_workload(size, steps, seed)
    profiler = cProfile.Profile()
    profiler.runcall(timed_steps, workload, "compare", steps, log)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
