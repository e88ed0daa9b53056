"""Back-to-back validation: one worker runs L2-2048, then L2-4096 (DESIGN 7).

Five runs, one model::

    role       worker                       workload   pool                        checks (every run: pools
                                                                                   consistent after every step)
    ---------  ---------------------------  ---------  --------------------------  ----------------------------
    shared     one worker for both runs     L2-2048    L2-4096's (see below)       evicted; clean after;
               (the system under test)      L2-4096                                tokens == reference's
    reference  a fresh worker per workload  both       every request fits at once  no eviction, load, recompute
    fresh      a fresh worker               L2-4096    the shared worker's         == the shared run, exactly

The shared worker's cache is L2-4096's: the smallest built-in pool that can
hold L2-4096's longest request (L2-2048's pool cannot), so L2-4096 runs under
exactly the pressure it was sized for and L2-2048 under less, but still enough
to evict; both evicting is checked, not assumed (below scale 1 L2-2048 may stop
evicting, and the report says so). The two traces build the same engine
config; the worker takes L2-4096's. The page dtype follows the model's dtype,
and so does the near-tie tolerance.

"Clean after" means: no GPU or host page held, no load in flight, no live
request state, and ``worker.check_integrity()`` passes. Comparing against the
reference allows near-ties (``output_check``); the fresh run batches exactly
like the shared one, so it must match token for token, counters included.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.config import CacheConfig, EngineConfig
from batchgen.model.loader import SUPPORTED_DTYPES
from batchgen.output_check import NEAR_TIE_TOLERANCES, compare_exact, compare_outputs
from batchgen.runner import RunResult, run_workload
from batchgen.worker.worker import Worker
from batchgen.workloads import Workload, builtin_workload

BACK_TO_BACK_WORKLOADS = ("L2-2048", "L2-4096")
# Counters that must match between the shared and the fresh L2-4096 run (peaks are lifetime maxima, so not these).
SAME_RUN_COUNTERS = ("steps", "evictions", "loads", "load_failures", "recompute_preemptions", "tokens_generated")

# on_progress(label of the run, requests released, requests in the workload)
ProgressCallback = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class ValidationRun:
    """One run of the validation: who ran what, and ``RunResult.summary()`` of it."""

    role: str  # "shared", "reference" or "fresh"
    workload: str
    summary: dict

    @property
    def label(self) -> str:
        return f"{self.workload} {self.role}"


@dataclass(frozen=True)
class ValidationReport:
    """The verdict: ``ok`` when ``failures`` is empty; each failure names the run and what failed."""

    cache: CacheConfig  # the shared (and fresh) worker's pool
    near_tie_tolerance: float
    runs: tuple[ValidationRun, ...]
    failures: list[str]
    wall_s: float

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        """A JSON-ready dict of the whole report."""
        return {
            "ok": self.ok,
            "failures": list(self.failures),
            "cache": self.cache.model_dump(),
            "near_tie_tolerance": self.near_tie_tolerance,
            "runs": [{"role": run.role, **run.summary} for run in self.runs],
            "wall_s": round(self.wall_s, 3),
        }


def validate_back_to_back(model, *, seed: int = 0, scale: float = 1.0, device: str | torch.device = "cpu",
                          on_progress: ProgressCallback | None = None) -> ValidationReport:
    """Run the back-to-back validation on ``model`` (already on ``device``) and judge it.

    Builds its own workers; mutates nothing it is given. Raises only for bad
    input (WorkloadError for a bad scale, RequestError for a model whose
    context or vocabulary cannot serve the traces); every check that fails is
    a line in ``failures``.
    """
    started = time.perf_counter()
    first, second = (builtin_workload(name, seed=seed, scale=scale, vocab_size=model.config.vocab_size)
                     for name in BACK_TO_BACK_WORKLOADS)
    dtype = _dtype_name(model)
    cache = second.cache.model_copy(update={"dtype": dtype})
    tolerance = NEAR_TIE_TOLERANCES[dtype]
    session = _Session(on_progress)

    shared = _new_worker(model, cache, second.engine, device)
    for workload in (first, second):
        result = session.run("shared", shared, workload)
        if result is None:  # the worker's state is broken; later checks would only repeat it
            return session.report(cache, tolerance, started)
        session.check_clean(shared, result)
        session.check_evicted(result)

    for workload in (first, second):
        roomy = workload.with_cache(**_no_eviction_pool(workload, dtype))
        reference = session.run("reference", _new_worker(model, roomy.cache, roomy.engine, device), roomy)
        if reference is not None:
            session.check_no_eviction(reference)
            session.compare(reference, session.shared_results[workload.name], tolerance)

    fresh = session.run("fresh", _new_worker(model, cache, second.engine, device), second)
    if fresh is not None:
        session.check_same_run(fresh, session.shared_results[second.name])
    return session.report(cache, tolerance, started)


class _Session:
    """Collects runs and failures while the validation goes; mutated by every method."""

    def __init__(self, on_progress: ProgressCallback | None):
        self.on_progress = on_progress
        self.runs: list[ValidationRun] = []
        self.failures: list[str] = []
        self.shared_results: dict[str, RunResult] = {}

    def run(self, role: str, worker: Worker, workload: Workload) -> RunResult | None:
        """Run ``workload`` on ``worker``, checking its pools after every step; None (and a failure)
        if a check failed mid-run."""
        label = f"{workload.name} {role}"
        on_step = None if self.on_progress is None else (lambda done, total: self.on_progress(label, done, total))
        try:
            result = run_workload(worker, workload, check_integrity=True, on_step=on_step)
        except AssertionError as error:
            self.failures.append(f"{label}: integrity check failed at step {worker.state.step}: {_first_line(error)}")
            return None
        self.runs.append(ValidationRun(role, workload.name, result.summary()))
        if role == "shared":
            self.shared_results[workload.name] = result
        return result

    def check_clean(self, worker: Worker, result: RunResult) -> None:
        """After a run: nothing held, nothing in flight, no request state, pools consistent."""
        label = f"{result.workload} shared"
        leftovers = {"GPU pages held": result.leaked_gpu_pages, "host pages held": result.leaked_host_pages,
                     "loads in flight": result.loads_in_flight, "live requests": result.live_requests}
        self.failures += [f"{label}: {count} {what} after the run (expected 0)"
                          for what, count in leftovers.items() if count]
        try:
            worker.check_integrity()
        except AssertionError as error:
            self.failures.append(f"{label}: integrity check failed after the run: {_first_line(error)}")

    def check_evicted(self, result: RunResult) -> None:
        if result.stats.evictions == 0:
            self.failures.append(
                f"{result.workload} shared: never evicted to host (recompute preemptions: "
                f"{result.stats.recompute_preemptions}), so the run did not exercise the host tier; "
                f"use a larger --scale")

    def check_no_eviction(self, reference: RunResult) -> None:
        stats = reference.stats
        if stats.evictions or stats.loads or stats.recompute_preemptions:
            self.failures.append(
                f"{reference.workload} reference: its pool was meant to avoid all KV pressure but it saw "
                f"{stats.evictions} evictions, {stats.loads} loads, {stats.recompute_preemptions} recomputes")

    def compare(self, reference: RunResult, shared: RunResult, tolerance: float) -> None:
        """Shared run's tokens vs the no-eviction reference, near-ties allowed."""
        self.failures += [f"{shared.workload} shared vs reference: {problem}"
                          for problem in compare_outputs(reference.outputs, shared.outputs, tolerance=tolerance)]

    def check_same_run(self, fresh: RunResult, shared: RunResult) -> None:
        """The shared worker's L2-4096 run must be the fresh worker's: tokens, steps and counters."""
        label = f"{shared.workload} shared vs fresh"
        self.failures += [f"{label}: {problem}" for problem in compare_exact(fresh.outputs, shared.outputs)]
        fresh_counters, shared_counters = _run_counters(fresh), _run_counters(shared)
        self.failures += [f"{label}: {name} {shared_counters[name]} on the shared worker, {value} on a fresh one"
                          for name, value in fresh_counters.items() if shared_counters[name] != value]

    def report(self, cache: CacheConfig, tolerance: float, started: float) -> ValidationReport:
        return ValidationReport(cache=cache, near_tie_tolerance=tolerance, runs=tuple(self.runs),
                                failures=list(self.failures), wall_s=time.perf_counter() - started)


