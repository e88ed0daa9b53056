"""One minimize search: what it compares candidates by (a divergence signature), and the
candidates: run each once, judged by the signature, the smallest that diverged remembered
(``minimize`` drives it with ddmin)."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadRequest
from batchgen.kv.gate import KvGateConfig
from compare import DivergenceRecord, read_log, wildcard

_STEP_FIELDS = (("max_new_tokens", 1), ("arrival_step", 0), ("abort_step", 0))  # (field, floor)


class WorkerFactory(Protocol):
    """Builds the worker one candidate workload runs on, with the gate, shadow path and faults
    given."""

    def __call__(
        self,
        workload: Workload,
        *,
        kv_gate: KvGateConfig,
        shadow_path: str,
        faults: FaultInjector | None,
    ) -> Worker: ...


# (candidates run, fewest requests of one that diverged)
TestCallback = Callable[[int, "int | None"], None]
# the smallest diverging workload, when interrupted
InterruptCallback = Callable[["MinimizeResult"], None]


@dataclass(frozen=True, slots=True)
class DivergenceSignature:
    """What makes two divergences "the same failure" while minimising."""

    op: str
    kind: str
    field_paths: tuple[str, ...]  # wildcarded (``requests[*].gpu_page_ids[*]``), sorted, each once

    @classmethod
    def of(cls, record: DivergenceRecord) -> DivergenceSignature:
        return cls(
            record.op, record.kind, tuple(sorted({wildcard(path) for path in record.field_paths}))
        )

    @property
    def slug(self) -> str:
        """An identifier naming the signature: ``<op>_<kind>_<hash of the paths>``."""
        digest = hashlib.blake2b("\n".join(self.field_paths).encode(), digest_size=4).hexdigest()
        return re.sub(r"\W", "_", f"{self.op}_{self.kind}_{digest}")


@dataclass(frozen=True, slots=True)
class MinimizeResult:
    workload: Workload  # the minimal workload that still diverges (named "<original>-min")
    signature: DivergenceSignature
    num_tests: int  # candidate workloads run
    kv_path: str  # the authoritative path the divergence needs
    shadow_path: str
    faults: str | None = None  # the fault SPEC the divergence needs (None: none)
    # "max_tests", "interrupted": ended early, maybe not minimal (None: 1-minimal)
    stopped_by: str | None = None
    demo_bug: str | None = None  # the demo bug planted in the shadow path (None: none)


class Search:
    """Runs candidate workloads, at most ``max_tests``, remembers each verdict and the smallest
    candidate that diverged. Mutates only itself and its log dir."""

    def __init__(
        self,
        signature: DivergenceSignature,
        make_worker: WorkerFactory,
        kv_path: str,
        shadow_path: str,
        log_dir: Path,
        source: str,
        scale: float,
        faults: FaultSpec | None,
        *,
        min_steps: int = 0,
        max_tests: int,
        on_test: TestCallback | None = None,
        demo_bug: str | None = None,
    ):
        """``demo_bug``: the known bug each candidate's compare mode plants in its shadow path."""
        self.signature = signature
        self.make_worker = make_worker
        self.kv_path, self.shadow_path = kv_path, shadow_path
        self.log_dir, self.source, self.scale = log_dir, source, scale
        self.faults, self.demo_bug = faults, demo_bug
        # steps the recorded run took to diverge: a candidate may take as many
        self.min_steps = min_steps
        self.max_tests = max_tests
        self.num_tests = 0
        self.smallest: Workload | None = None  # the candidate that diverged with the smallest _size
        self.on_test = on_test
        self._verdicts: dict[str, bool] = {}

    def fails(self, workload: Workload) -> bool:
        """Whether ``workload`` diverges with the signature: its verdict, run once. _OutOfTests when
        it would be the candidate after ``max_tests``."""
        if not workload.requests:  # nothing runs, nothing diverges
            return False
        key = workload.model_dump_json()
        if key not in self._verdicts:
            if self.num_tests >= self.max_tests:
                raise OutOfTests
            self._verdicts[key] = self._run(workload)
        return self._verdicts[key]

    def result(self, name: str, *, stopped_by: str | None = None) -> MinimizeResult:
        """The smallest candidate that diverged, renamed ``name``, as a MinimizeResult. Needs one to
        have."""
        return MinimizeResult(
            self.smallest.model_copy(update={"name": name}),
            self.signature,
            self.num_tests,
            self.kv_path,
            self.shadow_path,
            self.faults.to_spec() if self.faults else None,
            stopped_by,
            self.demo_bug,
        )

    def _run(self, workload: Workload) -> bool:
        self.num_tests += 1
        log = self.log_dir / f"candidate-{self.num_tests}.jsonl"
        # fresh: the schedule replays
        injector = FaultInjector(self.faults) if self.faults is not None else None
        worker = self.make_worker(
            workload, kv_gate=self._gate(log), shadow_path=self.shadow_path, faults=injector
        )
        num_logged = 0

        def stop_once_seen(num_released: int, num_requests: int) -> None:
            nonlocal num_logged
            total = sum(worker.kv_compare.executor.stats().num_divergences.values())
            if worker.kv_verify is not None:
                total += sum(worker.kv_verify.divergences.values())
            if total > num_logged:
                num_logged = total
                if self._logged(log):
                    raise Seen

        seen = False
        try:
            run_workload(
                worker,
                workload,
                on_step=stop_once_seen,
                max_steps=max(_step_limit(workload), self.min_steps),
                source=self.source,
                scale=self.scale,
            )
        except Seen:
            seen = True
        except Exception:  # a crash or a stall: the log still says what diverged before it
            pass
        finally:
            worker.kv_compare.sink.close()
        seen = seen or self._logged(log)
        log.unlink(missing_ok=True)
        if seen and (self.smallest is None or _size(workload) < _size(self.smallest)):
            self.smallest = workload
        if self.on_test is not None:
            self.on_test(
                self.num_tests, len(self.smallest.requests) if self.smallest is not None else None
            )
        return seen

    def _gate(self, log: Path) -> KvGateConfig:
        """A candidate's gate: compare mode log into ``log``, the page-content oracle on (a data
        divergence shows only to it), the record's demo bug planted. Pure."""
        return KvGateConfig(
            path=self.kv_path, compare="log", compare_log=str(log), verify="all",
            compare_demo_bug=self.demo_bug,
        )  # fmt: skip

    def _logged(self, log: Path) -> bool:
        if not log.exists():
            return False
        return any(
            isinstance(record, DivergenceRecord)
            and DivergenceSignature.of(record) == self.signature
            for record in read_log(log).records
        )


