"""KV bookkeeping per step, legacy path vs plan path, without the model.

A worker with the weightless ``NullModel`` and bookkeeping-only pools (``kv_storage=False``)
keeps N requests live (a released request is replaced at once) for ``--warmup`` untimed, then
``--steps`` timed steps. Only the five KV ops are timed (``ab_timer.time_kv_ops``, wrapped once
the warm-up is over). Legacy and plan run interleaved in one process (the order alternates every
repeat) on the same seeded trace, and must end with identical counters (exit 1 otherwise). The
clock is the thread's CPU time by default, its read cost subtracted; garbage collections
triggered inside an op count toward it.

    decode    the GPU pool holds every request's full context: steady decode
    pressure  the GPU pool holds ~30% of the live demand, the host pool ~20%: constant eviction
              (to host, or recompute when it is full), migration, finish-and-replace

Goal: plan <= 1.1x legacy at every size (the median of the per-repeat ratios). The window is
long (200 steps after 24) because at 64 requests a short one holds too few finishes, evictions and
loads to settle.

    python scripts/bench.py kv-ops --json-out bench_kv_ops.json
    python scripts/bench.py kv-ops --sizes 64 --mixes pressure --repeats 9
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
from dataclasses import dataclass, field

import torch
from rich.console import Console

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig, pages_needed
from batchgen.kv.gate import KV_OPS, KvGateConfig
from batchgen.model.null_model import NullModel
from batchgen.shadow.wiring import gated_worker
from batchgen.state import Request

from .ab_timer import CLOCKS, adding_to, clock_overhead_ns, interleaved, median_ratio, time_kv_ops
from .kv_ops_report import report
from .output_path import output_path, write_output

PATHS = ("legacy", "plan")
MIXES = ("decode", "pressure")
PAGE_SIZE = 16
VOCAB = 64  # the sampler's cost grows with the vocabulary; it is not timed, but it is waited for
PROMPT_TOKENS = (8, 48)
NEW_TOKENS = {"decode": (96, 256), "pressure": (32, 128)}
POOL_FRACTION = {"decode": (1.1, 0.1), "pressure": (0.3, 0.2)}  # GPU, host: of the live demand
GOAL = 1.1  # plan / legacy
COUNTERS = ("evictions", "loads", "recompute_preemptions", "tokens_generated")
KV_CLOCKS = ("cpu", "wall")


@dataclass
class Run:
    """One path on one (mix, size) for one repeat: KV nanoseconds per op, the window's counters."""

    ns_by_op: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KV_OPS, 0))
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def total_ns(self) -> int:
        return sum(self.ns_by_op.values())


class RequestStream:
    """Seeded requests; identical for both paths."""

    def __init__(self, mix: str, seed: int):
        self.rng = random.Random(f"{mix}:{seed}")
        self.mix = mix
        self.num_made = 0

    def next(self) -> Request:
        prompt_len = self.rng.randint(*PROMPT_TOKENS)
        max_new = self.rng.randint(*NEW_TOKENS[self.mix])
        self.num_made += 1
        prompt = tuple(self.rng.randrange(1, VOCAB) for _ in range(prompt_len))
        return Request(f"q{self.num_made}", prompt, max_new)


def configs(mix: str, num_requests: int) -> tuple[CacheConfig, EngineConfig]:
    max_pages = pages_needed(PROMPT_TOKENS[1] + NEW_TOKENS[mix][1], PAGE_SIZE)
    mean_pages = (sum(PROMPT_TOKENS) + sum(NEW_TOKENS[mix])) / 2 / PAGE_SIZE
    gpu_fraction, host_fraction = POOL_FRACTION[mix]
    demand = max_pages if mix == "decode" else mean_pages
    cache = CacheConfig(
        page_size=PAGE_SIZE,
        num_gpu_pages=max(round(num_requests * demand * gpu_fraction), 2 * max_pages),
        num_host_pages=round(num_requests * mean_pages * host_fraction),
        watermark=0.01,
    )
    engine = EngineConfig(
        max_num_seqs=num_requests, max_num_batched_tokens=num_requests * PROMPT_TOKENS[1]
    )
    return cache, engine


