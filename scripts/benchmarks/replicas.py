"""``batchgen generate --replicas N``: lines per second of one job in this process against the same
job on replicas, on this machine.

One seeded HF Llama checkpoint (``--geometry``, default 512x8) with make-checkpoint's trained
tokenizer, and ``--num-lines`` completion lines (``generate.build_lines``: prompts of 8-24
corpus words, 8-24 new tokens, greedy). Each configuration runs the real command in a fresh
process (``python -m batchgen generate ... --threads T --json``), one after another, ``--repeats``
rounds taken in turns; its summary's ``wall_s`` (the first line handed out, or the first replica
ready, to the last result line: imports, Ray's start and the model loads left out) gives lines/s,
``driver_cpu_s`` the driver's CPU per line. The best round of each is compared with the run in
this process.

    python scripts/bench.py replicas [--num-lines 512] [--geometry 512x8] [--threads 1]
        [--configs inproc,processes-2,ray-2] [--repeats 2] [--flags "--block-lines 128"]
        [--json-out FILE]

``--driver-lines N`` measures the driver instead: N lines on 2 replicas without a model
(``NullReplica``: canned result lines at once), on both backends, so that the driver's own work per
line (read, block, hand out, take back, write) is all there is; and its parts alone.

    python scripts/bench.py replicas --driver-lines 20000
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from batchgen.cli import build_parser
from batchgen.cli.generate_replicas import generate_on_replicas
from batchgen.openai.batch_job import numbered_lines, scan_input
from batchgen.replicas.replica import Block, BlockResult, Replica, ReplicaInfo, node_name
from batchgen.text.tiny_checkpoint import write_tokenizer_files
from compare.jsonl_writer import JsonLinesFile

from .generate import MAX_CONTEXT, VOCAB_SIZE, build_lines
from .hf_checkpoint import hf_geometry, save_checkpoint

GOAL = 1.6  # 2 replicas against 1, lines/s
CANNED = json.dumps(  # a result line of the job's size: 16 tokens of text
    {
        "id": "batch_req_0123456789abcdef01234567",
        "custom_id": "bID",
        "response": {
            "status_code": 200,
            "request_id": "req_0123456789abcdef01234567",
            "body": {
                "id": "cmpl-0123456789abcdef01234567",
                "object": "text_completion",
                "created": 1796500000,
                "model": "model",
                "choices": [
                    {
                        "index": 0,
                        "text": " the cache" * 8,
                        "finish_reason": "length",
                        "logprobs": None,
                    }
                ],
                "usage": {"prompt_tokens": 20, "completion_tokens": 16, "total_tokens": 36},
            },
        },
        "error": None,
    }
)
CONFIGS = {  # name -> the flags beyond the job's own
    "inproc": [],
    "processes-1": ["--replicas", "1", "--backend", "processes"],
    "processes-2": ["--replicas", "2", "--backend", "processes"],
    "ray-1": ["--replicas", "1", "--backend", "ray", "--num-cpus", "2"],
    "ray-2": ["--replicas", "2", "--backend", "ray", "--num-cpus", "2"],
}


def run_job(model: Path, input_path: Path, flags: list[str], threads: int) -> dict:
    """One job in a fresh process; its summary. RuntimeError with stderr's tail when it fails."""
    out = input_path.with_suffix(".out.jsonl")
    command = [sys.executable, "-m", "batchgen", "generate", "-i", str(input_path), "-o", str(out)]
    command += ["--model", str(model), "--threads", str(threads), "--json", *flags]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: exit {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, model: Path, input_path: Path) -> dict[str, list[dict]]:
    """Every configuration ``--repeats`` times, in turns; name -> its summaries."""
    names = args.configs.split(",")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names:
            flags = CONFIGS[name] + (args.flags.split() if name != "inproc" else [])
            summary = run_job(model, input_path, flags, args.threads)
            runs[name].append(summary)
            rate = summary["lines_done"] / summary["wall_s"]
            print(f"round {repeat + 1} {name}: {rate:.1f} lines/s", flush=True)
    return runs


class NullReplica(Replica):
    """A replica without a model: each line's result is a canned completion line, at once. What
    the driver does per line (read, block, hand out, take back, write) is then all there is."""

    def __init__(self, spec, share):
        self.spec = spec

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(node_name(), None, 0, 0)

    def run_block(self, block: Block) -> BlockResult:
        lines = tuple(CANNED.replace("ID", str(number)) for number, _ in block.lines)
        return BlockResult(block.block_id, lines, 0, 16 * len(lines), {}, (), 0.0)

    def finish(self) -> tuple[str, ...]:
        return ()


def driver_ceiling(args: argparse.Namespace, input_path: Path, backend: str) -> dict:
    """The driver's lines/s and CPU per line with NullReplicas: its ceiling. Starts (then stops)
    Ray for ``ray``, the folder of the ``benchmarks`` package on its workers' path."""
    if backend == "ray":
        import ray

        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}},
        )
    out = input_path.with_suffix(".null.jsonl")
    flags = ["--replicas", "2", "--backend", backend, "--json", *args.flags.split()]
    argv = ["generate", "-i", str(input_path), "-o", str(out), "--model", "null", *flags]
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(io.StringIO()):
            assert generate_on_replicas(build_parser().parse_args(argv), replica=NullReplica) == 0
    finally:
        if backend == "ray":
            ray.shutdown()
    summary = json.loads(buffer.getvalue().strip().splitlines()[-1])
    return {
        "backend": backend,
        "lines": summary["lines_done"],
        "lines_per_s": summary["lines_done"] / summary["wall_s"],
        "driver_cpu_ms_per_line": 1000 * summary["driver_cpu_s"] / summary["lines_done"],
    }


