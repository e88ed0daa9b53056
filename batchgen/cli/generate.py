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

from batchgen.cli.common import StdoutConsole, key_value_table
from batchgen.cli.generate_common import (
    ProgressBar,
    checked_files,
    job_worker,
    open_results,
    served_name,
)
from batchgen.cli.generate_flags import EPILOG, add_generate_args, is_replicated
from batchgen.cli.run_files import closing_compare_log, open_compare_log, print_divergences_logged
from batchgen.cli.run_flags import gate_from_args
from batchgen.engine.worker import Worker
from batchgen.entrypoints.process_age import process_age_s
from batchgen.exit_codes import EXIT_OK
from batchgen.metrics.config import add_metrics_args, metrics_config_from_args
from batchgen.metrics.exporter import exporting
from batchgen.openai.batch_job import BatchJob, JobCounts, numbered_lines
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
    num_lines = checked_files(args, gate)
    defaults = read_generation_defaults(args.model, args.generation_config)
    if defaults.warning() is not None:
        print(f"batchgen: warning: {defaults.warning()}", file=sys.stderr)
    tokenizer = TextTokenizer(args.model)  # a checkpoint without one fails before the model loads
    worker = job_worker(args, gate)
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
            with ProgressBar(job, num_lines - len(skip)):
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


def _open_output(args: argparse.Namespace, worker: Worker) -> tuple[JsonLinesFile, set[str]]:
    """OUT opened (``open_results``), and the divergence log, so an unwritable one fails now."""
    open_compare_log(worker)
    return open_results(args)


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
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "gpu_pages": cache.num_gpu_pages,
        "host_pages": cache.num_host_pages,
    }
    run = engine.finish_run()
    if run is not None:
        summary["steps_compared"] = sum(run.steps_compared.values())
        summary["divergences"] = sum(run.divergences.values())
    return summary
