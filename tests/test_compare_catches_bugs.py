"""Compare mode catches plan-layer bugs: injected mutants are reported on the op they break.

Each bug is a *mutant*: the real function's source with one small edit (``mutate``), or
a replacement where the bug needs state (the stale watermark cache), monkeypatched in.
A mutant is run on the L2 workloads with the tiny model in compare mode, and the
divergence log must name the broken op, with a kind and field paths (or a rejection
message) that say what went wrong:

    bug (mutant)                               op(s)      kind          evidence
    allocation off by one page                 alloc      invalid_plan  AllocPlan.grants[i]
                                                                        .new_page_ids
    allocation hands out page ids reversed     alloc      state         requests[*].gpu_page_ids[*],
                                                                        pools.gpu
    host pages kept after a completed load     poll       state         requests[*].host_page_ids,
                                                                        free host
    a failed load is retried forever           poll       invalid_plan  PollPlan.actions[i]
    a failed load is never retried             poll       state         phase, recompute counter
    released request keeps its pending append  release    state         outputs[*]
                                                                        .has_pending_append
    release plans no pending-append drop       release    invalid_plan  ReleasePlan
                                                                        .drop_pending_append_ids
    aborted request keeps its host pages       release    state         pools.host, free host
    oldest running request evicted             evict      state         requests[*].phase, copies
    eviction grants host page ids permuted     evict      state         host_page_ids, copy targets
    eviction copies GPU pages in wrong order   evict      copies        copies[*].src_page_ids[*]
    watermark cached from another geometry     evict,     state         requests[*].phase
                                               migrate
    request swapped this step migrated back    migrate    state         requests[*].phase, copies

Runs use ``compare="raise"`` so they stop at the first divergence (the record is written
before the error is raised): the first divergence must already be the right one, i.e.
nothing earlier in the run is noise. Every bug runs in both directions: the rollout one
(legacy authoritative, plan shadow) and the reverse (plan authoritative, legacy shadow).
Log mode, whole runs and token checks are covered by the exception / rejected-plan test
and the clean-run tests.

Clean runs (zero divergences, both directions and A/A) use ``smoke`` at scale 2 with a
host tier of 12 pages, over seeds 0-9, with aborts of swapped/loading requests and every
third load failing: eviction, migration, recompute preemption, retries and aborts all
happen in a few hundred milliseconds per run (a full L2-2048 compare run is ~3 s on an
idle core, far more on the shared ones).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from injected_bugs import mutate

from batchgen.config import TINY_MODELS, CacheConfig
from batchgen.engine.runner import RunResult, run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, builtin_workload
from batchgen.kv import appliers, plan_path
from batchgen.kv import manager as kv_manager
from batchgen.kv.backends import CompletedHandle, HostKvPool
from batchgen.kv.gate import KvGateConfig
from batchgen.kv.manager import KVCacheManager
from batchgen.kv.page_copy import CopyError
from batchgen.kv.plan_checks import PlanRejected
from batchgen.kv.plans import to_jsonable
from batchgen.kv.target import KvTarget
from batchgen.model.loader import load_model
from batchgen.model.null_model import NullModel
from batchgen.shadow import forms, kv_compare
from batchgen.shadow.fork import detach_fork, differing_requests, fork_target
from batchgen.shadow.forked_pages import ForkedPagePool
from batchgen.shadow.forms import add_requests, canonical_result
from batchgen.shadow.recording import RecordingState, recorded, start
from batchgen.shadow.wiring import gated_worker
from batchgen.state import Phase, Request, RequestState, WorkerState
from compare import (
    DivergenceError,
    DivergenceRecord,
    HarnessWarning,
    Keyed,
    RunSummary,
    read_log,
    wildcard,
)

OTHER_PATH = {"legacy": "plan", "plan": "legacy"}
REQUEST_TYPES = {
    "poll": "PollRequest",
    "release": "ReleaseRequest",
    "evict": "EvictionRequest",
    "migrate": "MigrationRequest",
    "alloc": "AllocRequest",
}
CLEAN_SEEDS = range(10)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


# ---- mutants ----------------------------------------------------------------------------------
def method_mutant(name: str, old: str, new: str) -> Callable[[pytest.MonkeyPatch], None]:
    def inject(monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(KVCacheManager, name, mutate(getattr(KVCacheManager, name), old, new))

    return inject


def applier_mutant(name: str, old: str, new: str) -> Callable[[pytest.MonkeyPatch], None]:
    def inject(monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(plan_path, name, mutate(getattr(plan_path, name), old, new))

    return inject


def function_mutant(name: str, old: str, new: str) -> Callable[[pytest.MonkeyPatch], None]:
    def inject(monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(kv_manager, name, mutate(getattr(kv_manager, name), old, new))

    return inject


def stale_watermark(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watermark computed once, from the first geometry planned for, and cached in the
    module."""
    cache: dict[str, int] = {}

    def eviction_watermark_pages(snapshot) -> int:
        if "pages" not in cache:
            geometry = snapshot.geometry
            cache["pages"] = math.ceil(geometry.watermark * geometry.num_gpu_pages)
        return cache["pages"]

    monkeypatch.setattr(kv_manager, "eviction_watermark_pages", eviction_watermark_pages)


