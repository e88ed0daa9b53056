"""``batchgen generate -i IN.jsonl -o OUT.jsonl --model DIR``: an OpenAI batch file through the
worker, text through the checkpoint's own tokenizer (``batchgen.openai.batch_job``).

Order of work: the KV gate and the files are checked (duplicate custom_ids stop the job here,
exit 2), then the model loads, OUT is opened (replaced, or with ``--resume`` cut back to whole
lines and read for the lines already done), the job runs under a progress bar, and a summary is
printed. However the job ends, OUT is closed in whole lines and, in compare mode, the divergence
log gets the run's summary. With ``--metrics-port`` / ``--metrics-file`` the metrics watch the
text engine's requests, releases and steps (``TextEngine.live``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from batchgen.cli.common import StdoutConsole, UsageError, check_output_file, key_value_table
from batchgen.cli.generate_flags import EPILOG, add_generate_args, is_replicated
from batchgen.cli.run_files import closing_compare_log, open_compare_log, print_divergences_logged
from batchgen.cli.run_flags import engine_config_from_args, gate_from_args
from batchgen.config import EngineConfig
from batchgen.engine.worker import Worker
from batchgen.entrypoints.pool_sizes import cache_config
from batchgen.entrypoints.process_age import process_age_s
from batchgen.exit_codes import EXIT_OK
from batchgen.kv.gate import KvGateConfig
from batchgen.metrics.config import add_metrics_args, metrics_config_from_args
from batchgen.metrics.exporter import exporting
from batchgen.model.loader import load_model
from batchgen.openai.batch_job import BatchJob, JobCounts, numbered_lines, result_keys, scan_input
from batchgen.shadow.wiring import gated_worker
from batchgen.text.generation import TextEngine
from batchgen.text.generation_defaults import read_generation_defaults
from batchgen.text.tokenizer import TextTokenizer
from compare import exception_text
from compare.jsonl_writer import JsonLinesFile


def add_generate_command(commands) -> None:
    parser = commands.add_parser(
        "generate",
        help="run an OpenAI batch file (completions and chat lines) and write its results",
        description=(
            "Run an OpenAI batch input file through the worker and write the batch output file:"
            " /v1/completions and /v1/chat/completions lines, text through the checkpoint's own"
            " tokenizer and chat template. A drop-in for `vllm run-batch` on these files."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_generate_args(parser)
    add_metrics_args(parser)
    parser.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    if is_replicated(args):  # --replicas N, --backend: docs/replicas.md
        from batchgen.cli.generate_replicas import generate_on_replicas

        return generate_on_replicas(args)
    gate = gate_from_args(args)
    metrics = metrics_config_from_args(os.environ, args)
    num_lines = _checked_files(args, gate)
    defaults = read_generation_defaults(args.model, args.generation_config)
    if defaults.warning() is not None:
        print(f"batchgen: warning: {defaults.warning()}", file=sys.stderr)
    tokenizer = TextTokenizer(args.model)  # a checkpoint without one fails before the model loads
    worker = _worker(args, gate)
    engine = TextEngine(worker, tokenizer)
    out, skip = _open_output(args, worker)
    job = BatchJob(
        engine,
        out,
        served_model=args.served_model_name or served_name(args.model),
        seed=args.seed,
        max_in_flight=args.max_in_flight,
        skip=skip,
        defaults=defaults,
    )
    started, startup_s = time.perf_counter(), process_age_s()
    engine.start_run(Path(args.input).name, seed=args.seed, source=str(Path(args.input).resolve()))
    with exporting(metrics) as worker_metrics, closing_compare_log(worker):
        if worker_metrics is not None:
            engine.live = worker_metrics.begin_run(worker, Path(args.input).name)
        try:
            with _ProgressBar(job, num_lines - len(skip)):
                try:
                    job.run(numbered_lines(args.input))
                finally:
                    out.close()
        except BaseException as error:  # Ctrl-C, SIGTERM, a failed write: the log's summary says
            with contextlib.suppress(Exception):  # the job's own error is the one to report
                engine.finish_run(stopped_by=exception_text(error))
            raise
        summary = _summary(job.counts, time.perf_counter() - started, startup_s, engine, worker)
    if args.json:
        print(json.dumps(summary))
    else:
        StdoutConsole().print(key_value_table(f"batchgen generate: {args.input}", summary))
    print_divergences_logged(worker)
    return EXIT_OK


def _checked_files(args: argparse.Namespace, gate: KvGateConfig) -> int:
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


def _worker(args: argparse.Namespace, gate: KvGateConfig) -> Worker:
    """The model on its worker, pools sized from the flags. Sets torch's CPU threads."""
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
        device=args.device,
    )


def _open_output(args: argparse.Namespace, worker: Worker) -> tuple[JsonLinesFile, set[str]]:
    """OUT opened (``open_results``), and the divergence log, so an unwritable one fails now."""
    open_compare_log(worker)
    return open_results(args)


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


class _ProgressBar:
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


def _summary(
    counts: JobCounts, wall_s: float, startup_s: float | None, engine: TextEngine, worker: Worker
) -> dict:
    """The job's summary (docs/generate.md says what each key measures). Finishes the compare
    run."""
    stats, cache = worker.state.stats, worker.cache_config
    startup_s = startup_s if startup_s is not None else 0.0
    summary = {
        "lines_done": counts.lines_done,
        "lines_failed": counts.lines_failed,
        "lines_skipped": counts.lines_skipped,
        "tokens_generated": counts.tokens_generated,
        "startup_s": round(startup_s, 3),
        "wall_s": round(wall_s, 3),
        "end_to_end_s": round(startup_s + wall_s, 3),
        "tokens_per_s": round(counts.tokens_generated / wall_s, 1) if wall_s else 0.0,
        "text_cpu_s": round(engine.text_cpu.seconds, 3),
        "evictions": stats.evictions,
        "loads": stats.loads,
        "recompute_preemptions": stats.recompute_preemptions,
        "gpu_pages": cache.num_gpu_pages,
        "host_pages": cache.num_host_pages,
    }
    run = engine.finish_run()
    if run is not None:
        summary["steps_compared"] = sum(run.steps_compared.values())
        summary["divergences"] = sum(run.divergences.values())
    return summary
