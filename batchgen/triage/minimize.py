"""Shrink a logged KV divergence to a minimal workload, and write it as a regression test.

:func:`minimize_divergence` reloads the record's workload (``replay``'s
``workload_source``, ``scale`` and ``vocab_size``, the record's ``seed``; prefix caching as
its op request's geometry had it), folds its token ids into the tiny model's vocabulary, and
delta-debugs it with
``compare.ddmin``, in two passes:

    requests  the fewest requests that still diverge
    steps     the remaining requests' step counts, as units ddmin can drop:
              one unit per max_new_tokens above 1, per arrival_step above 0 and
              per abort_step above 0 (all at their floor first: often enough)

A candidate workload "still fails" when a fresh worker in compare mode ``log``
(the record's authoritative and shadow paths, engine config, fault SPEC and demo bug)
logs a divergence with the record's :class:`DivergenceSignature`: same op, same
kind, same set of wildcarded field paths. A candidate's run stops at its first such divergence;
one that crashes or stalls counts by what it logged before.

The result is the smallest candidate that diverged: fewest requests, then fewest
step units. A finished search makes it 1-minimal. A search that runs out of
``max_tests``, or that Ctrl-C or SIGTERM interrupts (``on_interrupt``), ends with the
smallest found so far, which may not be minimal (``MinimizeResult.stopped_by``).

``regression.write_regression`` writes the minimal workload (JSON) and a pytest file
that runs it in compare mode ``raise`` and fails until the bug is fixed.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from pydantic import ValidationError

from batchgen.config import TINY_MODELS, EngineConfig, validation_summary
from batchgen.engine.faults import FaultInjector, FaultSpec, FaultSpecError
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadRequest, load_workload
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import gated_worker
from batchgen.triage.minimize_search import (
    DivergenceSignature,
    InterruptCallback,
    MinimizeResult,
    OutOfTests,
    Search,
    TestCallback,
    WorkerFactory,
    step_units,
    with_requests,
    with_steps,
)
from batchgen.triage.rebuild import kv_paths
from batchgen.triage.replay import recorded_demo_bug
from compare import DivergenceRecord, ddmin

# the candidates' model; also a record's vocabulary when it names none
TINY_VOCAB = TINY_MODELS["tiny"].vocab_size


class MinimizeError(ValueError):
    """The record cannot be minimized: its payload names no valid workload, engine config or fault
    SPEC."""


class NotReproduced(MinimizeError):
    """The record's divergence does not show on its own workload."""


def tiny_worker_factory() -> WorkerFactory:
    """Workers over one tiny model (loaded here, shared) with the workload's cache and engine
    configs."""
    model = load_model("tiny")

    def make_worker(
        workload: Workload, *, kv_gate: KvGateConfig, shadow_path: str, faults: FaultInjector | None
    ) -> Worker:
        return gated_worker(
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
        raise ValueError(f"max_tests must be >= 1 (the full workload is run first): {max_tests}")
    workload, faults, (kv_path, shadow_path) = recorded_run(record)
    signature = DivergenceSignature.of(record)
    name = f"{workload.name}-min"
    with tempfile.TemporaryDirectory(prefix="batchgen-minimize-") as log_dir:
        search = Search(
            signature,
            make_worker or tiny_worker_factory(),
            kv_path,
            shadow_path,
            Path(log_dir),
            record.replay["workload_source"],
            record.replay.get("scale", 1.0),
            faults,
            min_steps=record.step + 1,
            max_tests=max_tests,
            on_test=on_test,
            demo_bug=recorded_demo_bug(record),
        )
        try:
            if not search.fails(workload):
                raise NotReproduced(_not_reproduced(record, signature, faults))
            try:
                _shrink_steps(search, workload, _shrink_requests(search, workload))
            except OutOfTests:
                return search.result(name, stopped_by="max_tests")
        except KeyboardInterrupt:
            if on_interrupt is not None and search.smallest is not None:
                on_interrupt(search.result(name, stopped_by="interrupted"))
            raise
    return search.result(name)


def _not_reproduced(
    record: DivergenceRecord, signature: DivergenceSignature, faults: FaultSpec | None
) -> str:
    """Why the full workload is not a starting point: it ran clean of the record's divergence."""
    replay = record.replay
    run = f"seed {record.seed}, scale {replay.get('scale', 1.0)}"
    if faults:
        run += f", faults {faults.to_spec()}"
    where = ", ".join(signature.field_paths) or "no field path"
    return (
        f"{record.op} step {record.step}: workload {replay['workload_source']!r} ({run}) shows"
        f" no {signature.kind} divergence at {where}"
    )


def recorded_run(record: DivergenceRecord) -> tuple[Workload, FaultSpec | None, tuple[str, str]]:
    """What the search reruns: the record's workload (``recorded_workload``), fault SPEC and KV
    paths (authoritative, shadow). MinimizeError, or ReplayError for the paths, when one is not
    usable. Reads the workload file a record names; mutates nothing."""
    return recorded_workload(record), _fault_spec(record.replay), kv_paths(record.replay)


def recorded_workload(record: DivergenceRecord) -> Workload:
    """The workload of the record's run (its source, seed, scale, vocabulary, engine config and
    prefix caching), with its token ids folded into the tiny model's vocabulary."""
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
    return _in_tiny_vocabulary(_with_prefix_caching(_with_engine(workload, replay), replay))


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


def _with_prefix_caching(workload: Workload, replay: dict) -> Workload:
    """The workload with the prefix caching the recorded run had (its op request's geometry says:
    a gate flag may have set it over the workload's), when recorded."""
    snapshot = (replay.get("request") or {}).get("snapshot") or {}
    caching = (snapshot.get("geometry") or {}).get("prefix_caching")
    if caching is None or caching == workload.cache.enable_prefix_caching:
        return workload
    if not isinstance(caching, bool):
        raise MinimizeError(
            f"the recorded geometry's prefix_caching must be true or false, not {caching!r}"
        )
    cache = workload.cache.model_copy(update={"enable_prefix_caching": caching})
    return workload.model_copy(update={"cache": cache})


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


def _shrink_requests(search: Search, workload: Workload) -> list[WorkloadRequest]:
    """The request pass: ddmin over the workload's requests. Returns the 1-minimal requests it finds
    (the search holds them as its smallest)."""
    return ddmin(
        workload.requests,
        lambda subset: search.fails(with_requests(workload, subset)),
        max_tests=_UNBOUNDED,
    )


def _shrink_steps(search: Search, workload: Workload, requests: list[WorkloadRequest]) -> None:
    """The step pass: every step field of ``requests`` at its floor if that still fails, else ddmin
    over the units. The search keeps the smallest candidate that diverged."""
    if search.fails(with_steps(workload, requests, [])):
        return
    ddmin(
        step_units(requests),
        lambda kept: search.fails(with_steps(workload, requests, kept)),
        max_tests=_UNBOUNDED,
        interchangeable=True,
    )  # a unit is a count: any one will do
