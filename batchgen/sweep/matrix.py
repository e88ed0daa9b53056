"""Sweeps: compare mode over a matrix of workloads x seeds x fault schedules x directions.

::

    sweep_workloads(specs)     built-in names, workload files, corpus directories -> SweepWorkload
    sweep_directions(...)      which path serves (plan, legacy, both), and the A/A noise check
    sweep_cells(...)           the matrix, in its stable order -> (SweepCell, ...)
    run_cell(cell)             one compare-mode run on a fresh worker -> its log lines (a task)

One cell is one run: a fresh worker (the workload's pools) and a freshly loaded
tiny model (weights drawn from the cell's seed), compare mode ``log`` in the
cell's direction, pools checked after every step. A task needs nothing from the
driver's machine but its cell: a workload file is read on the driver and travels
in the cell, and the run's log is written to a temporary file and returned as its
lines. The run id is a digest of the cell (``SweepCell.run_id``), so the same matrix
logs the same records on any backend and any number of workers, but for their
times (``created_at``, ``compare_seconds``, ``authoritative_seconds``).

Matrix order: seeds outermost, then workloads, fault schedules and directions,
so that a sweep cut short (``max_runs``, a time budget) has covered every
workload, schedule and direction of its first seeds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from batchgen.config import TINY_MODELS
from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.runner import run_workload
from batchgen.engine.worker import RequestError, Worker
from batchgen.engine.workloads import BUILTIN_WORKLOADS, Workload, load_workload
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.model.null_model import NullModel
from batchgen.shadow.wiring import KvDirection, gated_worker
from compare import RunSummary, read_log

MODEL = "tiny"  # every run's model: built-in, so a node needs no checkpoint
MAX_RUNS = 1_000_000  # runs one sweep may hold (its cells are built up front)
SERVING_PATHS = ("plan", "legacy", "both")


class SweepError(ValueError):
    """A matrix that cannot be swept: a workload named twice, an empty corpus, too many runs."""


@dataclass(frozen=True, slots=True)
class SweepWorkload:
    """A workload of the matrix: a built-in trace (drawn per seed in the task) or a file's."""

    name: str  # records and reports group by it
    source: str  # how replay and minimize reload it: the built-in name, or the file's absolute path
    # a file's workload, read on the driver (nodes share no file system); None: a built-in trace
    content: Workload | None = None


@dataclass(frozen=True, slots=True)
class SweepCell:
    """One run of the matrix."""

    workload: SweepWorkload
    seed: int  # the built-in trace's, the model's weights', and a fault SPEC's without its own
    scale: float  # a built-in trace's; a workload file runs as written (1.0)
    faults: str | None  # the fault SPEC as given; None: no faults
    direction: KvDirection
    prefix_caching: bool | None = None  # over the workload's cache config; None: the workload's

    @property
    def fault_schedule(self) -> str | None:
        """The full fault SPEC the run uses (see :func:`fault_schedule`). Pure."""
        return fault_schedule(self.faults, self.seed)

    @property
    def run_id(self) -> str:
        """``<workload>-<16 hex digits>``: a digest of what the run depends on (a file's content,
        not its path), so a cell has the same id on every machine and in every sweep. Pure."""
        content = self.workload.content
        key = [
            self.workload.name,
            None if content is None else content.model_dump_json(),
            self.seed,
            self.scale,
            self.fault_schedule,
            self.direction.authoritative,
            self.direction.shadow,
        ]
        if self.prefix_caching is not None:  # a cell without it keeps the id it always had
            key.append(self.prefix_caching)
        digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()
        return f"{self.workload.name}-{digest[:16]}"

    @property
    def label(self) -> str:
        """``L2-2048 seed 3 plan/legacy`` (and ``faults SPEC``): the run, for people. Pure."""
        label = f"{self.workload.name} seed {self.seed} {self.direction.role}"
        return label if self.faults is None else f"{label} faults {self.faults}"


def fault_schedule(spec: str | None, seed: int) -> str | None:
    """``spec`` in full (every key, as ``FaultSpec.to_spec`` writes it), its seed ``seed`` unless it
    names its own: each seed of a sweep gets its own schedule. FaultSpecError for a bad SPEC.
    Pure."""
    if spec is None:
        return None
    parsed = FaultSpec.parse(spec)
    if "seed" not in {part.partition("=")[0].strip() for part in spec.split(",")}:
        parsed = dataclasses.replace(parsed, seed=seed)
    return parsed.to_spec()


def sweep_workloads(specs: Sequence[str]) -> tuple[SweepWorkload, ...]:
    """Each spec: a built-in name, a workload file, or a directory (a corpus: each ``*.json`` in it,
    by name). WorkloadError for a bad file, SweepError for an empty corpus or a workload name met
    twice, RequestError-worded SweepError for a request the tiny model cannot serve. Reads the
    files; mutates nothing."""
    found: list[SweepWorkload] = []
    for spec in specs:
        if spec not in BUILTIN_WORKLOADS and Path(spec).is_dir():
            files = sorted(Path(spec).glob("*.json"))
            if not files:
                raise SweepError(f"--workload {spec}: a directory without workload files (*.json)")
            found += [_file_workload(str(path)) for path in files]
        elif spec in BUILTIN_WORKLOADS:
            found.append(SweepWorkload(spec, spec))
        else:
            found.append(_file_workload(spec))
    twice = [name for name, count in Counter(w.name for w in found).items() if count > 1]
    if twice:
        raise SweepError(
            f"workload {twice[0]!r} is in the sweep twice; each workload needs its own name "
            "(records and reports group runs by it)"
        )
    return tuple(found)


