"""Shrink a logged KV divergence to a minimal workload, and write it as a regression test.

:func:`minimize_divergence` reloads the record's workload (``replay``'s
``workload_source``, ``scale`` and ``vocab_size``, the record's ``seed``), folds its
token ids into the tiny model's vocabulary, and delta-debugs it with
``compare.ddmin``, in two passes:

    requests  the fewest requests that still diverge
    steps     the remaining requests' step counts, as units ddmin can drop:
              one unit per max_new_tokens above 1, per arrival_step above 0 and
              per abort_step above 0 (all at their floor first: often enough)

A candidate workload "still fails" when a fresh worker in compare mode ``log``
(the record's authoritative and shadow paths, engine config and fault SPEC)
logs a divergence with the record's :class:`DivergenceSignature`: same op, same
kind, same set of wildcarded field paths. A candidate's run stops at its first such divergence;
one that crashes or stalls counts by what it logged before.

The result is the smallest candidate that diverged: fewest requests, then fewest
step units. A finished search makes it 1-minimal. A search that runs out of
``max_tests``, or that Ctrl-C or SIGTERM interrupts (``on_interrupt``), ends with the
smallest found so far, which may not be minimal (``MinimizeResult.stopped_by``).

:func:`write_regression` writes the minimal workload (JSON) and a pytest file
that runs it in compare mode ``raise`` and fails until the bug is fixed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from batchgen.config import TINY_MODELS, EngineConfig, validation_summary
from batchgen.engine.faults import FaultInjector, FaultSpec, FaultSpecError
from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadRequest, load_workload
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.shadow.rebuild import kv_paths
from compare import DivergenceRecord, ddmin, read_log, wildcard, write_atomic

_STEP_FIELDS = (("max_new_tokens", 1), ("arrival_step", 0), ("abort_step", 0))  # (field, floor)
# the candidates' model; also a record's vocabulary when it names none
TINY_VOCAB = TINY_MODELS["tiny"].vocab_size


class MinimizeError(ValueError):
    """The record cannot be minimized: its payload names no valid workload, engine config or fault
    SPEC."""


class NotReproduced(MinimizeError):
    """The record's divergence does not show on its own workload."""


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


def tiny_worker_factory() -> WorkerFactory:
    """Workers over one tiny model (loaded here, shared) with the workload's cache and engine
    configs."""
    model = load_model("tiny")

    def make_worker(
        workload: Workload, *, kv_gate: KvGateConfig, shadow_path: str, faults: FaultInjector | None
    ) -> Worker:
        return Worker(
            model,
            cache_config=workload.cache,
            engine_config=workload.engine,
            kv_gate=kv_gate,
            shadow_path=shadow_path,
            faults=faults,
        )

    return make_worker


