"""The sweep's driver: run the matrix's cells on a backend, merge their logs, write the reports.

::

    run_sweep(cells, backend, reports_dir=DIR) -> SweepResult

Each task returns its run's log lines (``run_cell``); the driver keeps them by
cell and, once the tasks have ended (all done, the time budget spent, or Ctrl-C),
writes them in matrix order as one log, ``divergences.jsonl`` in the reports
directory (replaced atomically), and renders its reports from it with
``compare.report``: text, markdown, JUnit, JSON. The order is the matrix's, so the
same matrix gives the same log whatever the backend, the number of workers and
the order in which tasks ended.

A task that failed in every attempt (it raised, its worker died, its node was
lost) is a harness error: a ``RunSummary`` with ``harness_errors=1`` and
``stopped_by`` naming how it failed stands in for its run, so the log, its reports
and ``batchgen report`` all count it. Runs still in flight when the sweep stops
are left out of the log.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.kv.gate import KV_BINDING
from batchgen.shadow.coverage import CATALOG
from batchgen.shadow.report_page import REPORT_FILES, write_reports
from batchgen.sweep.backends import SweepBackend, TaskDone, TaskFailed
from batchgen.sweep.matrix import SweepCell, run_cell
from compare import LogRecord, Report, RunSummary, aggregate, parse_record, write_atomic
from compare.render import render_text

SWEEP_REPORT_FILES = {**REPORT_FILES, "text": "divergences.txt"}
DEFAULT_MAX_RETRIES = 3

# on_progress(runs done, runs in the matrix, divergences so far)
ProgressCallback = Callable[[int, int, int], None]


@dataclass(frozen=True)
class SweepResult:
    """What a sweep ran and found; ``ok`` when a run ended and none diverged, stopped early or was
    lost."""

    num_runs: int  # runs in the matrix
    num_done: int  # runs that ended, lost ones (harness errors) included
    num_retried: int  # runs that ended after more than one attempt
    failures: tuple[str, ...]  # one line per run that stopped early or was lost, in matrix order
    compare: Report  # aggregated over the merged log
    reports: dict[str, str]  # report kind -> file written
    wall_s: float
    budget_spent: bool  # the deadline came before every run had ended
    interrupt: KeyboardInterrupt | None  # Ctrl-C or SIGTERM stopped it (the files were written)

    @property
    def ok(self) -> bool:
        compare = self.compare
        return bool(
            self.num_done
            and not self.failures
            and not compare.num_divergences
            and not compare.num_harness_errors
        )

    @property
    def runs_per_minute(self) -> float:
        return 60 * self.num_done / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        """A JSON-ready dict of the result."""
        compare = self.compare
        return {
            "ok": self.ok,
            "runs": self.num_runs,
            "runs_done": self.num_done,
            "runs_retried": self.num_retried,
            "divergences": compare.num_divergences,
            "divergences_by_op": {stats.op: stats.num_divergences for stats in compare.ops},
            "steps_compared": {stats.op: stats.num_compared for stats in compare.ops},
            "harness_errors": compare.num_harness_errors,
            "failures": list(self.failures),
            "budget_spent": self.budget_spent,
            "interrupted": self.interrupt is not None,
            "reports": dict(self.reports),
            "wall_s": round(self.wall_s, 3),
            "runs_per_minute": round(self.runs_per_minute, 2),
        }


def run_sweep(
    cells: Sequence[SweepCell],
    backend: SweepBackend,
    *,
    reports_dir: str | Path,
    run: Callable[[SweepCell], tuple[str, ...]] = run_cell,
    max_retries: int = DEFAULT_MAX_RETRIES,
    deadline: float | None = None,
    on_progress: ProgressCallback | None = None,
    on_run: Callable[[tuple[str, ...]], None] | None = None,
) -> SweepResult:
    """Run ``run(cell)`` for every cell on ``backend``, then write the merged log and its reports
    into ``reports_dir`` (see the module docstring).

    Stops starting runs at ``deadline`` (``time.monotonic()``). Ctrl-C (KeyboardInterrupt) cancels
    the tasks in flight; the log and reports of what finished are still written, and the result
    holds the interrupt. ``on_run(lines)`` gets each run's log lines as it ends (the metrics' sums
    of finished runs). Mutates ``reports_dir``'s log and report files."""
    started = time.monotonic()
    merge = _Merge(cells, on_progress, on_run)
    interrupt = None
    try:
        backend.map_runs(run, cells, merge.add, max_retries=max_retries, deadline=deadline)
    except KeyboardInterrupt as error:
        interrupt = error
    lines = list(merge.ordered_lines())
    directory = Path(reports_dir)
    write_atomic(directory / SWEEP_REPORT_FILES["jsonl"], "".join(f"{line}\n" for line in lines))
    records = [parse_record(line) for line in lines]
    compare = aggregate(records, CATALOG)
    return SweepResult(
        num_runs=len(cells),
        num_done=len(merge.lines),
        num_retried=merge.num_retried,
        failures=tuple(merge.failures[index] for index in sorted(merge.failures)),
        compare=compare,
        reports=write_sweep_reports(directory, compare, records),
        wall_s=time.monotonic() - started,
        budget_spent=interrupt is None and len(merge.lines) < len(cells),
        interrupt=interrupt,
    )


