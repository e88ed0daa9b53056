"""`Experiment`: one run of a slice's two paths, shaped as Scientist's experiment::

    with Experiment("scheduler", paths=("planner", "legacy"), log="sched.jsonl") as experiment:
        for step in range(num_steps):
            admitted = experiment.run(
                "admit", step, authoritative=lambda: planner_admit(), shadow=lambda fork: ...
            )
    experiment.summary  # the RunSummary that closed the run's log

It owns what every binding needs of a run: its id (``<workload>-<8 hex digits>`` unless given),
the log and its records (a divergence, a sample rate change, the summary: each names the binding,
the run, its workload and seed), the counters and decision coverage (``compare.shadow``), and
the budget and breaker (``compare.governor``) when limits are set. `run` always returns the
authoritative result; an op the sample leaves out runs the authoritative path alone. What a
binding brings is its paths and hooks: ``fork``, ``canonicalize``, ``outcomes`` (which sees both
paths' observations), ``classify``, ``exception_kind`` and ``replay`` (what a divergence record
carries for the binding to re-run the op).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NamedTuple, TypeVar

from compare.budget import RateChange
from compare.errors import warn_harness_error
from compare.gates import CompareGate
from compare.governor import SampleGovernor
from compare.observation import Comparison, Observation, as_observed, exception_text
from compare.records import (
    DataChecks,
    DivergenceRecord,
    RunKey,
    RunSummary,
    SampleRateRecord,
    Timeline,
)
from compare.shadow import ShadowExecutor
from compare.sink import JsonlSink

R = TypeVar("R")


class Limits(NamedTuple):
    """A production run's limits on compare mode (``compare.budget``, ``compare.breaker``);
    None: no limit."""

    budget: float | None = None  # share of step time compare mode may take
    max_errors_in_row: int | None = None  # compared ops in a row with a harness error
    max_op_seconds: float | None = None  # harness seconds of one compared op


NO_LIMITS = Limits()


class Experiment:
    """One run of two paths of a slice, compared. Mutates its counters and its log."""

    def __init__(
        self,
        name: str,
        *,
        paths: tuple[str, str],
        log: str | Path | JsonlSink,
        mode: Literal["log", "raise"] = "log",
        sample: float = 1.0,
        seed: int = 0,
        ops: Collection[str] | None = None,
        fork: Callable[[], Any] = lambda: None,
        canonicalize: Callable[[Observation, Observation], tuple] = as_observed,
        outcomes: Callable[[str, Any, Observation, Observation], Iterable[str]] | None = None,
        classify: Callable[[tuple[str, ...]], str] = lambda paths: "state",
        exception_kind: Callable[[BaseException], str] = lambda error: "exception",
        replay: Callable[[Comparison, Any], dict] = lambda comparison, context: {},
        workload: str | None = None,
        run_id: str | None = None,
        limits: Limits = NO_LIMITS,
        on_record: Callable[[Any], None] | None = None,
        on_harness_error: Callable[[str, BaseException], None] = warn_harness_error,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``name``: the binding, as records name it; ``paths``: (authoritative, shadow);
        ``log``: a file, or a sink shared with other runs (then left open by `close`);
        ``workload``: what the run runs (default ``name``); ``on_record``: called with each
        record once it is logged. The rest as ``ShadowExecutor`` takes them."""
        workload = workload or name
        self.key = RunKey(name, run_id or f"{workload}-{uuid.uuid4().hex[:8]}", workload, seed)
        self.authoritative_path, self.shadow_path = paths
        self._owns_sink = not isinstance(log, JsonlSink)
        self.sink = JsonlSink(log) if self._owns_sink else log
        self._fork, self._canonicalize, self._replay = fork, canonicalize, replay
        self._on_record = on_record
        self.executor = ShadowExecutor(
            mode=mode,
            sample=sample,
            seed=seed,
            ops=ops,
            classify=classify,
            exception_kind=exception_kind,
            outcomes=outcomes or (lambda op, context, authoritative, shadow: ()),
            on_divergence=self._record_divergence,
            on_harness_error=on_harness_error,
            clock=clock,
        )
        self.governor = self._governor(limits, clock)  # the budget and breaker, when limits set
        self.summary: RunSummary | None = None  # the run's summary, once it closed

    @classmethod
    def from_gate(cls, name: str, gate: CompareGate, **options: Any) -> Experiment:
        """An experiment as a slice's parsed gate sets it (paths, log, mode, sample, ops, limits;
        ``options`` may set ``paths`` and the rest). ValueError when the gate's compare mode is
        off. Pure."""
        settings = {
            "paths": (gate.path, gate.shadow_path),
            "log": gate.compare_log,
            "mode": gate.compare,
            "sample": gate.compare_sample,
            "ops": gate.compare_ops,
            "limits": Limits(
                gate.compare_budget, gate.compare_breaker_errors, gate.compare_breaker_seconds
            ),
        }
        return cls(name, **{**settings, **options})

    @property
    def run_id(self) -> str:
        return self.key.run_id

    def run(
        self,
        op: str,
        step: int,
        *,
        authoritative: Callable[[], R],
        shadow: Callable[[Any], Any],
        context: Callable[[], Any] = lambda: None,
    ) -> R:
        """``authoritative()``'s result: when (op, step) is sampled, ``shadow(fork())`` ran too
        and both were compared (``ShadowExecutor.run_both``, ``context()`` captured first).
        Mutates the counters and the log; what the callables mutate is theirs."""
        governor = self.governor
        if governor is not None:
            governor.enter_step(step)
        if not self.executor.should_compare(op, step):
            return authoritative()
        if governor is not None:
            governor.before_op()
        try:
            return self.executor.run_both(
                op,
                step,
                authoritative=authoritative,
                shadow=shadow,
                fork=self._fork,
                canonicalize=self._canonicalize,
                context=context,
                shadow_path=self.shadow_path,
                authoritative_path=self.authoritative_path,
            )
        finally:
            if governor is not None:
                governor.after_op(step)

    def close(
        self,
        *,
        stopped_by: str | None = None,
        timeline: Timeline | None = None,
        data: DataChecks | None = None,
    ) -> RunSummary:
        """Log the run's summary and return it, once: a later call returns the same summary.
        ``stopped_by``: why the run stopped before its work was done (None: it was done);
        ``timeline``, ``data``: the binding's per-step counters and data checks. Mutates the
        log (a log this experiment opened is closed)."""
        if self.summary is None:
            if self.governor is not None:
                self.governor.finish()
            self.summary = RunSummary.from_stats(
                self.executor.stats(),
                self.key,
                authoritative=self.authoritative_path,
                shadow=self.shadow_path,
                stopped_by=stopped_by,
                timeline=timeline,
                data=data,
                breaker_step=self.governor.breaker_step if self.governor is not None else None,
            )
            self.write(self.summary)
            if self._owns_sink:
                self.sink.close()
        return self.summary

    def write(self, record: Any) -> None:
        """Log ``record``, then hand it to ``on_record``. Mutates the log."""
        self.sink.write(record)
        if self._on_record is not None:
            self._on_record(record)

    def __enter__(self) -> Experiment:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Close the run; an error ending the block is what stopped it."""
        self.close(stopped_by=None if error is None else exception_text(error))

    def _governor(self, limits: Limits, clock: Callable[[], float]) -> SampleGovernor | None:
        """The run's budget and breaker over its executor, logging each rate change; None
        without limits. Pure."""
        return SampleGovernor.from_limits(
            self.executor,
            budget=limits.budget,
            max_errors_in_row=limits.max_errors_in_row,
            max_op_seconds=limits.max_op_seconds,
            on_change=self._record_rate,
            clock=clock,
        )

    def _record_divergence(self, comparison: Comparison, context: Any) -> None:
        """Log a divergence with what the binding's ``replay`` gives. Mutates the log."""
        replay = self._replay(comparison, context)
        created_at = time.time()
        self.write(
            DivergenceRecord.from_comparison(
                comparison, self.key, replay=replay, created_at=created_at
            )
        )

    def _record_rate(self, change: RateChange) -> None:
        """Log a change of the sample rate (the budget's or the breaker's). Mutates the log."""
        self.write(SampleRateRecord.from_change(change, self.key, created_at=time.time()))