def minimize_divergence(
    record: DivergenceRecord,
    *,
    make_worker: WorkerFactory | None = None,
    max_tests: int = 400,
    on_test: TestCallback | None = None,
    on_interrupt: InterruptCallback | None = None,
) -> MinimizeResult:
    """Delta-debug the record's workload down to a minimal one with the same divergence.

    Runs at most ``max_tests`` candidate workloads, calling ``on_test(num_tests, smallest)`` after
    each (``smallest``: the fewest requests of a candidate that diverged so far, None before one
    has). When the budget runs out first, returns the smallest diverging candidate so far with
    ``stopped_by="max_tests"``. When a KeyboardInterrupt (Ctrl-C, or SIGTERM's ``Terminated``) ends
    the search after a candidate diverged, calls ``on_interrupt`` with that smallest candidate
    (``stopped_by="interrupted"``), then lets the interrupt propagate. Raises NotReproduced when the
    full workload does not diverge as recorded, MinimizeError (ReplayError for its KV paths) when
    the record's payload is not usable. Writes only temporary logs, removed before it returns."""
    if max_tests < 1:
        raise ValueError(
            f"max_tests must be >= 1 (the full workload is run first), not {max_tests}"
        )
    replay = record.replay
    scale = replay.get("scale", 1.0)
    workload, faults, (kv_path, shadow_path) = recorded_run(record)
    signature = DivergenceSignature.of(record)
    name = f"{workload.name}-min"
    with tempfile.TemporaryDirectory(prefix="batchgen-minimize-") as log_dir:
        search = _Search(
            signature,
            make_worker or tiny_worker_factory(),
            kv_path,
            shadow_path,
            Path(log_dir),
            replay["workload_source"],
            scale,
            faults,
            min_steps=record.step + 1,
            max_tests=max_tests,
            on_test=on_test,
        )
        try:
            if not search.fails(workload):
                raise NotReproduced(
                    f"{record.op} step {record.step}: workload {replay['workload_source']!r} (seed"
                    f" {record.seed}, scale"
                    f" {scale}{', faults ' + faults.to_spec() if faults else ''}) shows no"
                    f" {signature.kind} divergence at"
                    f" {', '.join(signature.field_paths) or 'no field path'}"
                )
            try:
                _shrink_steps(search, workload, _shrink_requests(search, workload))
            except _OutOfTests:
                return search.result(name, stopped_by="max_tests")
        except KeyboardInterrupt:
            if on_interrupt is not None and search.smallest is not None:
                on_interrupt(search.result(name, stopped_by="interrupted"))
            raise
    return search.result(name)


def recorded_run(record: DivergenceRecord) -> tuple[Workload, FaultSpec | None, tuple[str, str]]:
    """What the search reruns: the record's workload (``recorded_workload``), fault SPEC and KV
    paths (authoritative, shadow). MinimizeError, or ReplayError for the paths, when one is not
    usable. Reads the workload file a record names; mutates nothing."""
    return recorded_workload(record), _fault_spec(record.replay), kv_paths(record.replay)


def recorded_workload(record: DivergenceRecord) -> Workload:
    """The workload of the record's run (its source, seed, scale, vocabulary and engine config),
    with its token ids folded into the tiny model's vocabulary."""
    replay = record.replay
    source = replay.get("workload_source")
    if not isinstance(source, str) or not source:
        raise MinimizeError(
            f"the record's workload_source must be a workload name or file, not {source!r}"
        )
    workload = load_workload(
        source,
        seed=record.seed,
        scale=replay.get("scale", 1.0),
        vocab_size=replay.get("vocab_size", TINY_VOCAB),
    )
    return _in_tiny_vocabulary(_with_engine(workload, replay))


def _in_tiny_vocabulary(workload: Workload) -> Workload:
    """The workload with each token id folded into the tiny model's vocabulary (ids in [1,
    TINY_VOCAB)).

    The run that diverged may have had a larger vocabulary (a checkpoint, the 7B geometry); the
    candidates run on the tiny model, whose KV decisions depend on the requests' lengths and steps,
    never on which tokens they hold (it emits no EOS).
    """
    if all(token < TINY_VOCAB for req in workload.requests for token in req.prompt_ids):
        return workload
    folded = [
        req.model_copy(
            update={"prompt_ids": [1 + (token - 1) % (TINY_VOCAB - 1) for token in req.prompt_ids]}
        )
        for req in workload.requests
    ]
    return workload.model_copy(update={"requests": folded})


def _with_engine(workload: Workload, replay: dict) -> Workload:
    """The workload with the engine config the recorded run had (its overrides included), when
    recorded."""
    engine = replay.get("engine")
    if engine is None:
        return workload
    try:
        return workload.model_copy(update={"engine": EngineConfig.model_validate(engine)})
    except ValidationError as error:
        raise MinimizeError(
            f"the recorded engine config is not valid: {validation_summary(error)}"
        ) from None