def write_sweep_reports(
    directory: Path, compare: Report, records: Sequence[LogRecord]
) -> dict[str, str]:
    """``write_reports`` (markdown, JUnit, JSON, HTML beside the log, whose ``records`` these are)
    and the text report; kind -> path. OSError naming the report that could not be written.
    Mutates ``directory``."""
    written = write_reports(directory, compare, records)
    path = directory / SWEEP_REPORT_FILES["text"]
    write_atomic(path, render_text(compare))
    return {**written, "text": str(path)}


def lost_run_summary(cell: SweepCell, failure: TaskFailed) -> RunSummary:
    """The summary standing in for a run whose task failed in every attempt: one harness error,
    nothing compared, ``stopped_by`` saying how it failed. Pure."""
    return RunSummary(
        binding=KV_BINDING,
        run_id=cell.run_id,
        workload=cell.workload.name,
        seed=cell.seed,
        authoritative=cell.direction.authoritative,
        shadow=cell.direction.shadow,
        steps_compared={},
        divergences={},
        harness_errors=1,
        compare_seconds=0.0,
        authoritative_seconds=0.0,
        stopped_by=(
            f"harness error: the sweep's task failed in each of its {failure.num_attempts} "
            f"attempts; the last: {failure.error}"
        ),
    )


@dataclass
class _Merge:
    """The runs' log lines by cell index, as their tasks end; mutated by ``add``."""

    cells: Sequence[SweepCell]
    on_progress: ProgressCallback | None
    on_run: Callable[[tuple[str, ...]], None] | None
    lines: dict[int, tuple[str, ...]] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)  # cell index -> failure line
    num_retried: int = 0
    num_divergences: int = 0

    def add(self, index: int, outcome: TaskDone | TaskFailed) -> None:
        """Keep the lines of the run of cell ``index`` (a lost run's stand-in summary for a failed
        task), count its divergences, and report progress."""
        cell = self.cells[index]
        if isinstance(outcome, TaskFailed):
            summary = lost_run_summary(cell, outcome)
            self.lines[index] = (summary.model_dump_json(),)
        else:
            self.lines[index] = outcome.value
            summary = parse_record(outcome.value[-1])  # run_cell's log ends with the summary
        if summary.stopped_by is not None:
            self.failures[index] = f"{cell.label} (run {cell.run_id}): {summary.stopped_by}"
        self.num_retried += outcome.num_attempts > 1
        self.num_divergences += sum(summary.divergences.values())
        if self.on_run is not None:
            self.on_run(self.lines[index])
        if self.on_progress is not None:
            self.on_progress(len(self.lines), len(self.cells), self.num_divergences)

    def ordered_lines(self) -> Iterator[str]:
        """Every run's lines, in matrix order."""
        for index in sorted(self.lines):
            yield from self.lines[index]