def failing_fast(workload: Workload) -> Workload:
    """``workload`` with ``load_failure="fail"``: a request whose load fails past its retries
    fails."""
    return workload.model_copy(
        update={"engine": workload.engine.model_copy(update={"load_failure": "fail"})}
    )


def handle_of_no_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Migration issues each load's copy, then gives the request a finished handle of no copy."""
    monkeypatch.setattr(appliers, "CompletedHandle", CompletedHandle, raising=False)
    applier_mutant(
        "apply_migration_plan",
        "        req.load_handle = target.host_kv.load_to_gpu_async(load.uuid,"
        " list(load.gpu_page_ids))",
        "        target.host_kv.load_to_gpu_async(load.uuid, list(load.gpu_page_ids))\n"
        "        req.load_handle = CompletedHandle()",
    )(monkeypatch)


# ---- drivers: what happens to the worker between steps ----------------------------------------
class FailedLoad:
    """The handle of an injected load failure: done, and ``wait`` raises like a failed copy."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        raise CopyError(RuntimeError("injected load failure"))


def fail_loads(monkeypatch: pytest.MonkeyPatch, *, every: int = 1) -> None:
    """Make every ``every``-th load the worker's own host pool starts fail (forks are untouched)."""
    real = HostKvPool.load_to_gpu_async
    count = {"loads": 0}

    def load_to_gpu_async(self, uuid, page_ids):
        handle = real(self, uuid, page_ids)
        if isinstance(self.pages, ForkedPagePool):
            return handle
        count["loads"] += 1
        if count["loads"] % every:
            return handle
        handle.wait()  # the real copy lands before the request's pages can be reused
        return FailedLoad()

    monkeypatch.setattr(HostKvPool, "load_to_gpu_async", load_to_gpu_async)


def abort_swapped(worker: Worker, *, limit: int = 2) -> Callable[[int, int], None]:
    """An ``on_step`` hook that, after a step, aborts the first SWAPPED or LOADING request
    (``limit`` in all)."""
    aborted: list[str] = []

    def on_step(num_released: int, num_requests: int) -> None:
        if len(aborted) >= limit:
            return
        for req in worker.state.requests.values():
            if req.phase in (Phase.SWAPPED, Phase.LOADING):
                worker.abort(req.uuid)
                aborted.append(req.uuid)
                return

    on_step.aborted = aborted
    return on_step


# ---- running in compare mode ------------------------------------------------------------------
@dataclass
class CompareRun:
    records: list[DivergenceRecord]
    summaries: list[RunSummary]
    results: list[RunResult]  # one per workload that completed
    error: BaseException | None  # what stopped a "raise" run
    num_aborted: int = 0


def run_compare(
    model,
    log: Path,
    workloads: list[Workload],
    *,
    authoritative: str,
    mode: str = "raise",
    shadow_path: str | None = None,
    aborts: int = 0,
) -> CompareRun:
    """Run each workload on a fresh worker in compare mode, all logging to ``log``.

    In "raise" mode the first divergence stops the run (DivergenceError, or the
    authoritative path's PlanRejected); later workloads are then skipped.
    """
    gate = KvGateConfig(path=authoritative, compare=mode, compare_log=str(log))
    results, error, num_aborted = [], None, 0
    for workload in workloads:
        worker = gated_worker(
            model,
            cache_config=workload.cache,
            engine_config=workload.engine,
            kv_gate=gate,
            shadow_path=shadow_path,
        )
        on_step = abort_swapped(worker, limit=aborts) if aborts else None
        try:
            results.append(run_workload(worker, workload, source=workload.name, on_step=on_step))
        except (DivergenceError, PlanRejected) as stopped:
            if mode != "raise":
                raise
            error = stopped
        num_aborted += len(on_step.aborted) if on_step else 0
        if error is not None:
            break
    records = read_log(log).records if log.exists() else ()
    return CompareRun(
        records=[r for r in records if isinstance(r, DivergenceRecord)],
        summaries=[r for r in records if isinstance(r, RunSummary)],
        results=results,
        error=error,
        num_aborted=num_aborted,
    )


