"""One validation's runs and checks: the workers it builds, what each run must show, failures.

``batchgen.shadow.validation`` decides which runs make a validation; a ``Session`` runs them,
checks each, and collects every failure as one line naming the run and what failed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from batchgen.config import CacheConfig, EngineConfig, watermark_pages
from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.request_checks import RequestError
from batchgen.engine.runner import RunResult, run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadError
from batchgen.kv.gate import KvGateConfig
from batchgen.kv.plans import pages_needed
from batchgen.shadow.output_check import compare_exact, compare_outputs
from batchgen.shadow.validation_report import KvDirection, ValidationRun
from compare import DivergenceRecord, LogWriteError, RunSummary, read_log

# Counters that must match between a shared and the fresh L2-4096 run (peaks are lifetime maxima,
# so not these).
SAME_RUN_COUNTERS = (
    "steps", "evictions", "loads", "load_failures", "recompute_preemptions", "tokens_generated",
)  # fmt: skip
_MAX_NAMED_PATHS = 3  # field paths a divergence failure line names

# on_progress(label of the run, requests released, requests in the workload)
ProgressCallback = Callable[[str, int, int], None]


@dataclass
class Session:
    """Builds workers, runs them, and collects runs and failures; mutated by every method."""

    model: object
    device: str | torch.device
    log: Path  # the compare runs' divergence log
    sources: dict[str, str]  # workload name -> how replay/minimize reload it
    on_progress: ProgressCallback | None
    runs: list[ValidationRun] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    # direction -> workload -> run
    shared: dict[KvDirection, dict[str, RunResult]] = field(default_factory=dict)

    # ---- the three kinds of run ----------------------------------------------------------------
    def run_back_to_back(
        self,
        direction: KvDirection,
        workloads: tuple[Workload, ...],
        cache: CacheConfig,
        engine: EngineConfig,
        scale: float,
    ) -> None:
        """Every workload in turn on one compare-mode worker; stops at the first run that breaks
        it."""
        gate = KvGateConfig(path=direction.authoritative, compare="log", compare_log=str(self.log))
        worker = Worker(
            self.model,
            cache_config=cache,
            engine_config=engine,
            kv_gate=gate,
            shadow_path=direction.shadow,
            device=self.device,
        )
        try:
            for workload in workloads:
                result = self.run(
                    direction.role, worker, workload, direction=direction, scale=scale
                )
                if result is None:  # the worker's state is broken; later runs would only repeat it
                    return
                self.shared.setdefault(direction, {})[workload.name] = result
                self.check_clean(f"{workload.name} {direction.role}", worker, result)
                self.check_evicted(f"{workload.name} {direction.role}", result)
        finally:
            self.close_log(direction, worker)

    def close_log(self, direction: KvDirection, worker: Worker) -> None:
        """Close a compare worker's log; a write that fails there is a failure of the run."""
        try:
            worker.kv_compare.sink.close()
        except LogWriteError as error:  # its records may not all be on disk
            self.failures.append(f"{direction.role}: divergence log {error}")

    def run_corpus(self, direction: KvDirection, corpus: list[Workload]) -> None:
        """Each corpus workload on a fresh compare-mode worker of its own pools, engine and
        faults: no divergence, nothing left behind."""
        gate = KvGateConfig(path=direction.authoritative, compare="log", compare_log=str(self.log))
        for workload in corpus:
            faults = FaultInjector(FaultSpec.parse(workload.faults)) if workload.faults else None
            worker = Worker(
                self.model, cache_config=workload.cache, engine_config=workload.engine,
                kv_gate=gate, shadow_path=direction.shadow, faults=faults, device=self.device,
            )  # fmt: skip
            try:
                result = self.run(direction.role, worker, workload, direction=direction)
                if result is not None:
                    self.check_clean(f"{workload.name} {direction.role}", worker, result)
            finally:
                self.close_log(direction, worker)

    def check_against_references(
        self, workloads: tuple[Workload, ...], dtype: str, tolerance: float
    ) -> None:
        """Each workload on a pool that never evicts; every direction's tokens must match it
        (near-ties allowed)."""
        for workload in workloads:
            roomy = workload.with_cache(**_no_eviction_pool(workload, dtype))
            reference = self.run("reference", self.plain_worker(roomy.cache, roomy.engine), roomy)
            if reference is None:
                continue
            self.check_no_eviction(reference)
            for direction, results in self.shared.items():
                if workload.name in results:
                    self.compare(
                        reference,
                        results[workload.name],
                        f"{workload.name} {direction.role}",
                        tolerance,
                    )

    def check_against_fresh(self, last: Workload, cache: CacheConfig) -> None:
        """The last workload on a fresh worker (plan path); every direction's run of it must be this
        run."""
        fresh = self.run("fresh", self.plain_worker(cache, last.engine), last)
        if fresh is None:
            return
        for direction, results in self.shared.items():
            if last.name in results:
                self.check_same_run(fresh, results[last.name], f"{last.name} {direction.role}")

    def plain_worker(self, cache: CacheConfig, engine: EngineConfig) -> Worker:
        """A worker on the default (plan) path with compare mode off, whatever the environment
        says."""
        return Worker(
            self.model,
            cache_config=cache,
            engine_config=engine,
            kv_gate=KvGateConfig(),
            device=self.device,
        )

    def run(
        self,
        role: str,
        worker: Worker,
        workload: Workload,
        *,
        direction: KvDirection | None = None,
        scale: float = 1.0,
    ) -> RunResult | None:
        """Run ``workload`` on ``worker``, checking its pools after every step; None (and a failure)
        if a check failed or the worker raised mid-run. A compare run carries its label as its
        workload name."""
        label = f"{workload.name} {role}"
        on_step = (
            None
            if self.on_progress is None
            else (lambda done, total: self.on_progress(label, done, total))
        )
        named = workload if direction is None else workload.model_copy(update={"name": label})
        try:
            result = run_workload(
                worker,
                named,
                check_integrity=True,
                on_step=on_step,
                source=self.sources.get(workload.name),
                scale=scale,
            )
        except (RequestError, WorkloadError):
            raise  # bad input, not a failed check
        except AssertionError as error:
            self.failures.append(
                f"{label}: integrity check failed at step {worker.state.step}: {_first_line(error)}"
            )
            self.end_compare_run(label, worker, direction)
            return None
        except Exception as error:  # e.g. a plan the applier rejected on the authoritative path
            self.failures.append(
                f"{label}: raised at step {worker.state.step}: {type(error).__name__}: "
                f"{_first_line(error)}"
            )
            self.end_compare_run(label, worker, direction)
            return None
        self.runs.append(ValidationRun.from_result(role, workload.name, result, direction))
        if result.compare_summary is not None:
            self.check_divergences(label, direction, result.compare_summary)
        return result

    def end_compare_run(self, label: str, worker: Worker, direction: KvDirection | None) -> None:
        """Judge the divergences of a compare run that broke off (its summary: the one the runner
        wrote as it stopped)."""
        if worker.kv_compare is not None:
            self.check_divergences(label, direction, worker.kv_compare.end_run())

    # ---- checks ---------------------------------------------------------------------------------
    def check_divergences(self, label: str, direction: KvDirection, summary: RunSummary) -> None:
        """No divergence and no harness error in one compare run; a failure names the first
        divergence."""
        if summary.harness_errors:
            self.failures.append(
                f"{label}: {_plural(summary.harness_errors, 'compare harness error')} "
                "(the comparison itself failed; see the warnings)"
            )
        num_divergences = sum(summary.divergences.values())
        if not num_divergences:
            return
        by_op = ", ".join(f"{op}: {n}" for op, n in sorted(summary.divergences.items()) if n)
        noise = (
            " (A/A noise check: both sides run the same path)" if direction.is_noise_check else ""
        )
        first = self.first_divergence(summary.run_id)
        self.failures.append(
            f"{label}: {_plural(num_divergences, 'divergence')} of the {direction.shadow} shadow"
            f" from the authoritative {direction.authoritative} path{noise} ({by_op}); first:"
            f" {_describe(first)}"
        )

    def check_clean(self, label: str, worker: Worker, result: RunResult) -> None:
        """After a run: nothing held, nothing in flight, no request state, pools consistent."""
        leftovers = {
            "GPU pages held": result.leaked_gpu_pages,
            "host pages held": result.leaked_host_pages,
            "loads in flight": result.loads_in_flight,
            "live requests": result.live_requests,
        }
        self.failures += [
            f"{label}: {count} {what} after the run (expected 0)"
            for what, count in leftovers.items()
            if count
        ]
        try:
            worker.check_integrity()
        except AssertionError as error:
            self.failures.append(
                f"{label}: integrity check failed after the run: {_first_line(error)}"
            )

    def check_evicted(self, label: str, result: RunResult) -> None:
        if result.stats.evictions == 0:
            self.failures.append(
                f"{label}: never evicted to host (recompute preemptions:"
                f" {result.stats.recompute_preemptions}), so the run did not exercise the host"
                " tier; use a larger --scale"
            )

    def check_no_eviction(self, reference: RunResult) -> None:
        stats = reference.stats
        if stats.evictions or stats.loads or stats.recompute_preemptions:
            self.failures.append(
                f"{reference.workload} reference: its pool was meant to avoid all KV pressure but"
                f" it saw {stats.evictions} evictions, {stats.loads} loads,"
                f" {stats.recompute_preemptions} recomputes"
            )

    def compare(
        self, reference: RunResult, shared: RunResult, label: str, tolerance: float
    ) -> None:
        """A shared run's tokens vs the no-eviction reference, near-ties allowed."""
        self.failures += [
            f"{label} vs reference: {problem}"
            for problem in compare_outputs(reference.outputs, shared.outputs, tolerance=tolerance)
        ]

    def check_same_run(self, fresh: RunResult, shared: RunResult, label: str) -> None:
        """A shared worker's run of the last workload must be the fresh worker's: tokens, steps and
        counters."""
        label = f"{label} vs fresh"
        self.failures += [
            f"{label}: {problem}" for problem in compare_exact(fresh.outputs, shared.outputs)
        ]
        fresh_counters, shared_counters = _run_counters(fresh), _run_counters(shared)
        self.failures += [
            f"{label}: {name} {shared_counters[name]} on the shared worker, {value} on a fresh one"
            for name, value in fresh_counters.items()
            if shared_counters[name] != value
        ]

    # ---- the log ---------------------------------------------------------------------------------
    def read_log(self) -> tuple:
        """Every record the compare runs logged (none when nothing was logged); a torn line is a
        failure."""
        if not self.log.exists():
            return ()
        result = read_log(self.log)
        self.failures += [f"divergence log: {warning}" for warning in result.warnings]
        return result.records

    def first_divergence(self, run_id: str) -> DivergenceRecord | None:
        if not self.log.exists():
            return None
        return next(
            (
                record
                for record in read_log(self.log).records
                if isinstance(record, DivergenceRecord) and record.run_id == run_id
            ),
            None,
        )