def _file_workload(path: str) -> SweepWorkload:
    """The file's workload, checked against the tiny model (context, vocabulary, pools)."""
    workload = load_workload(path)
    model = NullModel(TINY_MODELS[MODEL])
    worker = Worker(model, cache_config=workload.cache, kv_storage=False)
    for request in workload.requests:
        try:
            worker.validate_request(request.to_request())
        except RequestError as error:
            raise SweepError(
                f"workload file {path}: {error} (the sweep's model: {MODEL})"
            ) from None
    return SweepWorkload(workload.name, str(Path(path).resolve()), workload)


def sweep_directions(serving: str, *, aa_check: bool) -> tuple[KvDirection, ...]:
    """``serving`` (plan, legacy or both) shadowed by the other path; with ``aa_check``, each
    serving path shadowed by itself too (the A/A noise check). Pure."""
    paths = ("legacy", "plan") if serving == "both" else (serving,)
    other = {"plan": "legacy", "legacy": "plan"}
    directions = [KvDirection(path, other[path]) for path in paths]
    if aa_check:
        directions += [KvDirection(path, path) for path in paths]
    return tuple(directions)


def sweep_cells(
    workloads: Sequence[SweepWorkload],
    seeds: Sequence[int],
    fault_specs: Sequence[str | None],
    directions: Sequence[KvDirection],
    *,
    scale: float = 1.0,
    max_runs: int | None = None,
    prefix_caching: bool | None = None,
) -> tuple[SweepCell, ...]:
    """The matrix in its stable order (seeds, workloads, fault schedules, directions), its first
    ``max_runs`` cells when given, each with ``prefix_caching`` over its workload's (None: the
    workload's). FaultSpecError for a bad SPEC, SweepError past MAX_RUNS. Pure."""
    for spec in fault_specs:
        fault_schedule(spec, 0)
    num_cells = math.prod(map(len, (workloads, seeds, fault_specs, directions)))
    if max_runs is not None:
        num_cells = min(num_cells, max_runs)
    if num_cells > MAX_RUNS:
        raise SweepError(
            f"the matrix holds {num_cells} runs; a sweep runs at most {MAX_RUNS} (--max-runs "
            "takes the first N)"
        )
    cells = (
        SweepCell(w, seed, scale if w.content is None else 1.0, faults, direction, prefix_caching)
        for seed in seeds
        for w in workloads
        for faults in fault_specs
        for direction in directions
    )
    return tuple(itertools.islice(cells, num_cells))


def cell_workload(cell: SweepCell, vocab_size: int) -> Workload:
    """The cell's workload: its built-in trace (seed, scale, the model's vocabulary), or its file's,
    carrying the cell's seed (which records and the compare sampling read); with the cell's prefix
    caching when it sets it. Pure."""
    content = cell.workload.content
    if content is None:
        workload = load_workload(
            cell.workload.name, seed=cell.seed, scale=cell.scale, vocab_size=vocab_size
        )
    else:
        workload = content.model_copy(update={"seed": cell.seed})
    if cell.prefix_caching is None:
        return workload
    return workload.with_cache(enable_prefix_caching=cell.prefix_caching)


def run_cell(cell: SweepCell) -> tuple[str, ...]:
    """One compare-mode run of ``cell`` on a fresh worker, in this process: the lines of its
    divergence log (its divergences, then its summary).

    A run that stops early (a stall, a plan rejected, a failed integrity check) is a result: its
    summary says why (``stopped_by``). Raises only when the run cannot be set up or its log read
    back, a crash of the task (a backend retries it). Sets torch's CPU threads to 1; writes a
    temporary directory and removes it."""
    torch.set_num_threads(1)
    content = cell.workload.content
    dtype = "float32" if content is None else content.cache.dtype
    model = load_model(MODEL, dtype=dtype, seed=cell.seed)
    workload = cell_workload(cell, model.config.vocab_size)
    schedule = cell.fault_schedule
    with tempfile.TemporaryDirectory(prefix="batchgen-sweep-") as directory:
        log = Path(directory) / "divergences.jsonl"
        gate = KvGateConfig(path=cell.direction.authoritative, compare="log", compare_log=str(log))
        worker = gated_worker(
            model,
            cache_config=workload.cache,
            engine_config=workload.engine,
            kv_gate=gate,
            shadow_path=cell.direction.shadow,
            faults=None if schedule is None else FaultInjector(FaultSpec.parse(schedule)),
        )
        with contextlib.suppress(Exception):  # the run's summary names the error that stopped it
            run_workload(
                worker,
                workload,
                check_integrity=True,
                source=cell.workload.source,
                scale=cell.scale,
                run_id=cell.run_id,
            )
        worker.kv_compare.sink.close()
        records = read_log(log).records
        if not records or not isinstance(records[-1], RunSummary):
            raise RuntimeError(f"{cell.label}: the run's log does not end with its summary")
        return tuple(log.read_text(encoding="utf-8").splitlines())