def first_wave(workload: Workload) -> Workload:
    """The workload's first eight requests (its first arrival wave): same geometry, a short run."""
    return workload.model_copy(update={"requests": workload.requests[:8]})


# ---- the bugs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bug:
    name: str
    inject: Callable[[pytest.MonkeyPatch], None]
    ops: frozenset[str]  # the op(s) the first divergence must be on
    kind: str
    evidence: tuple[str, ...] = ()  # wildcarded field-path prefixes that must all differ
    message: str | None = None  # regex the record's exception text must match (exception kinds)
    absent: tuple[str, ...] = ()  # field-path prefixes that must not differ
    workloads: Callable[[], list[Workload]] = lambda: [builtin_workload("L2-2048")]
    failing_loads: bool = False
    aborts: int = 0


BUGS = [
    Bug(
        "alloc-off-by-one-page",
        method_mutant(
            "plan_allocation",
            "need = max(0, pages_needed(num_tokens, page_size) - len(page_ids) - len(hits))",
            "need = max(0, num_tokens // page_size + 1 - len(page_ids) - len(hits))",
        ),
        frozenset({"alloc"}),
        "invalid_plan",
        message=r"AllocPlan\.grants\[\d+\]\.new_page_ids: \d+ pages granted, \d+ needed",
    ),
    Bug(
        "alloc-page-ids-reversed",
        method_mutant(
            "plan_allocation",
            "tuple(free.take_new(need))",
            "tuple(free.take_new(need))[::-1]",
        ),
        frozenset({"alloc"}),
        "state",
        evidence=("requests[*].gpu_page_ids[*]", "pools.gpu[*]"),
        absent=("requests[*].phase", "pools.num_free_gpu"),
    ),
    Bug(
        "poll-keeps-host-pages-after-load",
        applier_mutant(
            "apply_poll_plan",
            "            target.host_kv.release_pages(uuid)\n            req.host_page_ids = ()\n",
            "",
        ),
        frozenset({"poll"}),
        "state",
        evidence=("requests[*].host_page_ids", "pools.num_free_host"),
    ),
    Bug(
        "poll-retries-failed-load-forever",
        function_mutant("_poll_decision", "num_retries < geometry.max_load_retries", "True"),
        frozenset({"poll"}),
        "invalid_plan",
        message=r"PollPlan\.actions\[\d+\]: .* has no retries left",
        failing_loads=True,
    ),
    Bug(
        "poll-never-retries-failed-load",
        function_mutant("_poll_decision", "num_retries < geometry.max_load_retries", "False"),
        frozenset({"poll"}),
        "state",
        evidence=("requests[*].phase", "stats.recompute_preemptions"),
        failing_loads=True,
    ),
    Bug(
        "release-keeps-pending-append",
        applier_mutant(
            "apply_release_plan", "        target.drop_pending_append(uuid)\n", "        pass\n"
        ),
        frozenset({"release"}),
        "state",
        evidence=("outputs[*].has_pending_append",),
    ),
    Bug(
        "release-plans-no-pending-append-drop",
        method_mutant(
            "plan_release", "drop_pending_append_ids=req.uuids", "drop_pending_append_ids=()"
        ),
        frozenset({"release"}),
        "invalid_plan",
        message=(
            r"ReleasePlan\.drop_pending_append_ids: released \[.*\] would keep their pending"
            r" appends"
        ),
    ),
    Bug(
        "release-keeps-host-pages-of-aborted",
        applier_mutant("apply_release_plan", "        target.host_kv.release_pages(uuid)\n", ""),
        frozenset({"release"}),
        "state",
        evidence=("pools.host", "pools.num_free_host"),
        aborts=2,
    ),
    Bug(
        "evict-oldest-not-youngest",
        method_mutant(
            "plan_eviction", "reversed(range(len(running.uuids)))", "range(len(running.uuids))"
        ),
        frozenset({"evict"}),
        "state",
        evidence=("requests[*].phase", "copies"),
    ),
    Bug(
        "evict-host-page-ids-permuted",
        method_mutant(
            "plan_eviction",
            "_peek(self._host_kv, snapshot.num_free_host_pages - free_host)",
            "_peek(self._host_kv, snapshot.num_free_host_pages - free_host)[::-1]",
        ),
        frozenset({"evict"}),
        "state",
        evidence=("requests[*].host_page_ids[*]", "copies[*].dst_page_ids[*]"),
        absent=("requests[*].phase",),
    ),
    Bug(
        "evict-copies-gpu-pages-in-wrong-order",
        applier_mutant(
            "apply_eviction_plan",
            "store_from_gpu(victim.uuid, list(req.gpu_page_ids))",
            "store_from_gpu(victim.uuid, list(req.gpu_page_ids)[::-1])",
        ),
        frozenset({"evict"}),
        "copies",
        evidence=("copies[*].src_page_ids[*]",),
    ),
    Bug(
        "watermark-cached-from-another-geometry",
        stale_watermark,
        frozenset({"evict", "migrate"}),
        "state",
        evidence=("requests[*].phase",),
        workloads=lambda: [first_wave(builtin_workload("L2-2048")), builtin_workload("L2-4096")],
    ),
    # an op that writes nothing but a counter: the quiet forms
    Bug(
        "evict-counts-evictions-it-did-not-make",
        applier_mutant(
            "apply_eviction_plan",
            "    check_eviction_plan(target, plan)\n",
            "    check_eviction_plan(target, plan)\n"
            "    if not plan.victims:\n        target.state.stats.evictions += 1\n",
        ),
        frozenset({"evict"}),
        "state",
        evidence=("stats.evictions",),
        absent=("requests", "pools", "copies"),
    ),
    # a field KV ops read, not one they write
    Bug(
        "recompute-eviction-forgets-the-generated-tokens",
        applier_mutant(
            "apply_eviction_plan",
            "            req.num_cached_tokens = 0\n",
            "            req.num_cached_tokens = 0\n            req.num_tokens ="
            " len(req.request.prompt_ids)\n",
        ),
        frozenset({"evict"}),
        "state",
        evidence=("requests[*].num_tokens",),
    ),
    Bug(
        "recompute-eviction-requeues-the-request-as-newest",
        applier_mutant(
            "apply_eviction_plan",
            "            req.num_cached_tokens = 0\n",
            "            req.num_cached_tokens = 0\n"
            "            req.arrival_index = target.state.num_submitted + 1000\n",
        ),
        frozenset({"evict"}),
        "state",
        evidence=("requests[*].arrival_index",),
    ),
    # issues the new copy, but the worker would watch the old one
    Bug(
        "retry-keeps-the-failed-loads-handle",
        applier_mutant(
            "apply_poll_plan",
            "            req.load_handle = target.host_kv.load_to_gpu_async(uuid,"
            " list(req.load_page_ids()))",
            "            target.host_kv.load_to_gpu_async(uuid, list(req.load_page_ids()))",
        ),
        frozenset({"poll"}),
        "state",
        evidence=("requests[*].load",),
        failing_loads=True,
    ),
    Bug(
        "migrate-tracks-a-handle-of-no-copy",
        lambda monkeypatch: handle_of_no_copy(monkeypatch),
        frozenset({"migrate"}),
        "state",
        evidence=("requests[*].load",),
    ),
    # the load_failure="fail" policy: a request out of retries fails
    Bug(
        "poll-recomputes-when-told-to-fail",
        function_mutant("_poll_decision", 'if geometry.load_failure == "fail":', "if False:"),
        frozenset({"poll"}),
        "state",
        evidence=("requests[*].phase", "requests[*].finish_reason"),
        workloads=lambda: [failing_fast(builtin_workload("L2-2048"))],
        failing_loads=True,
    ),
    # the same loads: a copies divergence, no request state
    Bug(
        "migrate-issues-loads-in-reverse-order",
        applier_mutant(
            "apply_migration_plan",
            "    for load in plan.loads:\n        req = target.state.edit(load.uuid)",
            "    for load in plan.loads[::-1]:\n        req = target.state.edit(load.uuid)",
        ),
        frozenset({"migrate"}),
        "copies",
        evidence=("copies[*].uuid",),
        absent=("requests",),
    ),
    Bug(
        "migrate-request-swapped-this-step",
        method_mutant("plan_migration", "swapped_step == snapshot.step", "False"),
        frozenset({"migrate"}),
        "state",
        evidence=("requests[*].phase", "copies"),
    ),
]


