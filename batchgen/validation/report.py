"""What the back-to-back validation (``batchgen.validation.validate``) reports, and where.

Holds one run's record (``ValidationRun``), the verdict (``ValidationReport``), and the
reports directory (the divergence log, and the reports ``batchgen.shadow.report_page`` renders
from it) while the runs write it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from batchgen.config import CacheConfig
from batchgen.engine.runner import RunResult
from batchgen.shadow.report_page import REPORT_FILES
from batchgen.shadow.wiring import DIRECTIONS, KvDirection
from compare import Report


@dataclass(frozen=True, slots=True)
class ValidationRun:
    """One run of the validation: who ran what, and ``RunResult.summary()`` of it (plus its compare
    counts)."""

    role: str  # a direction's role ("legacy/plan", ...), "reference" or "fresh"
    workload: str
    summary: dict
    kv_path: str = "plan"  # the authoritative path
    shadow_path: str | None = None  # None: compare mode off

    @classmethod
    def from_result(
        cls, role: str, workload: str, result: RunResult, direction: KvDirection | None
    ) -> ValidationRun:
        """The run's summary under its workload's own name, with its compare counts in compare
        mode."""
        summary = {**result.summary(), "workload": workload}
        compared = result.compare_summary
        if compared is not None:
            summary |= {
                "steps_compared": dict(compared.steps_compared),
                "divergences": sum(compared.divergences.values()),
                "divergences_by_op": dict(compared.divergences),
                "harness_errors": compared.harness_errors,
            }
        if direction is None:
            return cls(role, workload, summary)
        return cls(
            role, workload, summary, kv_path=direction.authoritative, shadow_path=direction.shadow
        )

    @property
    def label(self) -> str:
        return f"{self.workload} {self.role}"

    def to_dict(self) -> dict:
        return {
            "role": self.role,
            "kv_path": self.kv_path,
            "shadow_path": self.shadow_path,
            **self.summary,
        }


@dataclass(frozen=True)
class ValidationReport:
    """The verdict: ``ok`` when ``failures`` is empty; each failure names the run and what
    failed."""

    cache: CacheConfig  # the shared (and fresh) workers' pool
    near_tie_tolerance: float
    workloads: tuple[str, ...]  # run back to back on each direction's worker
    corpus: tuple[str, ...]  # each run on a fresh worker per direction
    runs: tuple[ValidationRun, ...]
    failures: list[str]
    compare: Report  # aggregated over every compare run's log records
    # report kind -> file written; empty when no reports directory was given
    reports: dict[str, str]
    wall_s: float
    hf_oracle: str = ""  # the HF oracle's line ("" when the validation stopped before it)
    real_model: tuple[str, ...] = ()  # the real-model passes' lines (none when not asked for)
    self_checks: dict[str, bool] = dataclasses.field(default_factory=dict)  # id -> passed

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        """A JSON-ready dict of the whole report."""
        compare = self.compare
        return {
            "ok": self.ok,
            "failures": list(self.failures),
            "workloads": list(self.workloads),
            "corpus": list(self.corpus),
            "directions": [direction.role for direction in DIRECTIONS],
            "divergences": compare.num_divergences,
            "divergences_by_op": {stats.op: stats.num_divergences for stats in compare.ops},
            "steps_compared": {stats.op: stats.num_compared for stats in compare.ops},
            "harness_errors": compare.num_harness_errors,
            "coverage": [dataclasses.asdict(row) for row in compare.coverage],
            "coverage_unreached": list(compare.unreached),
            "compare_seconds": round(compare.compare_seconds, 3),
            "authoritative_seconds": round(compare.authoritative_seconds, 3),
            "compare_overhead": compare_overhead(compare),
            "leaked_gpu_pages": sum(run.summary["leaked_gpu_pages"] for run in self.runs),
            "leaked_host_pages": sum(run.summary["leaked_host_pages"] for run in self.runs),
            "cache": self.cache.model_dump(),
            "near_tie_tolerance": self.near_tie_tolerance,
            "runs": [run.to_dict() for run in self.runs],
            "reports": dict(self.reports),
            "wall_s": round(self.wall_s, 3),
            "hf_oracle": self.hf_oracle,
            "real_model": list(self.real_model),
            "self_checks": {
                "passed": sum(self.self_checks.values()),
                "total": len(self.self_checks),
                "failed": [check for check, passed in self.self_checks.items() if not passed],
            },
        }


def compare_overhead(report: Report) -> float | None:
    """Harness time over authoritative time on compared steps (None before anything was
    compared)."""
    if report.authoritative_seconds <= 0:
        return None
    return round(report.compare_seconds / report.authoritative_seconds, 3)


# the log while the runs write it; renamed once they are done
PARTIAL_LOG = REPORT_FILES["jsonl"] + ".partial"


@contextlib.contextmanager
def reports_directory(reports_dir: str | Path | None) -> Iterator[Path]:
    """``reports_dir`` (created, an earlier interrupted run's partial log removed; the last complete
    log and its reports stay until new ones replace them), or a temporary directory for the log
    alone."""
    if reports_dir is None:
        with tempfile.TemporaryDirectory(prefix="batchgen-validate-") as temporary:
            yield Path(temporary)
        return
    directory = Path(reports_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / PARTIAL_LOG).unlink(missing_ok=True)
    yield directory


def complete_log(directory: Path) -> Path:
    """Move the finished partial log (if any run logged) to its name, replacing the last one.
    Mutates ``directory``; returns the log's path."""
    log = directory / REPORT_FILES["jsonl"]
    partial = directory / PARTIAL_LOG
    if partial.exists():
        os.replace(partial, log)
    return log
