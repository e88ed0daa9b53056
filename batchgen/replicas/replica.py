"""One replica of a replicated job: the model loaded once on one worker, running the blocks of
input lines the driver sends, each through a ``BatchJob`` that writes into memory.

::

    Replica(spec, share)   build the engine (spec.build: model, tokenizer, pools of 1/share of the
                           node's memory caps), start its compare run
    run_block(block)       -> BlockResult: a result line per input line, the block's counts, the
                           increase of the worker's counters, the compare records it logged
    finish()               -> the compare run's summary line(s); the replica's temporary log removed

A replica holds no file of the job: its results and its compare records go back to the driver,
which writes them (``batchgen.replicas.driver``). In compare mode the worker logs to a file of the
replica's own (``ReplicaSpec.build`` names it), read back after each block.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from batchgen.openai.batch_job import BatchJob
from batchgen.text.generation import TextEngine
from batchgen.text.generation_defaults import GenerationDefaults

# the worker's counters a block reports the increase of (WorkerStats fields)
COUNTER_FIELDS = (
    "recompute_preemptions",
    "evictions",
    "loads",
    "load_failures",
    "tokens_generated",
    "prefix_cache_queries",
    "prefix_cache_hits",
)


@dataclass(frozen=True, slots=True)
class Block:
    """Input lines the driver hands one replica: (1-based line number, text) each."""

    block_id: int
    lines: tuple[tuple[int, str | None], ...]
    attempts: int = 0  # how many replicas ended while running these lines


@dataclass(frozen=True, slots=True)
class BlockResult:
    block_id: int
    result_lines: tuple[str, ...]  # one JSON result line per input line, in finishing order
    lines_failed: int  # error lines among them
    tokens_generated: int
    counters: dict[str, int]  # COUNTER_FIELDS -> their increase during the block
    records: tuple[str, ...]  # compare-mode log lines written during the block
    text_cpu_s: float
    cpu_s: float = 0.0  # the replica process's CPU seconds over the block


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What a replica reports once loaded."""

    node: str  # the host it runs on
    warning: str | None  # the generation config's, if any
    gpu_pages: int
    host_pages: int


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """What every replica of a job builds and runs (picklable: it travels to each node).
    ``build(share)`` loads the engine with 1/share of the node's memory caps and returns it with
    the sampling defaults."""

    build: Callable[[int], tuple[TextEngine, GenerationDefaults]]
    served_model: str
    seed: int
    max_in_flight: int
    run_name: str  # the compare run's workload name (IN's file name)
    source: str  # IN's path on the driver


def node_name() -> str:
    """This machine's host name. Pure."""
    return socket.gethostname()


class _ResultLines(list):
    """The in-memory sink of a BatchJob: its result lines, as ``JsonLinesFile.write_line`` would
    take them."""

    write_line = list.append


class Replica:
    """One loaded model serving blocks. Mutates its worker, and its compare log (a file of its
    own) in compare mode."""

    def __init__(self, spec: ReplicaSpec, share: int):
        self.spec = spec
        self.engine, self.defaults = spec.build(share)
        worker = self.engine.worker
        self._stats = worker.state.stats.copy()
        logs = worker.kv_compare is not None or worker.kv_verify is not None
        self._log = Path(worker.kv_gate.compare_log) if logs else None
        self._log_offset = 0
        self.engine.start_run(spec.run_name, seed=spec.seed, source=spec.source)

    def info(self) -> ReplicaInfo:
        """Where it runs and its pools. Pure."""
        cache = self.engine.worker.cache_config
        warning = self.defaults.warning()
        return ReplicaInfo(node_name(), warning, cache.num_gpu_pages, cache.num_host_pages)

    def run_block(self, block: Block) -> BlockResult:
        """Every line of ``block`` to its result line. Mutates the engine and the marks."""
        sink = _ResultLines()
        job = BatchJob(
            self.engine,
            sink,
            served_model=self.spec.served_model,
            seed=self.spec.seed,
            max_in_flight=self.spec.max_in_flight,
            defaults=self.defaults,
        )
        text_cpu, cpu = self.engine.text_cpu.seconds, time.process_time()
        counts = job.run(block.lines)
        return BlockResult(
            block.block_id,
            tuple(sink),
            counts.lines_failed,
            counts.tokens_generated,
            self._counter_increase(),
            self._new_records(),
            self.engine.text_cpu.seconds - text_cpu,
            time.process_time() - cpu,
        )

    def finish(self) -> tuple[str, ...]:
        """End the compare run: its last records (the run's summary), the temporary log removed;
        () without a log (compare mode and the page-content oracle off). Mutates the log."""
        if self._log is None:
            return ()
        self.engine.finish_run()
        for writer in (self.engine.worker.kv_compare, self.engine.worker.kv_verify):
            if writer is not None:
                writer.sink.close()
        records = self._new_records()
        self._log.unlink(missing_ok=True)
        return records

    def _counter_increase(self) -> dict[str, int]:
        """COUNTER_FIELDS' increase since the last call. Mutates the marks."""
        stats = self.engine.worker.state.stats
        increase = {f: getattr(stats, f) - getattr(self._stats, f) for f in COUNTER_FIELDS}
        self._stats = stats.copy()
        return increase

    def _new_records(self) -> tuple[str, ...]:
        """The whole lines the compare log gained since the last call. Mutates the read offset."""
        if self._log is None or not self._log.exists():
            return ()
        with open(self._log, "rb") as file:
            file.seek(self._log_offset)
            data = file.read()
        whole = data[: data.rfind(b"\n") + 1]
        self._log_offset += len(whole)
        return tuple(whole.decode("utf-8").splitlines())


ReplicaFactory = Callable[[ReplicaSpec, int], Replica]