def bug_named(name: str) -> Bug:
    return next(bug for bug in BUGS if bug.name == name)


def check_reported(bug: Bug, run: CompareRun, *, authoritative: str) -> None:
    """The run stopped at a divergence on the bug's op, of its kind, with its evidence."""
    assert run.records, f"{bug.name}: no divergence reported (stopped by {run.error!r})"
    assert run.error is not None, f"{bug.name}: a raise-mode run with a divergence did not stop"
    [record] = run.records  # raise mode: the first divergence ends the run
    workloads = bug.workloads()
    assert len(run.results) == len(workloads) - 1, "a workload before the last one diverged"
    assert record.op in bug.ops, (
        f"{bug.name}: first divergence on {record.op}, expected {sorted(bug.ops)}"
    )
    assert record.kind == bug.kind, (
        f"{bug.name}: kind {record.kind}, paths {record.field_paths}, {record.exception}"
    )
    assert (record.authoritative, record.shadow) == (authoritative, OTHER_PATH[authoritative])
    assert record.workload == workloads[-1].name
    assert record.replay["request_type"] == REQUEST_TYPES[record.op]
    paths = {wildcard(path) for path in record.field_paths}
    for prefix in bug.evidence:
        assert any(p.startswith(prefix) for p in paths), (
            f"{bug.name}: no {prefix} among {sorted(paths)}"
        )
    for prefix in bug.absent:
        assert not any(p.startswith(prefix) for p in paths), (
            f"{bug.name}: {prefix} differs: {sorted(paths)}"
        )
    if bug.kind == "copies":
        assert all(p.startswith("copies") for p in paths)
    if bug.message is not None:
        assert record.field_paths == [] and record.exception is not None
        # the rejected plan is the plan path's, whichever side it ran on
        assert re.search(rf"^plan raised PlanRejected: {bug.message}", record.exception), (
            record.exception
        )