def run_once(path: str, mix: str, num_requests: int, args: argparse.Namespace) -> Run:
    """Keep ``num_requests`` live for warmup + steps steps; time the KV ops of the last steps."""
    cache, engine = configs(mix, num_requests)
    model = NullModel(TINY_MODELS["tiny"].model_copy(update={"vocab_size": VOCAB}))
    worker = gated_worker(
        model,
        cache_config=cache,
        engine_config=engine,
        kv_gate=KvGateConfig(path=path),
        kv_storage=False,
    )
    run, stream = Run(), RequestStream(mix, args.seed)
    for _ in range(num_requests):
        worker.add_request(stream.next())
    gc.collect()  # the same collector state for every run; collections inside an op still count
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            time_kv_ops(worker, adding_to(run.ns_by_op), CLOCKS[args.clock], args.overhead_ns)
            before = {name: getattr(worker.state.stats, name) for name in COUNTERS}
        worker.step()
        for _ in range(num_requests - len(worker.state.requests)):
            worker.add_request(stream.next())
    run.stats = {name: getattr(worker.state.stats, name) - before[name] for name in COUNTERS}
    return run


def measure(mix: str, num_requests: int, args: argparse.Namespace) -> dict[str, list[Run]]:
    """Every path ``--repeats`` times, interleaved; SystemExit when their counters differ."""
    runs = interleaved(
        PATHS, args.repeats, lambda path: run_once(path, mix, num_requests, args), rotate=False
    )
    legacy, plan = runs["legacy"][0].stats, runs["plan"][0].stats
    if legacy != plan:
        raise SystemExit(
            f"{mix} x {num_requests}: the paths disagree: legacy {legacy} vs plan {plan}"
        )
    return runs


def summarise(mix: str, num_requests: int, runs: dict[str, list[Run]], steps: int) -> dict:
    """One table row: medians per path and op, the median of the per-repeat ratios. Pure."""
    per_step = {path: [run.total_ns / steps / 1000 for run in runs[path]] for path in PATHS}
    ratio, ratios = median_ratio(per_step["plan"], per_step["legacy"])
    return {
        "mix": mix,
        "num_requests": num_requests,
        "legacy_us_per_step": statistics.median(per_step["legacy"]),
        "plan_us_per_step": statistics.median(per_step["plan"]),
        "ratio_plan_legacy": ratio,
        "ratios": ratios,
        "goal": GOAL,
        "met": ratio <= GOAL,
        "us_per_step_samples": per_step,
        "us_per_step_by_op": {
            path: {
                op: statistics.median(run.ns_by_op[op] / steps / 1000 for run in runs[path])
                for op in KV_OPS
            }
            for path in PATHS
        },
        "window_stats": runs["legacy"][0].stats,
    }


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    add = parser.add_argument
    add(
        "--sizes",
        default="64,512,4096",
        help="comma list of live request counts (default %(default)s)",
    )
    add("--mixes", default=",".join(MIXES), help="comma list of decode, pressure (default both)")
    add("--steps", type=int, default=200, help="timed steps per run (default 200)")
    add("--warmup", type=int, default=24, help="untimed steps before timing (default 24)")
    add("--repeats", type=int, default=3, help="runs per path, interleaved (default 3)")
    add("--clock", choices=KV_CLOCKS, default="cpu", help="cpu: thread CPU time (default)")
    add("--seed", type=int, default=0, help="seed of the request stream (default 0)")
    add("--markdown", action="store_true", help="print the tables as Markdown")
    add("--json-out", type=output_path, help="write the figures as JSON to this path")
    args = parser.parse_args(argv)
    try:
        args.sizes = [int(size) for size in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be a comma list of integers, got {args.sizes!r}")
    args.mixes = [mix.strip() for mix in args.mixes.split(",")]
    if any(size < 1 for size in args.sizes):
        parser.error("--sizes must be positive")
    if not set(args.mixes) <= set(MIXES):
        parser.error(f"--mixes must name {', '.join(MIXES)}, got {args.mixes}")
    if args.steps < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--steps and --repeats must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str], prog: str) -> int:
    args = parse_args(argv, prog)
    torch.set_num_threads(1)  # the untimed sampler's tiny ops; fewer threads are steadier
    args.overhead_ns = clock_overhead_ns(CLOCKS[args.clock])
    console = Console(width=160)
    rows = []
    for mix in args.mixes:
        for num_requests in args.sizes:
            runs = measure(mix, num_requests, args)
            rows.append(summarise(mix, num_requests, runs, args.steps))
            console.log(f"{mix} x {num_requests}: plan/legacy {rows[-1]['ratio_plan_legacy']:.2f}")
    report(rows, args, console, GOAL)
    if args.json_out:
        names = ("sizes", "mixes", "steps", "warmup", "repeats", "clock", "seed")
        record = {
            "benchmark": "kv_ops",
            "machine": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "args": {name: getattr(args, name) for name in names},
            "rows": rows,
        }
        write_output(args.json_out, json.dumps(record, indent=2))
    return 0