def _fault_spec(replay: dict) -> FaultSpec | None:
    """The fault SPEC the recorded run had, when it had one."""
    spec = replay.get("faults")
    if spec is None:
        return None
    if not isinstance(spec, str):
        raise MinimizeError(f"the recorded fault SPEC must be a string, not {spec!r}")
    try:
        return FaultSpec.parse(spec)
    except FaultSpecError as error:
        raise MinimizeError(f"the recorded fault SPEC is not valid: {error}") from None


# ddmin's own budget: never reached, the search counts the candidates (ddmin's count includes cached
# verdicts)
_UNBOUNDED = sys.maxsize


def _shrink_requests(search: _Search, workload: Workload) -> list[WorkloadRequest]:
    """The request pass: ddmin over the workload's requests. Returns the 1-minimal requests it finds
    (the search holds them as its smallest)."""
    return ddmin(
        workload.requests,
        lambda subset: search.fails(_with_requests(workload, subset)),
        max_tests=_UNBOUNDED,
    )


def _shrink_steps(search: _Search, workload: Workload, requests: list[WorkloadRequest]) -> None:
    """The step pass: every step field of ``requests`` at its floor if that still fails, else ddmin
    over the units. The search keeps the smallest candidate that diverged."""
    if search.fails(_with_steps(workload, requests, [])):
        return
    ddmin(
        _step_units(requests),
        lambda kept: search.fails(_with_steps(workload, requests, kept)),
        max_tests=_UNBOUNDED,
        interchangeable=True,
    )  # a unit is a count: any one will do


class _Search:
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
    ):
        self.signature = signature
        self.make_worker = make_worker
        self.kv_path, self.shadow_path = kv_path, shadow_path
        self.log_dir, self.source, self.scale = log_dir, source, scale
        self.faults = faults
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
                raise _OutOfTests
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
        )

    def _run(self, workload: Workload) -> bool:
        self.num_tests += 1
        log = self.log_dir / f"candidate-{self.num_tests}.jsonl"
        gate = KvGateConfig(path=self.kv_path, compare="log", compare_log=str(log))
        # fresh: the schedule replays
        injector = FaultInjector(self.faults) if self.faults is not None else None
        worker = self.make_worker(
            workload, kv_gate=gate, shadow_path=self.shadow_path, faults=injector
        )
        num_logged = 0

        def stop_once_seen(num_released: int, num_requests: int) -> None:
            nonlocal num_logged
            total = sum(worker.kv_compare.executor.stats().num_divergences.values())
            if total > num_logged:
                num_logged = total
                if self._logged(log):
                    raise _Seen

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
        except _Seen:
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

    def _logged(self, log: Path) -> bool:
        if not log.exists():
            return False
        return any(
            isinstance(record, DivergenceRecord)
            and DivergenceSignature.of(record) == self.signature
            for record in read_log(log).records
        )


class _Seen(Exception):
    """Ends a candidate's run at its first divergence with the signature."""


class _OutOfTests(Exception):
    """Ends the search when a candidate would run past ``max_tests``."""


def _size(workload: Workload) -> tuple[int, int]:
    """What "smaller" compares among diverging candidates: requests, then step units. Pure."""
    return len(workload.requests), len(_step_units(workload.requests))


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


def _with_requests(workload: Workload, requests: Sequence[WorkloadRequest]) -> Workload:
    return workload.model_copy(update={"requests": list(requests)})


def _step_units(requests: Sequence[WorkloadRequest]) -> list[tuple[int, str]]:
    """One (request index, field) item per step a field stands above its floor."""
    units = []
    for index, req in enumerate(requests):
        for field, floor in _STEP_FIELDS:
            value = getattr(req, field)
            if value is not None:
                units += [(index, field)] * (value - floor)
    return units