def print_table(args: argparse.Namespace, runs: dict[str, list[dict]]) -> bool:
    """The configurations side by side, each against the run in this process; returns whether
    2 replicas reached ``GOAL`` x its lines/s."""

    def rate(summary: dict) -> float:
        return summary["lines_done"] / summary["wall_s"]

    base = max(map(rate, runs.get("inproc") or next(iter(runs.values()))))
    title = (
        f"generate --replicas: {args.num_lines} lines, {args.geometry}, {args.threads} thread(s)"
    )
    table = Table(title=title)
    columns = (
        "config",
        "lines/s (best)",
        "each",
        "x in-process",
        "driver ms/line",
        "replica CPU s",
    )
    for column in columns:
        table.add_column(column, justify="right")
    met = True
    for name, summaries in runs.items():
        best = max(summaries, key=rate)
        ratio = rate(best) / base
        if name.endswith("-2"):
            met = met and ratio >= GOAL
        cpu = (
            "-"
            if "driver_cpu_s" not in best
            else f"{1000 * best['driver_cpu_s'] / best['lines_done']:.2f}"
        )
        each = ", ".join(f"{rate(s):.1f}" for s in summaries)
        replica_cpu = f"{best['replica_cpu_s']:.1f}" if "replica_cpu_s" in best else "-"
        table.add_row(name, f"{rate(best):.1f}", each, f"{ratio:.2f}", cpu, replica_cpu)
    Console().print(table)
    print(f"goal: 2 replicas >= {GOAL}x the lines/s in this process: {'met' if met else 'MISSED'}")
    return met


def print_ceiling(args: argparse.Namespace) -> int:
    """The driver's ceiling on both backends (``driver_ceiling``), printed (and saved)."""
    with tempfile.TemporaryDirectory() as tmp:
        input_path = Path(tmp) / "in.jsonl"
        lines = build_lines(args.driver_lines, args.seed)
        input_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        ceilings = [driver_ceiling(args, input_path, b) for b in ("processes", "ray")]
        parts = driver_parts(input_path)
    for ceiling in ceilings:
        print(
            f"driver ceiling, {ceiling['backend']}: {ceiling['lines']} lines,"
            f" {ceiling['lines_per_s']:.0f} lines/s, {ceiling['driver_cpu_ms_per_line']:.3f} ms"
            " of driver CPU per line"
        )
    print(
        f"per line: the duplicate check at start {parts['scan_us_per_line']:.1f} us, the reader"
        f" {parts['reader_us_per_line']:.1f} us, the writer {parts['writer_us_per_line']:.1f} us"
    )
    if args.json_out:
        results = {"args": vars(args), "ceilings": ceilings, "parts": parts}
        Path(args.json_out).write_text(json.dumps(results))
    return 0


def driver_parts(input_path: Path) -> dict:
    """Microseconds per line of the driver's parts, best of 3: the start's duplicate check
    (``scan_input``, a JSON parse a line), the input reader (``numbered_lines``) and the one
    writer (``JsonLinesFile.write_line`` of a canned result line)."""
    num_lines = sum(1 for _ in numbered_lines(input_path))
    out = JsonLinesFile(input_path.with_suffix(".parts.jsonl"))
    out.open()
    parts = {
        "scan_us_per_line": lambda: scan_input(input_path),
        "reader_us_per_line": lambda: sum(1 for _ in numbered_lines(input_path)),
        "writer_us_per_line": lambda: [out.write_line(CANNED) for _ in range(num_lines)],
    }
    best = {}
    for name, part in parts.items():
        times = []
        for _ in range(3):
            started = time.perf_counter()
            part()
            times.append(time.perf_counter() - started)
        best[name] = 1e6 * min(times) / num_lines
    out.close()
    return best


def main(argv: list[str], prog: str) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-lines", type=int, default=512)
    parser.add_argument("--geometry", default="512x8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default="inproc,processes-2,ray-2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--flags", default="", help="more flags for the runs on replicas")
    parser.add_argument("--json-out", default=None)
    parser.add_argument(
        "--driver-lines",
        type=int,
        default=0,
        help="instead: the driver's ceiling, N lines on replicas without a model (NullReplica)",
    )
    args = parser.parse_args(argv)
    if args.driver_lines:
        return print_ceiling(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        save_checkpoint(
            str(model), hf_geometry(args.geometry, VOCAB_SIZE), args.seed, torch.float32
        )
        write_tokenizer_files(model, VOCAB_SIZE, MAX_CONTEXT)
        input_path = Path(tmp) / "in.jsonl"
        lines = build_lines(args.num_lines, args.seed)
        input_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        runs = measure(args, model, input_path)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0 if print_table(args, runs) else 1
