"""KV bookkeeping per step, legacy path vs plan path, without the model.

A worker with the weightless ``NullModel`` and bookkeeping-only pools
(``kv_storage=False``) keeps ``N`` requests live (each released request is
replaced at once by a new one) for ``--warmup`` untimed then ``--steps`` timed
steps. Only the KV ops are timed: the worker's path object is wrapped so each
of poll, release, evict, migrate and alloc is timed around the call. Legacy and
plan run interleaved in one process (the order alternates every repeat) on the
same seeded trace, and must end with identical counters. The default window, 200
timed steps after 24, holds the steady finish-and-replace: requests start
finishing only after ~30 steps, and at 64 requests 30-step windows taken at
different points of one trace differ by up to 10% in their ratio.

    decode    GPU pool holds every request's full context: steady decode, a page
              appended every page_size tokens, a finish-and-replace now and then
    pressure  GPU pool holds ~30% of the live demand and the host pool ~20%:
              constant eviction (to host, or recompute when it is full), migration,
              and finish-and-replace

The table gives the median per-step microseconds of each path, the median of the
per-repeat ratios plan/legacy, the eviction, load and recompute counts of the
timed window, and the growth of per-step cost from the smallest size (x vs N0;
the request count grows by N/N0); a second table splits the time by op. The
default clock is the thread's CPU time (steadier than wall time on shared, busy
cores; the cost of reading it is measured and subtracted). Garbage collections
triggered inside a KV op count toward it: allocation churn is part of the cost.

One process's memory layout and string-hash seed shift its small cells by a few
percent for every repeat alike, so repeats in one process do not average it out:
``--processes K`` measures every cell in K fresh interpreter processes (each with
``--repeats``) and reports the median of the K per-process ratios, and their range.

    python scripts/bench_kv_ops.py --json-out bench_kv_ops.json
    python scripts/bench_kv_ops.py --sizes 64 --mixes pressure --processes 9
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from output_path import output_path, write_output
from rich.console import Console
from rich.table import Table

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig
from batchgen.engine.state import Request, WorkerStats
from batchgen.engine.worker import Worker
from batchgen.kv.gate import KV_OPS, KvGateConfig
from batchgen.model.null_model import NullModel

PATHS = ("legacy", "plan")
MIXES = ("decode", "pressure")
PAGE_SIZE = 16
VOCAB = 64  # the sampler's cost grows with the vocabulary; it is not timed, but it is waited for
PROMPT_TOKENS = (8, 48)
NEW_TOKENS = {"decode": (96, 256), "pressure": (32, 128)}
# GPU, host: fraction of the live demand
POOL_FRACTION = {"decode": (1.1, 0.1), "pressure": (0.3, 0.2)}


@dataclass
class Run:
    """One path on one (mix, size) for one repeat: KV nanoseconds per op and the window's
    counters."""

    ns_by_op: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KV_OPS, 0))
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def total_ns(self) -> int:
        return sum(self.ns_by_op.values())


CLOCKS = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}


def clock_overhead_ns(clock) -> int:
    """What one timed interval adds by itself (a CPU-time read is a system call): subtracted per
    call."""
    return min(statistics.median(-clock() + clock() for _ in range(2000)) for _ in range(5))


class TimedKvPath:
    """Wraps a KV path object; times each op call into ``run.ns_by_op`` while ``timing``."""

    def __init__(self, inner, run: Run, clock):
        self.inner, self.run, self.clock, self.timing = inner, run, clock, False
        self.overhead_ns = clock_overhead_ns(clock)

    def _timed(self, op: str, call, *args):
        if not self.timing:
            return call(*args)
        started = self.clock()
        result = call(*args)
        self.run.ns_by_op[op] += max(0, self.clock() - started - self.overhead_ns)
        return result

    def poll(self, observed):
        return self._timed("poll", self.inner.poll, observed)

    def release(self, uuids):
        return self._timed("release", self.inner.release, uuids)

    def evict(self):
        return self._timed("evict", self.inner.evict)

    def migrate(self):
        return self._timed("migrate", self.inner.migrate)

    def allocate(self, batch):
        return self._timed("alloc", self.inner.allocate, batch)


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
        return Request(
            f"q{self.num_made}",
            tuple(self.rng.randrange(1, VOCAB) for _ in range(prompt_len)),
            max_new,
        )


def configs(mix: str, num_requests: int) -> tuple[CacheConfig, EngineConfig]:
    max_pages = -(-(PROMPT_TOKENS[1] + NEW_TOKENS[mix][1]) // PAGE_SIZE)
    mean_pages = (sum(PROMPT_TOKENS) + sum(NEW_TOKENS[mix])) / 2 / PAGE_SIZE
    gpu_fraction, host_fraction = POOL_FRACTION[mix]
    demand = max_pages if mix == "decode" else mean_pages
    num_gpu_pages = max(round(num_requests * demand * gpu_fraction), 2 * max_pages)
    cache = CacheConfig(
        page_size=PAGE_SIZE,
        num_gpu_pages=num_gpu_pages,
        num_host_pages=round(num_requests * mean_pages * host_fraction),
        watermark=0.01,
    )
    engine = EngineConfig(
        max_num_seqs=num_requests, max_num_batched_tokens=num_requests * PROMPT_TOKENS[1]
    )
    return cache, engine


def run_once(
    path: str, mix: str, num_requests: int, *, warmup: int, steps: int, seed: int, clock: str
) -> Run:
    """Keep ``num_requests`` live for warmup + steps steps; time the KV ops of the last
    ``steps``."""
    cache, engine = configs(mix, num_requests)
    model = NullModel(TINY_MODELS["tiny"].model_copy(update={"vocab_size": VOCAB}))
    worker = Worker(
        model,
        cache_config=cache,
        engine_config=engine,
        kv_gate=KvGateConfig(path=path),
        kv_storage=False,
    )
    run = Run()
    timed = worker._kv = TimedKvPath(worker._kv, run, CLOCKS[clock])
    stream = RequestStream(mix, seed)
    for _ in range(num_requests):
        worker.add_request(stream.next())
    before = None
    # start each run from the same collector state; collections inside a KV op still count
    gc.collect()
    for step in range(warmup + steps):
        if step == warmup:
            timed.timing, before = True, _counters(worker.state.stats)
        worker.step()
        for _ in range(num_requests - len(worker.state.requests)):
            worker.add_request(stream.next())
    after = _counters(worker.state.stats)
    run.stats = {name: after[name] - before[name] for name in after}
    return run


def _counters(stats: WorkerStats) -> dict[str, int]:
    return {
        name: getattr(stats, name)
        for name in ("evictions", "loads", "recompute_preemptions", "tokens_generated")
    }


def measure(mix: str, num_requests: int, args: argparse.Namespace) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {path: [] for path in PATHS}
    for repeat in range(args.repeats):
        for path in PATHS if repeat % 2 == 0 else PATHS[::-1]:
            runs[path].append(
                run_once(
                    path,
                    mix,
                    num_requests,
                    warmup=args.warmup,
                    steps=args.steps,
                    seed=args.seed,
                    clock=args.clock,
                )
            )
    legacy_stats, plan_stats = runs["legacy"][0].stats, runs["plan"][0].stats
    if legacy_stats != plan_stats:
        raise SystemExit(
            f"{mix} x {num_requests}: the paths disagree: legacy {legacy_stats} vs plan"
            f" {plan_stats}"
        )
    return runs


def summarise(mix: str, num_requests: int, runs: dict[str, list[Run]], steps: int) -> dict:
    per_step = {path: [run.total_ns / steps / 1000 for run in runs[path]] for path in PATHS}
    ratios = [p / q for p, q in zip(per_step["plan"], per_step["legacy"])]
    return {
        "mix": mix,
        "num_requests": num_requests,
        "legacy_us_per_step": statistics.median(per_step["legacy"]),
        "plan_us_per_step": statistics.median(per_step["plan"]),
        "ratio_plan_legacy": statistics.median(ratios),
        "ratios": ratios,
        "us_per_step_samples": per_step,
        "us_per_step_by_op": {
            path: {
                op: statistics.median(r.ns_by_op[op] / steps / 1000 for r in runs[path])
                for op in KV_OPS
            }
            for path in PATHS
        },
        "window_stats": runs["legacy"][0].stats,
    }


def measure_in_processes(args: argparse.Namespace, console: Console) -> list[dict]:
    """Every cell measured in ``args.processes`` fresh interpreters, one after another (this script
    with ``--processes 1``, each with its own hash seed: an inherited ``PYTHONHASHSEED`` is not
    passed on); per cell, the median of the per-process figures. SystemExit (exit 1) naming a
    failing process, its exit status and its last error line, or one that ran past
    ``--process-timeout`` seconds (it is killed)."""
    runs: list[list[dict]] = []
    env = {name: value for name, value in os.environ.items() if name != "PYTHONHASHSEED"}
    with tempfile.TemporaryDirectory() as scratch:
        for k in range(args.processes):
            out = Path(scratch) / f"process{k}.json"
            try:
                done = subprocess.run(
                    [sys.executable, __file__, *child_argv(args), "--json-out", str(out)],
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=args.process_timeout,
                )
            except subprocess.TimeoutExpired:
                raise SystemExit(
                    f"process {k + 1} of {args.processes} ran past --process-timeout "
                    f"{args.process_timeout:g} s and was stopped"
                ) from None
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise SystemExit(
                    f"process {k + 1} of {args.processes} failed (exit {done.returncode}): {last}"
                )
            runs.append(json.loads(out.read_text())["rows"])
            console.log(
                f"process {k + 1}/{args.processes}: "
                + ", ".join(
                    f"{row['mix']} x {row['num_requests']} {row['ratio_plan_legacy']:.3f}"
                    for row in runs[-1]
                )
            )
    return [merge_processes(cells) for cells in zip(*runs, strict=True)]


def child_argv(args: argparse.Namespace) -> list[str]:
    """The command-line options of one process of ``--processes``: the same cells, steps and
    repeats. Pure."""
    return [
        "--sizes",
        ",".join(map(str, args.sizes)),
        "--mixes",
        ",".join(args.mixes),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--repeats",
        str(args.repeats),
        "--clock",
        args.clock,
        "--seed",
        str(args.seed),
        "--processes",
        "1",
    ]


def merge_processes(cells: Sequence[dict]) -> dict:
    """One cell's rows from several processes as one row: medians of their per-step figures and
    ratios, every repeat's ratio, and each process's ratio (``process_ratios``). SystemExit when the
    processes' timed windows differ (the trace is seeded: they must not). Pure otherwise."""
    first = cells[0]
    if any(cell["window_stats"] != first["window_stats"] for cell in cells):
        raise SystemExit(
            f"{first['mix']} x {first['num_requests']}: the processes' timed windows differ: "
            f"{[cell['window_stats'] for cell in cells]}"
        )
    by_op = {
        path: {
            op: statistics.median(cell["us_per_step_by_op"][path][op] for cell in cells)
            for op in KV_OPS
        }
        for path in PATHS
    }
    return {
        **first,
        "legacy_us_per_step": statistics.median(cell["legacy_us_per_step"] for cell in cells),
        "plan_us_per_step": statistics.median(cell["plan_us_per_step"] for cell in cells),
        "ratio_plan_legacy": statistics.median(cell["ratio_plan_legacy"] for cell in cells),
        "process_ratios": [cell["ratio_plan_legacy"] for cell in cells],
        "ratios": [ratio for cell in cells for ratio in cell["ratios"]],
        "us_per_step_samples": {
            path: [x for cell in cells for x in cell["us_per_step_samples"][path]] for path in PATHS
        },
        "us_per_step_by_op": by_op,
    }