def _with_steps(
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
    return _with_requests(workload, shrunk)


# ---- the regression test -------------------------------------------------------------------------
_TEST_TEMPLATE = '''\
"""Regression test written by batchgen minimize: fails until the KV divergence below is fixed."""

# The workload makes the shadow path diverge from the authoritative one:
#   authoritative: {kv_path}
#   shadow:        {shadow_path}
#   op:            {op}
#   kind:          {kind}
#   field paths:   {paths}

from pathlib import Path

from batchgen.model.loader import load_model
from batchgen.engine.runner import run_workload
from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.kv.gate import KvGateConfig
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import load_workload

WORKLOAD = Path(__file__).parent / {workload_literal}
FAULTS = {faults_literal}  # the fault SPEC the divergence needs (None: none)


def test_no_{slug}_divergence(tmp_path):
    workload = load_workload(str(WORKLOAD))
    # compare="raise" on this op alone: the test fails at this divergence
    gate = KvGateConfig(path={kv_path_literal}, compare="raise", compare_ops=({op_literal},),
                        compare_log=str(tmp_path / "kv-divergences.jsonl"))
    worker = Worker(load_model("tiny"), cache_config=workload.cache, engine_config=workload.engine,
                    kv_gate=gate, shadow_path={shadow_path_literal},
                    faults=FaultInjector(FaultSpec.parse(FAULTS)) if FAULTS is not None else None)
    result = run_workload(worker, workload, source=str(WORKLOAD))
    assert not result.compare_summary.divergences
'''


def write_regression(
    result: MinimizeResult, workload_path: str | Path, test_path: str | Path
) -> None:
    """Write the minimal workload (JSON) and a pytest file that replays it in compare mode
    ``raise``, comparing the signature's op only (a divergence of another op, another bug's, does
    not fail it).

    Both files are replaced atomically. The test names the workload by its path
    relative to the test file, is named after the signature
    (``test_no_<slug>_divergence``), and runs the tiny model: KV decisions depend
    on the workload alone while the model emits no EOS (the tiny one has none).
    """
    for path, text in _regression_files(result, Path(workload_path), Path(test_path)).items():
        write_atomic(path, text)


def write_regression_into(out_dir: str | Path, result: MinimizeResult) -> tuple[Path, Path]:
    """:func:`write_regression` into ``out_dir`` as ``<slug>.json`` and ``test_kv_<slug>.py``, or
    with ``_2``, ``_3``... when those files hold another regression (one with the same signature
    from another record or direction): nothing is overwritten but the same files again. Returns the
    workload and test paths."""
    out_dir, slug = Path(out_dir), result.signature.slug
    for number in itertools.count(1):
        name = slug if number == 1 else f"{slug}_{number}"
        workload_path, test_path = out_dir / f"{name}.json", out_dir / f"test_kv_{name}.py"
        files = _regression_files(result, workload_path, test_path)
        if all(
            not path.exists() or path.read_text(encoding="utf-8") == text
            for path, text in files.items()
        ):
            write_regression(result, workload_path, test_path)
            return workload_path, test_path


def _regression_files(
    result: MinimizeResult, workload_path: Path, test_path: Path
) -> dict[Path, str]:
    """The text of the workload file and of the test file :func:`write_regression` writes. Pure."""
    relative = Path(os.path.relpath(workload_path.resolve(), test_path.resolve().parent)).as_posix()
    signature = result.signature
    source = _TEST_TEMPLATE.format(
        slug=signature.slug,
        op=_comment(signature.op),
        kind=_comment(signature.kind),
        kv_path=_comment(result.kv_path),
        shadow_path=_comment(result.shadow_path),
        paths="\n#                  ".join(map(_comment, signature.field_paths))
        or "(none: a side raised)",
        workload_literal=json.dumps(relative),
        kv_path_literal=json.dumps(result.kv_path),
        op_literal=json.dumps(signature.op),
        # a JSON string is a Python string literal
        shadow_path_literal=json.dumps(result.shadow_path),
        faults_literal=json.dumps(result.faults) if result.faults is not None else "None",
    )
    return {workload_path: result.workload.to_json(), test_path: source}


def _comment(text: str) -> str:
    """``text`` on one line, safe inside a ``#`` comment."""
    return " ".join(text.split())