def run_bug(
    bug: Bug, model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, authoritative: str
) -> CompareRun:
    bug.inject(monkeypatch)
    if bug.failing_loads:
        fail_loads(monkeypatch)
    return run_compare(
        model,
        tmp_path / "divergences.jsonl",
        bug.workloads(),
        authoritative=authoritative,
        aborts=bug.aborts,
    )


@pytest.mark.parametrize("bug", BUGS, ids=[bug.name for bug in BUGS])
def test_a_plan_bug_in_the_shadow_is_reported_on_the_op_it_breaks(bug, tiny, tmp_path, monkeypatch):
    run = run_bug(bug, tiny, tmp_path, monkeypatch, authoritative="legacy")
    check_reported(bug, run, authoritative="legacy")


@pytest.mark.parametrize("bug", BUGS, ids=[bug.name for bug in BUGS])
def test_a_plan_bug_on_the_authoritative_path_is_reported_on_the_op_it_breaks(
    bug, tiny, tmp_path, monkeypatch
):
    run = run_bug(bug, tiny, tmp_path, monkeypatch, authoritative="plan")
    check_reported(bug, run, authoritative="plan")


def test_every_op_has_a_bug_to_catch():
    assert {op for bug in BUGS for op in bug.ops} == set(REQUEST_TYPES)


# ---- exceptions and rejected plans on the shadow side -----------------------------------------
def test_shadow_exceptions_and_rejected_plans_are_logged_and_never_reach_the_authoritative_path(
    tiny, tmp_path, monkeypatch
):
    workload = builtin_workload("L2-2048")
    reference = run_workload(
        gated_worker(
            tiny,
            cache_config=workload.cache,
            engine_config=workload.engine,
            kv_gate=KvGateConfig(path="legacy"),
        ),
        workload,
    )

    def plan_eviction(self, req):
        raise RuntimeError("injected planner crash")

    monkeypatch.setattr(KVCacheManager, "plan_eviction", plan_eviction)
    bug_named("alloc-off-by-one-page").inject(monkeypatch)  # the applier rejects the plan
    run = run_compare(tiny, tmp_path / "log.jsonl", [workload], authoritative="legacy", mode="log")

    [result] = run.results
    assert {u: o.output_ids for u, o in result.outputs.items()} == {
        u: o.output_ids for u, o in reference.outputs.items()
    }
    assert (result.leaked_gpu_pages, result.leaked_host_pages, result.live_requests) == (0, 0, 0)
    [summary] = run.summaries
    assert summary.divergences["evict"] == summary.steps_compared["evict"] == result.num_steps
    assert 0 < summary.divergences["alloc"] < summary.steps_compared["alloc"]
    assert set(summary.divergences) == {"evict", "alloc"} and summary.harness_errors == 0
    kinds = {(r.op, r.kind) for r in run.records}
    assert kinds == {("evict", "exception"), ("alloc", "invalid_plan")}
    for record in run.records:
        expected = (
            "RuntimeError: injected planner crash"
            if record.op == "evict"
            else "PlanRejected: AllocPlan.grants["
        )
        assert record.exception.startswith(f"plan raised {expected}"), record.exception
        assert record.field_paths == []