def _new_worker(model, cache: CacheConfig, engine: EngineConfig, device: str | torch.device) -> Worker:
    return Worker(model, cache_config=cache, engine_config=engine, device=device)


def _no_eviction_pool(workload: Workload, dtype: str) -> dict:
    """Cache fields for a pool that holds every request at full length at once, above the watermark.

    No host pages: a run that never evicts never uses them.
    """
    cache = workload.cache
    num_needed = sum(cache.pages_for(len(r.prompt_ids) + r.max_new_tokens) for r in workload.requests)
    num_pages = num_needed
    while num_pages - math.ceil(cache.watermark * num_pages) < num_needed:  # the worker's watermark rule
        num_pages += 1
    return {"num_gpu_pages": num_pages, "num_host_pages": 0, "dtype": dtype}


def _run_counters(result: RunResult) -> dict[str, int]:
    return {name: result.summary()[name] for name in SAME_RUN_COUNTERS}


def _first_line(error: AssertionError) -> str:
    """The check's own message (pytest appends its assert rewrite on later lines)."""
    return str(error).partition("\n")[0]


def _dtype_name(model) -> str:
    torch_dtype = next(model.parameters()).dtype
    return next(name for name, dtype in SUPPORTED_DTYPES.items() if dtype == torch_dtype)
