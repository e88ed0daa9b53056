"""Sweep throughput at 1 and 2 CPUs, and what the driver costs per 1,000 records.

Part 1, throughput. One matrix (``--workload`` x ``--runs`` seeds, plan serving, legacy
shadowed) runs on each backend (``--backends``) at each CPU count (``--cpus``): a local Ray
instance of N CPUs, or N worker processes. The backend starts and its workers warm up on N
smoke runs first (untimed: a worker imports torch once); then the matrix is timed, wall clock,
from the first task submitted to the last result merged. Each (backend, CPU count) is measured
``--throughput-repeats`` times, in turns, and the best is kept (other processes on shared cores
only slow a run down). Scaling efficiency at N CPUs = runs/min at N / (N x runs/min at the
smallest count). The 1-minute load average before and after is printed beside them.

Part 2, the driver. run_sweep merges precomputed task results (an in-process backend hands each
cell's lines over at once, as new strings, as from a worker, so only the driver's work is
measured: keeping each run's lines, parsing its summary, writing the merged log, parsing every
line into ``aggregate``, rendering and writing the reports, the HTML page included). The HTML
page charts at most 60 runs, so its cost is nearly a constant: it is also timed alone, rendered
from the merged log (``html s``). Two kinds of record: a clean run's
``RunSummary`` (the usual line), and a ``DivergenceRecord`` with its replay pre-state (the largest
line a log holds), each ``--records`` lines. Time: the best of ``--repeats``; memory:
tracemalloc's peak of the Python heap during the merge (a separate, untimed pass).

Part 3, the driver's task loop: ``--noop-tasks`` tasks that return at once, through map_runs on
each backend at the largest CPU count: tasks per second the loop hands out and collects, the
ceiling on runs per second whatever the cluster size.

Numbers are wall-clock on whatever machine runs this (shared cores are noisy): compare them side by
side, within one run.

    python scripts/bench.py sweep --json-out bench_sweep.json
    python scripts/bench.py sweep --runs 2 --cpus 1 --backends processes --records 50
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tracemalloc
from functools import partial
from pathlib import Path
from tempfile import TemporaryDirectory

from batchgen.shadow.coverage import CATALOG
from batchgen.shadow.report_page import render_page
from batchgen.sweep.backends import ProcessBackend, RayBackend, SweepBackend
from batchgen.sweep.driver import run_sweep
from batchgen.sweep.matrix import sweep_cells, sweep_directions, sweep_workloads
from compare import aggregate, read_log

PLAN = sweep_directions("plan", aa_check=False)


def main(argv: list[str], prog: str) -> int:
    args = parse_args(argv, prog)
    load_before = os.getloadavg()[0]
    figures = {
        "throughput": best_throughput(args),
        "merge": [
            merge_cost(kind, args.records, args.repeats) for kind in ("summary", "divergence")
        ],
        "task_loop": [
            task_loop(backend, max(args.cpus), args.noop_tasks) for backend in args.backends
        ],
    }
    figures["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    add_scaling_efficiency(figures["throughput"])
    print(render(figures))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="L2-2048")
    parser.add_argument("--runs", type=int, default=12, help="seeds 0..runs-1 (default: 12)")
    parser.add_argument("--cpus", type=lambda t: [int(n) for n in t.split(",")], default=[1, 2])
    parser.add_argument("--backends", type=lambda t: t.split(","), default=["processes", "ray"])
    parser.add_argument("--throughput-repeats", type=int, default=2)
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--noop-tasks", type=int, default=400)
    parser.add_argument("--json-out", default=None)
    return parser.parse_args(argv)


def new_backend(name: str, cpus: int) -> SweepBackend:
    return RayBackend(num_cpus=cpus) if name == "ray" else ProcessBackend(cpus)


def best_throughput(args: argparse.Namespace) -> list[dict]:
    """Each (backend, CPU count)'s best of ``--throughput-repeats`` measurements, taken in turns
    (1, 2, 1, 2, ... CPUs), with every measurement's runs/min."""
    samples: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.throughput_repeats):
        for backend in args.backends:
            for cpus in args.cpus:
                samples.setdefault((backend, cpus), []).append(throughput(backend, cpus, args))
    return [
        {
            **max(rows, key=lambda row: row["runs_per_minute"]),
            "samples_runs_per_minute": [row["runs_per_minute"] for row in rows],
        }
        for rows in samples.values()
    ]


def throughput(backend_name: str, cpus: int, args: argparse.Namespace) -> dict:
    """Runs per minute of the matrix on ``backend_name`` with ``cpus`` CPUs, workers warm."""
    cells = sweep_cells(sweep_workloads([args.workload]), range(args.runs), (None,), PLAN)
    warmup = sweep_cells(sweep_workloads(["smoke"]), range(cpus), (None,), PLAN)
    with TemporaryDirectory() as directory, new_backend(backend_name, cpus) as backend:
        run_sweep(warmup, backend, reports_dir=Path(directory) / "warmup")
        started = time.perf_counter()
        result = run_sweep(cells, backend, reports_dir=directory)
        wall_s = time.perf_counter() - started
    if not result.ok:
        raise SystemExit(f"{backend_name} at {cpus} CPUs: the sweep failed: {result.failures}")
    return {
        "backend": backend_name,
        "cpus": cpus,
        "runs": len(cells),
        "wall_s": round(wall_s, 2),
        "runs_per_minute": round(60 * len(cells) / wall_s, 2),
    }