# ---- failures of the harness itself --------------------------------------------------------------
@pytest.mark.parametrize("broken", ["fork_target", "differing_requests"])
@pytest.mark.parametrize("mode", ["log", "raise"])
def test_a_failure_inside_the_harness_is_counted_never_a_divergence_and_never_reaches_the_worker(
    broken, mode, tiny, tmp_path, monkeypatch
):
    """A crash while forking (before the shadow runs) or while canonicalizing (after the
    authoritative op mutated the worker) is the harness's: the worker runs on as if compare mode
    were off."""
    workload = stress_smoke(0)
    reference = run_workload(
        gated_worker(
            tiny,
            cache_config=workload.cache,
            engine_config=workload.engine,
            kv_gate=KvGateConfig(path="plan"),
        ),
        workload,
    )

    def crash(*args, **kwargs):
        raise RuntimeError(f"injected harness crash in {broken}")

    monkeypatch.setattr(kv_compare if broken == "fork_target" else forms, broken, crash)
    with pytest.warns(HarnessWarning, match=broken):
        run = run_compare(tiny, tmp_path / "log.jsonl", [workload], authoritative="plan", mode=mode)
    [result], [summary] = run.results, run.summaries
    assert {u: o.output_ids for u, o in result.outputs.items()} == {
        u: o.output_ids for u, o in reference.outputs.items()
    }
    assert (result.leaked_gpu_pages, result.leaked_host_pages, result.live_requests) == (0, 0, 0)
    assert run.records == [] and summary.divergences == {}
    assert summary.harness_errors > 0
    if broken == "fork_target":  # no fork, nothing compared
        assert summary.steps_compared == {}
    else:  # canonicalized only where one side wrote something: quiet ops still compare
        assert summary.harness_errors < sum(summary.steps_compared.values())


@pytest.mark.parametrize("harness_crash", [False, True], ids=["sampled", "canonicalize-crashes"])
def test_journaling_stops_after_every_op_compared_or_not(
    harness_crash, tiny, tmp_path, monkeypatch
):
    """The wrappers record only while an op is compared: a sampled-out op, or one whose canonical
    forms crashed, must leave nothing recording (it would grow without bound)."""
    if harness_crash:
        monkeypatch.setattr(forms, "differing_requests", lambda *args: 1 / 0)
    workload = stress_smoke(1)
    gate = KvGateConfig(
        path="plan", compare="log", compare_sample=0.5, compare_log=str(tmp_path / "log.jsonl")
    )
    worker = gated_worker(
        tiny, cache_config=workload.cache, engine_config=workload.engine, kv_gate=gate
    )
    recording = []

    def after_step(num_released: int, num_requests: int) -> None:
        target = worker.kv_compare.recorded
        fields = (
            target.gpu_kv.journal,
            target.host_kv.journal,
            target.host_kv.copies,
            target.state.written,
            target.dropped,
        )
        recording.extend(
            f"step {worker.state.step}: {value!r}" for value in fields if value is not None
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HarnessWarning)
        run_workload(worker, workload, on_step=after_step)
    assert recording == []
    summary = worker.kv_compare.executor.stats()
    assert sum(summary.num_compared.values()) > 0 or harness_crash
    assert (summary.num_harness_errors > 0) == harness_crash


# ---- clean code: no noise ---------------------------------------------------------------------
def stress_smoke(seed: int) -> Workload:
    """``smoke`` at scale 2 (16 requests, 48 GPU pages) with a 12-page host tier: evictions, loads
    and recompute preemptions in ~60 steps."""
    return builtin_workload("smoke", seed=seed, scale=2).with_cache(num_host_pages=12)


@pytest.mark.parametrize(
    "authoritative, shadow",
    [("legacy", "plan"), ("plan", "legacy"), ("legacy", "legacy"), ("plan", "plan")],
    ids=["legacy-vs-plan-shadow", "plan-vs-legacy-shadow", "A-A-legacy", "A-A-plan"],
)
def test_clean_paths_report_no_divergence_over_ten_seeds(
    authoritative, shadow, tiny, tmp_path, monkeypatch
):
    fail_loads(monkeypatch, every=3)
    totals: dict[str, int] = {}
    stats = {
        "evictions": 0,
        "loads": 0,
        "load_failures": 0,
        "recompute_preemptions": 0,
        "aborted": 0,
    }
    for seed in CLEAN_SEEDS:
        log = tmp_path / f"seed{seed}.jsonl"
        run = run_compare(
            tiny,
            log,
            [stress_smoke(seed)],
            authoritative=authoritative,
            mode="log",
            shadow_path=shadow,
            aborts=2,
        )
        [summary] = run.summaries
        assert run.records == [], (
            f"seed {seed}: {[(r.step, r.op, r.kind, r.field_paths[:3]) for r in run.records]}"
        )
        assert summary.divergences == {} and summary.harness_errors == 0
        assert (summary.authoritative, summary.shadow) == (authoritative, shadow)
        for op, count in summary.steps_compared.items():
            totals[op] = totals.get(op, 0) + count
        [result] = run.results
        for name in stats:
            stats[name] += run.num_aborted if name == "aborted" else getattr(result.stats, name)
    assert set(totals) == set(REQUEST_TYPES), totals
    assert all(stats.values()), stats


