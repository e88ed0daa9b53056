"""``batchgen generate --replicas N --backend ray|processes``: one input, N replicas, one output
(``batchgen.replicas``; docs/replicas.md).

Order of work: the flags and files are checked as for a job in this process (duplicate custom_ids
stop it, exit 2), the replicas' backend starts (more replicas than CPUs: exit 2, one line), OUT is
opened (replaced, or cut back and read with ``--resume``), the replicas load and the driver runs
the job under one progress bar, then one summary. The driver holds the job's files: OUT, the one
divergence log (each replica's compare records, sent back with its blocks) and the metrics (each
replica's counters, under a ``replica`` label). However the job ends, OUT is closed in whole lines
and the replicas are stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path

from batchgen.cli.backend_args import check_backend_args
from batchgen.cli.common import StdoutConsole, UsageError, key_value_table
from batchgen.cli.generate_common import (
    ProgressBar,
    checked_files,
    job_worker,
    open_results,
    served_name,
)
from batchgen.cli.generate_flags import DEFAULT_BLOCK_LINES, DEFAULT_MAX_RETRIES
from batchgen.cli.run_flags import gate_from_args
from batchgen.engine.host_malloc import keep_freed_memory
from batchgen.entrypoints.process_age import process_age_s
from batchgen.exit_codes import EXIT_FAILED, EXIT_OK
from batchgen.kv.gate import KvGateConfig
from batchgen.metrics.config import metrics_config_from_args
from batchgen.metrics.exporter import exporting
from batchgen.openai.batch_job import numbered_lines
from batchgen.replicas.driver import ReplicasLost, ReplicatedJob
from batchgen.replicas.metrics import ReplicaMetrics
from batchgen.replicas.pools import ProcessReplicas, ReplicaPool
from batchgen.replicas.ray_pool import RayReplicas
from batchgen.replicas.replica import Replica, ReplicaFactory, ReplicaSpec
from batchgen.sweep.backends import BackendError
from batchgen.text.generation import TextEngine
from batchgen.text.generation_defaults import GenerationDefaults, read_generation_defaults
from batchgen.text.tokenizer import TextTokenizer
from compare import DivergenceRecord, RunSummary, parse_record
from compare.sink import JsonlSink
from compare.wording import plural


def generate_on_replicas(args: argparse.Namespace, *, replica: ReplicaFactory = Replica) -> int:
    """The job on ``args.replicas`` replicas built by ``replica`` (a Replica, or a test's
    subclass). Returns the exit code; raises what ``main`` turns into one."""
    args = argparse.Namespace(**{**vars(args), "backend": args.backend or "ray"})
    check_backend_args(args)
    gate = gate_from_args(args)
    if gate.compare == "raise":
        raise UsageError("--kv-compare raise stops a job at its first divergence; on replicas: log")
    metrics = metrics_config_from_args(os.environ, args)
    num_lines = checked_files(args, gate)
    log = _open_divergence_log(gate)
    spec = replica_spec(args, gate)
    # stdout holds the summary alone: Ray's driver prints its own notices (a worker died) there
    with contextlib.redirect_stdout(sys.stderr), _replica_pool(args, replica, spec) as pool:
        out, skip = open_results(args)
        job = ReplicatedJob(
            pool,
            out,
            block_lines=args.block_lines or DEFAULT_BLOCK_LINES,
            max_retries=DEFAULT_MAX_RETRIES if args.max_retries is None else args.max_retries,
            num_lines=num_lines,
            skip=skip,
        )
        with exporting(metrics, ReplicaMetrics) as replica_metrics:
            records = ReplicaRecords(log, replica_metrics, spec.run_name)
            job.on_records = records.add
            cpu = time.process_time()
            try:
                with ProgressBar(job, num_lines - len(skip)):
                    job.run(numbered_lines(args.input))
                times = _times(job.first_ready_at, time.process_time() - cpu)
            except ReplicasLost as lost:
                print(f"batchgen: error: {lost}", file=sys.stderr)
                return EXIT_FAILED
            finally:
                out.close()
                if log is not None:
                    log.close()
    summary = _summary(args, job, times, records.summaries if gate.compare != "off" else None)
    if args.json:
        print(json.dumps(summary))
    else:
        StdoutConsole().print(key_value_table(f"batchgen generate: {args.input}", summary))
    _print_divergences_logged(records.num_divergences, gate.compare_log)
    return EXIT_OK


def replica_spec(args: argparse.Namespace, gate: KvGateConfig) -> ReplicaSpec:
    """What each replica builds: the flags (paths made absolute: a node resolves them as the
    driver does) and the gate. Pure."""
    flags = {key: value for key, value in vars(args).items() if key != "handler"}
    flags["model"] = os.path.abspath(args.model)
    if args.generation_config not in ("auto", "vllm"):
        flags["generation_config"] = os.path.abspath(args.generation_config)
    return ReplicaSpec(
        build=partial(build_replica_engine, argparse.Namespace(**flags), gate),
        served_model=args.served_model_name or served_name(args.model),
        seed=args.seed,
        max_in_flight=args.max_in_flight,
        run_name=Path(args.input).name,
        source=str(Path(args.input).resolve()),
    )


def build_replica_engine(
    args: argparse.Namespace, gate: KvGateConfig, share: int
) -> tuple[TextEngine, GenerationDefaults]:
    """A replica's engine, on the node it runs on: the model, its tokenizer and pools sized from
    1/``share`` of the memory caps (``share``: the replicas on this node), ``--threads`` torch
    threads (default 1), the divergence log a temporary file of its own. Sets torch's threads and
    the process's malloc (``keep_freed_memory``, as the command line does)."""
    keep_freed_memory()
    caps = {
        "kv_cache_gib": args.kv_cache_gib / share,
        "gpu_memory_fraction": args.gpu_memory_fraction / share,
        "host_memory_fraction": args.host_memory_fraction / share,
        "threads": args.threads or 1,
    }
    args = argparse.Namespace(**{**vars(args), **caps})
    if gate.compare != "off" or gate.verify != "off":
        log = Path(tempfile.gettempdir()) / f"batchgen-replica-{uuid.uuid4().hex}.jsonl"
        gate = gate.model_copy(update={"compare_log": str(log)})
    defaults = read_generation_defaults(args.model, args.generation_config)
    tokenizer = TextTokenizer(args.model)
    return TextEngine(job_worker(args, gate), tokenizer), defaults