class Seen(Exception):
    """Ends a candidate's run at its first divergence with the signature."""


class OutOfTests(Exception):
    """Ends the search when a candidate would run past ``max_tests``."""


def _size(workload: Workload) -> tuple[int, int]:
    """What "smaller" compares among diverging candidates: requests, then step units. Pure."""
    return len(workload.requests), len(step_units(workload.requests))


def _step_limit(workload: Workload) -> int:
    """Steps after which a candidate counts as stalled: generous for any run that makes progress."""
    reqs = workload.requests
    return (
        4
        * (
            max(r.arrival_step for r in reqs)
            + sum(r.max_new_tokens + (r.abort_step or 0) for r in reqs)
        )
        + 64
    )


def with_requests(workload: Workload, requests: Sequence[WorkloadRequest]) -> Workload:
    return workload.model_copy(update={"requests": list(requests)})


def step_units(requests: Sequence[WorkloadRequest]) -> list[tuple[int, str]]:
    """One (request index, field) item per step a field stands above its floor."""
    units = []
    for index, req in enumerate(requests):
        for field, floor in _STEP_FIELDS:
            value = getattr(req, field)
            if value is not None:
                units += [(index, field)] * (value - floor)
    return units


def with_steps(
    workload: Workload, requests: Sequence[WorkloadRequest], units: Sequence[tuple[int, str]]
) -> Workload:
    """``requests`` with each step field at its floor plus the units kept for it."""
    kept = Counter(units)
    shrunk = [
        req.model_copy(
            update={
                field: floor + kept[index, field]
                for field, floor in _STEP_FIELDS
                if getattr(req, field) is not None
            }
        )
        for index, req in enumerate(requests)
    ]
    return with_requests(workload, shrunk)