@pytest.mark.parametrize("authoritative", ["legacy", "plan"])
def test_an_alloc_answering_with_a_tuple_of_the_same_uuids_is_no_divergence(
    authoritative, tiny, tmp_path, monkeypatch
):
    applier_mutant(
        "apply_alloc_plan",
        "    return [uuid for uuid in request.batch if uuid not in left_out]",
        "    return tuple(uuid for uuid in request.batch if uuid not in left_out)",
    )(monkeypatch)
    run = run_compare(
        tiny, tmp_path / "log.jsonl", [stress_smoke(0)], authoritative=authoritative, mode="log"
    )
    assert run.records == [], [(r.step, r.op, r.field_paths[:3]) for r in run.records]
    assert run.summaries[0].steps_compared["alloc"] > 0


def test_an_ops_result_is_compared_as_a_list_and_never_consumed():
    served = iter(["a"])
    # an iterator is left to the caller
    assert canonical_result(served) is served and list(served) == ["a"]
    assert canonical_result(("a", "b")) == canonical_result(["a", "b"]) == ["a", "b"]
    assert canonical_result(None) is None


# ---- the harness itself overlooks no field -----------------------------------------------------
FIELD_CHANGES = {
    "phase": Phase.SWAPPED,
    "num_cached_tokens": 1,
    "gpu_page_ids": (99,),
    "host_page_ids": (98,),
    "num_load_retries": 1,
    "swapped_step": 5,
    "finish_reason": "abort",
    "load_handle": CompletedHandle(),
    "load_started_step": 3,
    "num_tokens": 40,
    "arrival_index": 99,
}


def running_target(*uuids: str) -> KvTarget:
    """The live target of a bookkeeping-only worker after one step: ``uuids`` RUNNING, 2 GPU pages
    each."""
    worker = Worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=CacheConfig(page_size=4, num_gpu_pages=8, num_host_pages=4),
        kv_storage=False,
    )
    for uuid in uuids:
        worker.add_request(Request(uuid, (1, 2, 3, 4, 5), max_new_tokens=4))
    worker.step()
    return worker.kv_target()


def test_compare_mode_sees_a_change_to_any_request_field_it_canonicalizes():
    """Compare mode canonicalizes only the requests whose post-states differ; the check that picks
    them must see every field the canonical form shows, or a bug there would go unreported."""
    target = running_target("a", "b")
    scope = list(target.state.requests)

    def entries(side) -> dict:
        requests, outputs = Keyed(), Keyed()
        add_requests(requests, outputs, side, scope)
        return {**requests, **{f"out:{u}": e for u, e in outputs.items()}}

    assert differing_requests(fork_target(target), target, [], set()) == []

    shown = set()
    changes = [
        (name, lambda fork, value=value, name=name: setattr(fork.state.edit("a"), name, value))
        for name, value in FIELD_CHANGES.items()
    ]
    changes.append(("pending append", lambda fork: fork.drop_pending_append("a")))
    changes.append(("released", lambda fork: fork.state.remove("a")))
    for name, change in changes:
        fork = fork_target(target)
        change(fork)
        assert differing_requests(fork, target, [], set()) == ["a"], name
        # written alike on both sides
        assert differing_requests(fork, target, ["b"], set()) == ["a"], name
        before, after = entries(target)["a"], entries(fork).get("a", {})
        shown |= {key for key in before if before[key] != after.get(key)}
        assert entries(fork)["b"] == entries(target)["b"]
    assert shown == set(entries(target)["a"]), f"never checked: {set(entries(target)['a']) - shown}"
    fork = fork_target(target)
    fork.state.edit("a").output_ids = [7]  # not a KV field: the forward owns it
    assert differing_requests(fork, target, [], set()) == []


