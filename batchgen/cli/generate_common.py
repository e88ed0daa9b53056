"""What a ``generate`` job needs however it runs, in this process (``generate``) or on replicas
(``generate_replicas``): its files checked before anything loads, the model on its worker, OUT
opened (or resumed), the progress bar, and the model name lines may give."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from batchgen.cli.common import UsageError, check_output_file
from batchgen.cli.run_flags import engine_config_from_args
from batchgen.config import EngineConfig
from batchgen.engine.worker import Worker
from batchgen.entrypoints.pool_sizes import cache_config
from batchgen.finish.gate import FINISH_GATES
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.openai.batch_job import BatchJob, JobCounts, result_keys, scan_input
from batchgen.shadow.wiring import gated_worker
from compare.jsonl_writer import JsonLinesFile


def checked_files(args: argparse.Namespace, gate: KvGateConfig) -> int:
    """UsageError for an input that cannot be read, an output that cannot be written or is another
    file of the job, or duplicate custom_ids; returns the input's number of lines."""
    if not Path(args.input).is_file():
        raise UsageError(f"--input {args.input}: no such file")
    check_output_file("--output", args.output, "the results")
    target = Path(args.output).resolve()
    others = {"--input": args.input}
    if gate.compare != "off":
        others["the divergence log"] = gate.compare_log
    for what, path in others.items():
        if Path(path).resolve() == target:
            raise UsageError(f"--output {args.output}: it is {what}; name another file")
    scan = scan_input(args.input)
    if scan.duplicates:
        shown = ", ".join(repr(d) for d in scan.duplicates[:10])
        raise UsageError(
            f"--input {args.input}: {len(scan.duplicates)} custom_ids are used by more than one"
            f" line ({shown}); each line needs its own, or results could not be told apart"
        )
    return scan.num_lines


def job_worker(args: argparse.Namespace, gate: KvGateConfig) -> Worker:
    """The model on its worker, pools sized from the flags, its finish step's gate from theirs
    over the environment. Sets torch's CPU threads."""
    finish_gate = FINISH_GATES.parse_options(os.environ, args)  # before the model loads
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = load_model(
        args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len
    )
    cache = cache_config(
        model.config,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        gpu_pages=args.gpu_pages,
        host_pages=args.host_pages,
        kv_cache_gib=args.kv_cache_gib,
        gpu_memory_fraction=args.gpu_memory_fraction,
        host_memory_fraction=args.host_memory_fraction,
    )
    engine = EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
    )
    return gated_worker(
        model,
        cache_config=cache,
        engine_config=engine_config_from_args(engine, args),
        kv_gate=gate,
        finish_gate=finish_gate,
        device=args.device,
    )


def open_results(args: argparse.Namespace) -> tuple[JsonLinesFile, set[str]]:
    """OUT opened for appending; with ``--resume`` a torn last line is cut off and the done lines'
    keys returned, else OUT is emptied. Mutates OUT."""
    out = JsonLinesFile(args.output)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    out.open(readable=True)
    if not args.resume:
        out.truncate()
        return out, set()
    torn = out.cut_torn_tail()
    if torn:
        print(f"batchgen: warning: {args.output}: cut off a torn last line", file=sys.stderr)
    try:
        return out, result_keys(args.output)
    except ValueError as error:
        out.close()
        raise UsageError(f"--resume: {error}; OUT must hold result lines only") from None


class ProgressBar:
    """A progress bar on stderr: lines done of the lines to do, and tokens/s. Sets the job's
    ``on_progress``."""

    def __init__(self, job: BatchJob, total: int):
        self.job, self.total = job, total
        self.bar = Progress(
            TextColumn("generate"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} lines"),
            TextColumn("{task.fields[rate]} tokens/s"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )

    def __enter__(self):
        self.bar.__enter__()
        task = self.bar.add_task("generate", total=self.total, rate="0")
        started = time.perf_counter()

        def on_progress(counts: JobCounts) -> None:
            rate = counts.tokens_generated / max(time.perf_counter() - started, 1e-9)
            self.bar.update(task, completed=counts.lines_done, rate=f"{rate:.0f}")

        self.job.on_progress = on_progress
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)


def served_name(model: str) -> str:
    """The name a job serves ``model`` under: a directory's name, a GGUF file's stem. Pure."""
    path = Path(model).resolve()
    return path.stem if path.suffix.lower() == ".gguf" else path.name