def add_scaling_efficiency(rows: list[dict]) -> None:
    """Each row's runs/min over (its CPUs x the smallest CPU count's runs/min per CPU), per
    backend. Mutates ``rows``."""
    for row in rows:
        base = min((r for r in rows if r["backend"] == row["backend"]), key=lambda r: r["cpus"])
        per_cpu = base["runs_per_minute"] / base["cpus"]
        row["scaling_efficiency"] = round(row["runs_per_minute"] / (row["cpus"] * per_cpu), 3)


class InlineBackend(SweepBackend):
    """Runs each task in the driver, at once: what is left to time is the driver's own work."""

    num_workers = capacity = 1 << 30

    def close(self) -> None:
        pass

    def _submit(self, function, argument):
        return function(argument)

    def _wait(self, handles, timeout_s):
        return handles

    def _result(self, handle):
        return handle

    def _cancel(self, handles):
        pass


def sample_lines(kind: str) -> tuple[str, tuple[str, ...]]:
    """(run id, a run's log lines) of one smoke run: its summary alone, or one divergence (the
    plan path handing out pages in reverse) and its summary."""
    # the worker processes start from this sys.path: the source tree first, so that tests/compare
    # (no __init__) cannot shadow the compare package there
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root)]
    sys.path.append(str(root / "tests"))
    from sweep_tasks import run_with_reversed_grants

    from batchgen.sweep.matrix import run_cell

    cell = sweep_cells(sweep_workloads(["smoke"]), (0,), (None,), PLAN)[0]
    lines = run_with_reversed_grants(cell) if kind == "divergence" else run_cell(cell)
    return cell.run_id, (lines[0], lines[-1]) if kind == "divergence" else lines


def merge_cost(kind: str, num_records: int, repeats: int) -> dict:
    """The driver's time and peak Python heap to merge ``num_records`` records of ``kind``."""
    run_id, lines = sample_lines(kind)
    num_runs = max(1, num_records // len(lines))
    cells = sweep_cells(sweep_workloads(["smoke"]), range(num_runs), (None,), PLAN)
    by_cell = {cell: tuple(line.replace(run_id, cell.run_id) for line in lines) for cell in cells}
    run = partial(received_lines, by_cell)
    times = []
    with TemporaryDirectory() as directory:
        for _ in range(repeats):
            started = time.perf_counter()
            run_sweep(cells, InlineBackend(), reports_dir=directory, run=run)
            times.append(time.perf_counter() - started)
        tracemalloc.start()
        run_sweep(cells, InlineBackend(), reports_dir=directory, run=run)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        log_path = Path(directory) / "divergences.jsonl"
        log_bytes = log_path.stat().st_size
        html_s = html_page_seconds(log_path, repeats)
    num_lines = num_runs * len(lines)
    per_thousand = 1000 / num_lines
    return {
        "kind": kind,
        "records": num_lines,
        "log_bytes_per_1000": round(log_bytes * per_thousand),
        "merge_s_per_1000": round(min(times) * per_thousand, 4),
        "peak_heap_mib_per_1000": round(peak * per_thousand / 2**20, 2),
        "html_page_s": round(html_s, 3),
    }


def html_page_seconds(log: Path, repeats: int) -> float:
    """The best of ``repeats`` renderings of the merged log's HTML page (charts included)."""
    records = read_log(log).records
    report = aggregate(records, CATALOG)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        render_page(report, [(str(log), records)])
        times.append(time.perf_counter() - started)
    return min(times)


def received_lines(by_cell: dict, cell) -> tuple[str, ...]:
    """The cell's lines as new strings, as a task's result arrives: the driver holds a copy."""
    return tuple(line.encode().decode() for line in by_cell[cell])


def noop(argument: int) -> int:
    return argument


def task_loop(backend_name: str, cpus: int, num_tasks: int) -> dict:
    """Tasks per second through map_runs for a function that returns at once."""
    if backend_name == "ray":  # Ray's workers cannot import this module: send ``noop`` whole
        import ray.cloudpickle

        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with new_backend(backend_name, cpus) as backend:
        backend.map_runs(noop, range(cpus), lambda index, outcome: None)  # workers up
        started = time.perf_counter()
        backend.map_runs(noop, range(num_tasks), lambda index, outcome: None)
        wall_s = time.perf_counter() - started
    return {"backend": backend_name, "cpus": cpus, "tasks_per_s": round(num_tasks / wall_s, 1)}


def render(figures: dict) -> str:
    lines = ["backend    cpus  runs  wall s  runs/min  scaling efficiency"]
    lines += [
        f"{r['backend']:<10} {r['cpus']:>4} {r['runs']:>5} {r['wall_s']:>7} "
        f"{r['runs_per_minute']:>9} {r['scaling_efficiency']:>19}"
        for r in figures["throughput"]
    ]
    lines += [f"1-minute load average before and after: {figures['load_average_1min']}"]
    lines += ["", "merge, per 1,000 records   log MiB   merge s   peak heap MiB   html s (alone)"]
    lines += [
        f"{m['kind']:<26} {m['log_bytes_per_1000'] / 2**20:>8.2f} {m['merge_s_per_1000']:>9}"
        f" {m['peak_heap_mib_per_1000']:>15} {m['html_page_s']:>16}"
        for m in figures["merge"]
    ]
    lines += ["", "task loop (no-op tasks)    tasks/s"]
    lines += [
        f"{t['backend']:<10} at {t['cpus']} CPUs    {t['tasks_per_s']:>10}"
        for t in figures["task_loop"]
    ]
    return "\n".join(lines)