def test_a_fork_never_writes_the_worker_state_it_was_taken_from():
    """Copy-on-write: the fork's writes go to its own copies, each recorded with the request it
    shadows."""
    target = running_target("a", "b")
    a, b = target.state.requests["a"], target.state.requests["b"]
    fields_before = (a.phase, a.gpu_page_ids, b.phase, b.gpu_page_ids)
    fork = fork_target(target)
    assert fork.state.requests is target.state.requests  # shared until the fork writes
    fork.state.edit("a").phase = Phase.SWAPPED
    assert fork.state.requests is not target.state.requests
    fork.state.edit("a").gpu_page_ids = ()
    fork.state.remove("b")
    assert (a.phase, a.gpu_page_ids, b.phase, b.gpu_page_ids) == fields_before
    assert list(target.state.requests) == ["a", "b"] and list(fork.state.requests) == ["a"]
    # each written request -> the shared one it replaced
    assert fork.state.written == {"a": a, "b": b}
    assert fork.state.requests["a"] is not a and fork.state.requests["a"].phase is Phase.SWAPPED


def test_a_request_only_the_worker_wrote_is_compared_against_the_state_the_fork_saw():
    target = running_target("a")
    fork = fork_target(target)  # the shadow wrote nothing
    on = recorded(target)
    start(on)
    on.state.edit("a").phase = Phase.SWAPPED
    assert fork.state.requests["a"].phase is Phase.SWAPPED  # shared until detached
    detach_fork(fork, on.state.written, set())
    assert fork.state.requests["a"].phase is Phase.RUNNING
    assert differing_requests(fork, on, on.state.written, set()) == ["a"]


def test_a_pending_append_dropped_on_one_side_only_is_compared_and_the_fork_drops_none():
    target = running_target("a", "b")
    fork = fork_target(target)
    fork.drop_pending_append("b")
    assert list(target.pending_appends) == ["a", "b"] and not fork.has_pending_append("b")
    on = recorded(target)
    start(on)
    on.drop_pending_append("a")
    detach_fork(fork, {}, on.dropped)
    assert fork.has_pending_append("a") and not target.has_pending_append("a")
    assert differing_requests(fork, on, [], on.dropped) == ["a", "b"]


def test_the_worker_records_each_request_before_its_first_write_while_compared():
    worker_state = WorkerState(requests={"a": RequestState(Request("a", (1,), 1), 0)})
    state = RecordingState(worker_state)
    req = state.edit("a")
    assert req is state.requests["a"] and state.written is None  # not compared: nothing recorded
    state.written = {}
    state.edit("a").phase = Phase.RUNNING
    state.edit("a").num_cached_tokens = 1
    assert worker_state.requests["a"] is req and req.phase is Phase.RUNNING
    assert state.written["a"].phase is Phase.WAITING and state.written["a"].num_cached_tokens == 0
    assert state.remove("a") is req and worker_state.requests == {}


def test_the_replay_request_logged_for_a_plan_shadow_is_the_one_the_worker_state_gives(
    tiny, tmp_path, monkeypatch
):
    """With legacy authoritative, the logged op request comes from the plan shadow's run on the
    fork; it must equal the request the plan path builds from the worker itself (LOADING count
    included)."""
    bug_named("migrate-request-swapped-this-step").inject(monkeypatch)
    workload = stress_smoke(0)
    gate = KvGateConfig(path="legacy", compare="log", compare_log=str(tmp_path / "log.jsonl"))
    worker = gated_worker(
        tiny, cache_config=workload.cache, engine_config=workload.engine, kv_gate=gate
    )
    built = {}
    migrate = worker._kv.migrate

    def building_migrate():
        built[worker.state.step] = to_jsonable(
            plan_path.PlanKvPath(worker.kv_target()).migration_request()
        )
        return migrate()

    worker._kv.migrate = building_migrate
    run_workload(worker, workload)
    records = [
        r for r in read_log(tmp_path / "log.jsonl").records if isinstance(r, DivergenceRecord)
    ]
    assert records and {r.op for r in records} == {"migrate"}
    for record in records:
        assert record.replay["request"] == built[record.step], record.step


def test_a_logged_load_divergence_names_each_sides_handle_as_replay_does(
    tiny, tmp_path, monkeypatch
):
    """The fork's record of the requests before it wrote them holds the worker's objects, which the
    authoritative path then changes: the shadow's load must still be named against the state before
    the op."""
    from batchgen.triage.replay import replay_record

    bug = bug_named("retry-keeps-the-failed-loads-handle")
    bug.inject(monkeypatch)
    fail_loads(monkeypatch)
    run = run_compare(
        tiny, tmp_path / "log.jsonl", bug.workloads(), authoritative="legacy", mode="log"
    )
    record = run.records[0]
    assert (record.op, record.kind) == ("poll", "state")
    assert any(wildcard(path) == "requests[*].load" for path in record.field_paths)
    assert "'prior'" in str(record.diff) and "'issued'" in str(record.diff)
    assert replay_record(record).diff == record.diff