def render(rows: Sequence[dict], title: str) -> Table:
    table = Table(title=title)
    for column in (
        "mix",
        "requests",
        "legacy us/step",
        "plan us/step",
        "plan/legacy",
        "evictions",
        "loads",
        "recomputes",
        "legacy x vs N0",
        "plan x vs N0",
    ):
        table.add_column(column, justify="left" if column == "mix" else "right")
    base: dict[str, dict] = {}
    for row in rows:
        first = base.setdefault(row["mix"], row)
        stats = row["window_stats"]
        table.add_row(
            row["mix"],
            str(row["num_requests"]),
            f"{row['legacy_us_per_step']:.0f}",
            f"{row['plan_us_per_step']:.0f}",
            f"{row['ratio_plan_legacy']:.2f}",
            str(stats["evictions"]),
            str(stats["loads"]),
            str(stats["recompute_preemptions"]),
            f"{row['legacy_us_per_step'] / first['legacy_us_per_step']:.1f}",
            f"{row['plan_us_per_step'] / first['plan_us_per_step']:.1f}",
        )
    return table


def render_ops(rows: Sequence[dict]) -> Table:
    table = Table(title="median us/step by op (legacy / plan)")
    table.add_column("mix")
    table.add_column("requests", justify="right")
    for op in KV_OPS:
        table.add_column(op, justify="right")
    for row in rows:
        by_op = row["us_per_step_by_op"]
        table.add_row(
            row["mix"],
            str(row["num_requests"]),
            *(f"{by_op['legacy'][op]:.0f} / {by_op['plan'][op]:.0f}" for op in KV_OPS),
        )
    return table


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    parser.add_argument(
        "--sizes",
        default="64,512,4096",
        help="comma list of concurrent request counts (default 64,512,4096)",
    )
    parser.add_argument(
        "--mixes", default=",".join(MIXES), help="comma list of decode, pressure (default both)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=200,
        help=(
            "timed steps per run (default 200: at 64 requests a shorter window holds too few "
            "finishes, evictions and loads; 30-step windows of one run differ by up to 10%%)"
        ),
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=24,
        help="untimed steps before timing, past the first admissions (default 24)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per path; the median is shown (default 3)"
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help=(
            "cpu: this thread's CPU time (steadier on shared, busy cores); wall: elapsed (default"
            " cpu)"
        ),
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the request stream (default 0)"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help=(
            "fresh interpreter processes to measure every cell in, one after another; a cell's "
            "ratio is the median of theirs (default 1: this process)"
        ),
    )
    parser.add_argument(
        "--process-timeout",
        type=float,
        metavar="SECONDS",
        help=(
            "with --processes: stop (and fail) a process still running after this many seconds "
            "(default: no limit)"
        ),
    )
    parser.add_argument(
        "--json-out", type=output_path, help="write the figures as JSON to this path"
    )
    args = parser.parse_args()
    try:
        args.sizes = [int(size) for size in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be a comma list of integers, got {args.sizes!r}")
    args.mixes = [mix.strip() for mix in args.mixes.split(",")]
    if any(size < 1 for size in args.sizes):
        parser.error("--sizes must be positive")
    if not set(args.mixes) <= set(MIXES):
        parser.error(f"--mixes must name {', '.join(MIXES)}, got {args.mixes}")
    if args.steps < 1 or args.repeats < 1 or args.processes < 1 or args.warmup < 0:
        parser.error("--steps, --repeats and --processes must be >= 1, --warmup >= 0")
    if args.process_timeout is not None and not args.process_timeout > 0:
        parser.error(
            f"--process-timeout must be a number of seconds > 0, got {args.process_timeout:g}"
        )
    return args


def main() -> None:
    args = parse_args()
    # the untimed sampler's tiny ops; fewer threads are steadier on shared cores
    torch.set_num_threads(1)
    console = Console(width=132)
    started = time.perf_counter()
    if args.processes > 1:
        rows = measure_in_processes(args, console)
    else:
        rows = []
        for mix in args.mixes:
            for num_requests in args.sizes:
                rows.append(
                    summarise(mix, num_requests, measure(mix, num_requests, args), args.steps)
                )
                console.log(
                    f"{mix} x {num_requests}: ratio plan/legacy {rows[-1]['ratio_plan_legacy']:.2f}"
                )
    machine = (
        f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} torch thread"
    )
    runs = (
        f"median of {args.repeats}"
        if args.processes == 1
        else f"median of {args.processes} processes x {args.repeats}"
    )
    title = (
        f"KV bookkeeping per step ({args.clock} clock, {args.steps} timed steps after"
        f" {args.warmup}, {runs}, legacy and plan interleaved) on {machine}"
    )
    console.print(render(rows, title))
    console.print(render_ops(rows))
    if args.processes > 1:
        for row in rows:
            low, high = min(row["process_ratios"]), max(row["process_ratios"])
            console.print(
                f"{row['mix']} x {row['num_requests']}: plan/legacy per process"
                f" {low:.3f}-{high:.3f}"
            )
    quiet = [
        row
        for row in rows
        if row["mix"] == "pressure"
        and not (row["window_stats"]["evictions"] and row["window_stats"]["loads"])
    ]
    for row in quiet:
        console.print(
            f"[bold red]warning: pressure x {row['num_requests']}: the timed window did not both"
            " evict and migrate[/]"
        )
    worst = max(rows, key=lambda row: row["ratio_plan_legacy"])
    verdict = "met" if worst["ratio_plan_legacy"] <= 1.0 else "NOT met"
    console.print(
        f"goal plan <= 1.0x legacy at every size: {verdict} "
        f"(worst {worst['ratio_plan_legacy']:.2f}x: {worst['mix']} x {worst['num_requests']})"
    )
    if args.json_out:
        write_output(
            args.json_out,
            json.dumps(
                {
                    "benchmark": "kv_ops",
                    "machine": machine,
                    "python": platform.python_version(),
                    "args": {
                        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                    },
                    "wall_s": round(time.perf_counter() - started, 1),
                    "rows": rows,
                },
                indent=2,
            ),
        )
        console.print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