def _replica_pool(args: argparse.Namespace, replica: ReplicaFactory, spec) -> ReplicaPool:
    """The backend's replicas, not started yet. BackendError when the replicas need more CPUs than
    there are, or Ray is missing or cannot start."""
    threads = args.threads or 1
    if args.backend == "ray":
        return RayReplicas(
            args.replicas,
            replica,
            spec,
            address=args.ray_address,
            num_cpus=args.num_cpus,
            threads=threads,
            device=args.device,
        )
    cpus = args.num_cpus or os.cpu_count() or 1
    if args.replicas * threads > cpus:
        raise BackendError(
            f"--replicas {args.replicas} of --threads {threads} need {args.replicas * threads}"
            f" CPUs; this machine gives them {cpus}" + (" (--num-cpus)" if args.num_cpus else "")
        )
    return ProcessReplicas(args.replicas, replica, spec)


def _open_divergence_log(gate: KvGateConfig) -> JsonlSink | None:
    """The job's one divergence log, opened now (UsageError naming it when it cannot be); None
    when neither compare mode nor the page-content oracle writes one."""
    if gate.compare == "off" and gate.verify == "off":
        return None
    log = JsonlSink(gate.compare_log)
    try:
        log.open()
    except OSError as error:
        raise UsageError(
            f"divergence log {gate.compare_log}: cannot open it for writing: "
            f"{error.strerror or error}"
        ) from None
    return log