def _run_counters(result: RunResult) -> dict[str, int]:
    return {name: result.summary()[name] for name in SAME_RUN_COUNTERS}


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _first_line(error: BaseException) -> str:
    """The check's own message (pytest appends its assert rewrite on later lines)."""
    return str(error).partition("\n")[0]


def _no_eviction_pool(workload: Workload, dtype: str) -> dict:
    """Cache fields for a pool that holds every request at full length at once, above the watermark.

    No host pages: a run that never evicts never uses them.
    """
    cache = workload.cache
    num_needed = sum(
        pages_needed(len(r.prompt_ids) + r.max_new_tokens, cache.page_size)
        for r in workload.requests
    )
    num_pages = num_needed
    while num_pages - watermark_pages(cache.watermark, num_pages) < num_needed:
        num_pages += 1
    return {"num_gpu_pages": num_pages, "num_host_pages": 0, "dtype": dtype}


def _describe(record: DivergenceRecord | None) -> str:
    """``op step N, kind at path, path (+k more)``: one divergence on one line."""
    if record is None:
        return "not in the log"
    where = f"{record.op} step {record.step}, {record.kind}"
    if not record.field_paths:
        return f"{where}: {record.exception}"
    more = len(record.field_paths) - _MAX_NAMED_PATHS
    return f"{where} at {', '.join(record.field_paths[:_MAX_NAMED_PATHS])}" + (
        f" (+{more} more)" if more > 0 else ""
    )
