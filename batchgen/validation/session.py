"""One validation's runs and checks: the workers it builds, what each run must show, failures.

``batchgen.validation.validate`` decides which runs make a validation; a ``Session`` runs them,
checks each, and collects every failure as one line naming the run and what failed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from batchgen.config import CacheConfig, EngineConfig
from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.request_checks import RequestError
from batchgen.engine.runner import RunResult, run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadError
from batchgen.shadow.wiring import KvDirection
from batchgen.validation.checks import (
    data_failures,
    divergence_failures,
    eviction_failures,
    first_line,
    fresh_failures,
    leftover_failures,
    no_eviction_pool,
    pressure_failures,
    reference_failures,
)
from batchgen.validation.hf_oracle import check_against_hf
from batchgen.validation.report import ValidationRun
from batchgen.validation.self_checks import TOKENS_CHECK, counter_failures, self_check_results
from batchgen.validation.workers import compare_gate, compare_worker, plain_worker
from compare import DivergenceError, DivergenceRecord, LogWriteError, RunSummary, read_log

# on_progress(label of the run, requests released, requests in the workload)
ProgressCallback = Callable[[str, int, int], None]


class FailFast(Exception):
    """Raised by a fail-fast session at its first failed check (the failure is in
    ``Session.failures``); ``validate_back_to_back`` stops there."""


@dataclass
class Session:
    """Builds workers, runs them, and collects runs and failures; mutated by every method."""

    model: object
    device: str | torch.device
    log: Path  # the compare runs' divergence log
    sources: dict[str, str]  # workload name -> how replay/minimize reload it
    on_progress: ProgressCallback | None
    # stop at the first failed check (FailFast); compare runs raise at their first divergence
    fail_fast: bool = False
    metrics: object = None  # a batchgen.metrics.WorkerMetrics watching every run, or None
    runs: list[ValidationRun] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    hf_oracle: str = ""  # the HF oracle's summary line, once it ran
    real_model: list[str] = field(default_factory=list)  # the real-model passes' lines
    self_checks: dict[str, bool] = field(default_factory=dict)  # self-check id -> passed
    # direction -> workload -> run
    shared: dict[KvDirection, dict[str, RunResult]] = field(default_factory=dict)

    def run_self_checks(self) -> None:
        """The plan refusals and integrity corruptions (``self_checks``), each recorded as passed
        or failed; fail-fast stops at the first that fails."""
        for check_id, failure in self_check_results():
            self.self_checks[check_id] = failure is None
            if failure is not None:
                self.failures.append(failure)
                self.stop_at_failure()

    def judge_counters(self, label: str, result: RunResult) -> None:
        """The counter self-check on one finished run: passed while it held on every run."""
        failures = counter_failures(label, result)
        self.self_checks[TOKENS_CHECK] = self.self_checks.get(TOKENS_CHECK, True) and not failures
        self.failures += failures

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
        gate = compare_gate(direction, self.log, fail_fast=self.fail_fast)
        worker = compare_worker(self.model, self.device, direction, gate, cache, engine)
        try:
            for workload in workloads:
                result = self.run(
                    direction.role, worker, workload, direction=direction, scale=scale
                )
                if result is None:  # the worker's state is broken; later runs would only repeat it
                    return
                self.shared.setdefault(direction, {})[workload.name] = result
                label = f"{workload.name} {direction.role}"
                self.failures += leftover_failures(label, worker, result)
                self.failures += eviction_failures(label, result)
                self.stop_at_failure()
        finally:
            self.close_log(direction, worker)
        self.stop_at_failure()

    def close_log(self, direction: KvDirection, worker: Worker) -> None:
        """Close a compare worker's log; a write that fails there is a failure of the run."""
        try:
            worker.kv_compare.sink.close()
        except LogWriteError as error:  # its records may not all be on disk
            self.failures.append(f"{direction.role}: divergence log {error}")

    def run_corpus(self, direction: KvDirection, corpus: list[Workload]) -> None:
        """Each corpus workload on a fresh compare-mode worker of its own pools, engine and
        faults: no divergence, nothing left behind."""
        gate = compare_gate(direction, self.log, fail_fast=self.fail_fast)
        for workload in corpus:
            faults = FaultInjector(FaultSpec.parse(workload.faults)) if workload.faults else None
            worker = compare_worker(
                self.model, self.device, direction, gate, workload.cache, workload.engine, faults
            )
            try:
                result = self.run(direction.role, worker, workload, direction=direction)
                if result is not None:
                    self.failures += leftover_failures(
                        f"{workload.name} {direction.role}", worker, result
                    )
            finally:
                self.close_log(direction, worker)
            self.stop_at_failure()

    def check_against_references(
        self, workloads: tuple[Workload, ...], dtype: str, tolerance: float
    ) -> None:
        """Each workload on a pool that never evicts; every direction's tokens must match it
        (near-ties allowed)."""
        for workload in workloads:
            roomy = workload.with_cache(**no_eviction_pool(workload, dtype))
            worker = plain_worker(self.model, self.device, roomy.cache, roomy.engine)
            reference = self.run("reference", worker, roomy)
            if reference is None:
                continue
            self.failures += pressure_failures(reference)
            for direction, results in self.shared.items():
                if workload.name in results:
                    label = f"{workload.name} {direction.role}"
                    self.failures += reference_failures(
                        reference, results[workload.name], label, tolerance
                    )
                    self.stop_at_failure()

    def check_against_fresh(self, last: Workload, cache: CacheConfig) -> None:
        """The last workload on a fresh worker (plan path); every direction's run of it must be this
        run."""
        fresh = self.run("fresh", plain_worker(self.model, self.device, cache, last.engine), last)
        if fresh is None:
            return
        for direction, results in self.shared.items():
            if last.name in results:
                label = f"{last.name} {direction.role}"
                self.failures += fresh_failures(fresh, results[last.name], label)
                self.stop_at_failure()

    def check_against_hf(self, tolerance: float) -> None:
        """The tiny model's greedy tokens on the HF oracle's checkpoint and workload against HF
        transformers, on the model's device and dtype (``hf_oracle``); says so and fails nothing
        when transformers is not installed."""
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        verdict = check_against_hf(self.device, dtype, tolerance)
        self.hf_oracle = verdict.line
        self.failures += verdict.failures
        self.stop_at_failure()

    def stop_at_failure(self) -> None:
        """FailFast when this session fails fast and a check has failed; otherwise nothing."""
        if self.fail_fast and self.failures:
            raise FailFast(self.failures[0])

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
        try:
            result = self.run_checked(label, worker, workload, direction=direction, scale=scale)
        except (RequestError, WorkloadError):
            raise  # bad input, not a failed check
        except DivergenceError:  # fail-fast: the run's summary names the divergence
            broke_off = None
        except AssertionError as error:
            broke_off = f"integrity check failed at step {worker.state.step}: {first_line(error)}"
        except Exception as error:  # e.g. a plan the applier rejected on the authoritative path
            broke_off = (
                f"raised at step {worker.state.step}: {type(error).__name__}: {first_line(error)}"
            )
        else:
            self.runs.append(ValidationRun.from_result(role, workload.name, result, direction))
            self.judge_counters(label, result)
            if result.compare_summary is not None:
                self.judge_compare_run(label, direction, result.compare_summary)
            self.judge_finish_run(label, worker, direction)
            self.stop_at_failure()
            return result
        if broke_off is not None:
            self.failures.append(f"{label}: {broke_off}")
        self.end_compare_run(label, worker, direction)
        self.stop_at_failure()
        return None

    def run_checked(
        self,
        label: str,
        worker: Worker,
        workload: Workload,
        *,
        direction: KvDirection | None,
        scale: float,
    ) -> RunResult:
        """``workload`` run on ``worker`` with its pools checked after every step, its progress
        reported under ``label`` (a compare run's workload renamed so); raises what the run
        raised. Mutates the worker."""
        on_step = (
            None
            if self.on_progress is None
            else (lambda done, total: self.on_progress(label, done, total))
        )
        named = workload if direction is None else workload.model_copy(update={"name": label})
        return run_workload(
            worker,
            named,
            check_integrity=True,
            on_step=on_step,
            source=self.sources.get(workload.name),
            scale=scale,
            metrics=self.metrics,
        )

    def end_compare_run(self, label: str, worker: Worker, direction: KvDirection | None) -> None:
        """Judge the divergences of a compare run that broke off (its summaries: the ones the
        runner wrote as it stopped)."""
        if worker.kv_compare is not None:
            self.judge_compare_run(label, direction, worker.kv_compare.end_run())
        self.judge_finish_run(label, worker, direction)

    def judge_finish_run(self, label: str, worker: Worker, direction: KvDirection | None) -> None:
        """No divergence in the run of the worker's finish step in compare mode (the summary the
        runner closed it with; raise mode stopped the run at the first)."""
        if worker.finish_compare is not None:
            self.judge_compare_run(label, direction, worker.finish_compare.experiment.summary)

    def judge_compare_run(self, label: str, direction: KvDirection, summary: RunSummary) -> None:
        """No divergence and no harness error in one compare run (a failure names the first
        divergence)."""
        first = self.first_divergence(summary.run_id) if summary.divergences else None
        self.failures += divergence_failures(label, direction, summary, first)
        data = summary.data
        first_data = self.first_divergence(summary.run_id, kind="data") if data else None
        self.failures += data_failures(label, summary, first_data)

    # ---- the log ---------------------------------------------------------------------------------
    def read_log(self) -> tuple:
        """Every record the compare runs logged (none when nothing was logged); a torn line is a
        failure."""
        if not self.log.exists():
            return ()
        result = read_log(self.log)
        self.failures += [f"divergence log: {warning}" for warning in result.warnings]
        return result.records

    def first_divergence(self, run_id: str, kind: str | None = None) -> DivergenceRecord | None:
        """The run's first divergence record in the log (of ``kind``, when given)."""
        if not self.log.exists():
            return None
        return next(
            (
                record
                for record in read_log(self.log).records
                if isinstance(record, DivergenceRecord)
                and record.run_id == run_id
                and kind in (None, record.kind)
            ),
            None,
        )