class ReplicaRecords:
    """The replicas' compare records into the one divergence log (``log``, None when none is
    written), and with their counters into the metrics (None when off). Mutates both."""

    def __init__(self, log: JsonlSink | None, metrics: ReplicaMetrics | None, workload: str):
        self.log, self.metrics, self.workload = log, metrics, workload
        self.summaries: list[RunSummary] = []
        self.num_divergences = 0

    def add(self, replica: int, lines: tuple[str, ...], counters: dict[str, int]) -> None:
        records = [parse_record(line) for line in lines]
        for record in records:
            if self.log is not None:
                self.log.write(record)
            if isinstance(record, RunSummary):
                self.summaries.append(record)
            self.num_divergences += isinstance(record, DivergenceRecord)
        if self.metrics is not None:
            self.metrics.add(self.workload, replica, counters, records)


def _times(first_ready_at: float | None, driver_cpu_s: float) -> dict[str, float]:
    """The job's times as it ends: startup_s (the process's start to the first replica ready),
    wall_s (from then to the last result line), end_to_end_s, driver_cpu_s. Pure but for the
    clocks."""
    end_to_end_s = process_age_s() or 0.0
    wall_s = time.perf_counter() - (first_ready_at or time.perf_counter())
    wall_s = min(wall_s, end_to_end_s) if end_to_end_s else wall_s
    return {
        "startup_s": round(end_to_end_s - wall_s, 3) if end_to_end_s else 0.0,
        "wall_s": round(wall_s, 3),
        "end_to_end_s": round(end_to_end_s, 3),
        "driver_cpu_s": round(driver_cpu_s, 3),
    }


def _summary(args, job: ReplicatedJob, times: dict, compare_runs: list | None) -> dict:
    """The job's summary: generate's keys (over every replica) and the replicas' own;
    ``compare_runs``: the replicas' compare run summaries (None: compare mode off). Pure."""
    counts, totals, wall_s = job.counts, job.totals, times["wall_s"]
    info = next((slot.info for slot in job.slots if slot.info is not None), None)
    summary = {
        "lines_done": counts.lines_done,
        "lines_failed": counts.lines_failed,
        "lines_skipped": counts.lines_skipped,
        "tokens_generated": counts.tokens_generated,
        "startup_s": times["startup_s"],
        "wall_s": wall_s,
        "end_to_end_s": times["end_to_end_s"],
        "tokens_per_s": round(counts.tokens_generated / wall_s, 1) if wall_s else 0.0,
        "lines_per_s": round(counts.lines_done / wall_s, 2) if wall_s else 0.0,
        "text_cpu_s": round(totals.text_cpu_s, 3),
        "replica_cpu_s": round(totals.cpu_s, 3),
        "evictions": totals.counters["evictions"],
        "loads": totals.counters["loads"],
        "recompute_preemptions": totals.counters["recompute_preemptions"],
        "prefix_cache_queries": totals.counters["prefix_cache_queries"],
        "prefix_cache_hits": totals.counters["prefix_cache_hits"],
        "gpu_pages": info.gpu_pages if info is not None else 0,
        "host_pages": info.host_pages if info is not None else 0,
        "replicas": args.replicas,
        "backend": args.backend,
        "replica_restarts": totals.replica_restarts,
        "replicas_lost": totals.replicas_lost,
        "lines_retried": totals.lines_retried,
        "driver_cpu_s": times["driver_cpu_s"],
    }
    if compare_runs is not None:
        summary["steps_compared"] = sum(sum(r.steps_compared.values()) for r in compare_runs)
        summary["divergences"] = sum(sum(r.divergences.values()) for r in compare_runs)
    return summary


def _print_divergences_logged(count: int, log: str) -> None:
    """One stderr line when the replicas logged divergences, as a job in this process prints."""
    if count:
        print(
            f"batchgen: {plural(count, 'divergence')} logged to {log}; see them:"
            f" batchgen report {shlex.quote(log)}",
            file=sys.stderr,
        )
