"""Decision coverage: the catalog names every branch of both KV paths, the classifier names what
each compared op decided, and the validation's runs reach every reachable outcome.

The outcomes the catalog marks unreachable are compared here on states built directly, and the
invariant that makes each unreachable is checked on many generated workloads.
"""

from __future__ import annotations

import ast
import io
import random
import re
import tokenize
from pathlib import Path

import pytest

from batchgen.config import TINY_MODELS
from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.runner import RunStalled, run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import builtin_workload
from batchgen.kv import legacy, manager
from batchgen.kv.backends import CompletedHandle
from batchgen.kv.gate import KvGateConfig
from batchgen.kv.plans import (
    AllocPlan,
    AllocRequest,
    Destination,
    DoesNotFit,
    EvictionPlan,
    EvictionRequest,
    KvGeometry,
    KvSnapshot,
    LoadStart,
    MigrationPlan,
    MigrationRequest,
    PageColumns,
    PageGrant,
    PollAction,
    PollPlan,
    PollRequest,
    ReleaseRequest,
    SwappedColumns,
    Victim,
)
from batchgen.model.null_model import NullModel
from batchgen.shadow.coverage import CATALOG, DECISIONS, OUTCOMES, REQUIRED, outcomes_of
from batchgen.shadow.interactions import NO_PENDING_WHILE_LOADING
from batchgen.shadow.wiring import gated_worker
from batchgen.state import Phase, Request, RequestState
from batchgen.validation.explore_space import random_params, workload_from
from batchgen.validation.validate import BACK_TO_BACK_WORKLOADS, CORPUS_DIR, corpus_workloads

MARK = "decision:"


def _ids(text: str) -> set[str]:
    """The outcome ids ``text`` names (``op.outcome``); the words around them explain."""
    return set(re.findall(r"\b(?:poll|release|evict|migrate|alloc)\.[a-z_.]*[a-z_]", text))


def _comment(line: str) -> str | None:
    """The text of a line that is only a comment, else None."""
    stripped = line.strip()
    return stripped.lstrip("#").strip() if stripped.startswith("#") else None


def branch_labels(source: str) -> dict[int, set[str]]:
    """Each ``if`` and ``while`` line -> the outcomes its ``# decision:`` comment names: on the
    line itself, or in the comment lines right above it."""
    lines = source.splitlines()
    labels = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.If, ast.While)):
            continue
        line, above = lines[node.lineno - 1], []
        while node.lineno - 2 - len(above) >= 0:
            text = _comment(lines[node.lineno - 2 - len(above)])
            if text is None:
                break
            above.insert(0, text)
        comment = (line.partition("#")[2] if "#" in line else "") + " " + " ".join(above)
        labels[node.lineno] = _ids(comment.partition(MARK)[2]) if MARK in comment else set()
    return labels


def unlabelled_branches(source: str) -> list[str]:
    return [f"line {line}" for line, ids in sorted(branch_labels(source).items()) if not ids]


def named_outcomes(source: str) -> set[str]:
    """Every outcome any ``# decision:`` comment of ``source`` names (continued on the comment
    lines that follow it)."""
    named, previous = set(), None  # the line the last decision comment reached
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        text, line = token.string.lstrip("#").strip(), token.start[0]
        if MARK in text:
            named |= _ids(text.partition(MARK)[2])
            previous = line
        elif previous == line - 1 and token.line.strip().startswith("#"):
            named |= _ids(text)
            previous = line
    return named


SOURCES = {module.__name__: Path(module.__file__).read_text() for module in (manager, legacy)}


@pytest.mark.parametrize("module", SOURCES)
def test_every_branch_of_both_kv_paths_names_the_outcomes_it_decides(module):
    assert unlabelled_branches(SOURCES[module]) == []


@pytest.mark.parametrize("module", SOURCES)
def test_both_paths_name_every_decision_outcome_of_the_catalog_and_no_other(module):
    """Interactions are where outcomes meet, not branches: no decision comment names them."""
    assert named_outcomes(SOURCES[module]) == {outcome.id for outcome in DECISIONS}


def test_a_branch_without_an_outcome_is_seen():
    source = (
        "def plan(free):\n"
        "    if free > 3:  # decision: alloc.new_page\n"
        "        return 1\n"
        "    # decision: alloc.exact_fit,\n"
        "    # alloc.admit\n"
        "    while free:\n"
        "        free -= 1\n"
        "    if free < 0:\n"
        "        return 2\n"
    )
    assert unlabelled_branches(source) == ["line 8"]
    assert named_outcomes(source) == {"alloc.new_page", "alloc.exact_fit", "alloc.admit"}


def test_every_outcome_id_starts_with_its_op_and_appears_once():
    assert len(OUTCOMES) == len(CATALOG)
    assert all(o.id.startswith(f"{o.op}.") for o in CATALOG)
    assert {o.op for o in CATALOG} == {"poll", "release", "evict", "migrate", "alloc"}


# ---- the classifier ------------------------------------------------------------------------
GEOMETRY = KvGeometry(
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    page_size=4,
    dtype_size=4,
    num_gpu_pages=12,
    num_host_pages=8,
    watermark=0.25,
    max_num_seqs=4,
    max_load_retries=2,
)  # fmt: skip  (watermark W = 3 pages)
# a: 9 tokens on 2 pages, b: 9 tokens on 2 pages, c: 5 tokens on 1 page: decode demand 3
RUNNING = PageColumns(("a", "b", "c"), (9, 9, 5), ((0, 1), (2, 3), (4,)))


def snapshot(free_gpu: int, free_host: int, step: int = 5) -> KvSnapshot:
    return KvSnapshot(step, GEOMETRY, free_gpu, free_host)


def victim(uuid: str, destination: Destination, gpu=(), host=()) -> Victim:
    return Victim(uuid, destination, gpu, host)


HOST, RECOMPUTE = Destination.HOST, Destination.RECOMPUTE


@pytest.mark.parametrize(
    "free_gpu, free_host, victims, expected",
    [
        (6, 1, (), ["evict.none.at_watermark"]),  # 6 - 3 == 3
        (7, 1, (), ["evict.none.above_watermark"]),
        # c's 2 pages of demand and page leave: 4 - 3 + 2 == 3; the host had exactly its page
        (4, 1, (victim("c", HOST, (4,), (7,)),),
         ["evict.to_host.exact_fit", "evict.stop.at_watermark"]),
        (
            2, 1, (victim("c", HOST, (4,), (7,)), victim("b", RECOMPUTE, (2, 3))),
            ["evict.to_host.exact_fit", "evict.to_recompute.host_full", "evict.multiple_victims",
             "evict.stop.above_watermark"],
        ),
        (
            0, 5,
            (victim("c", HOST, (4,), (1,)), victim("b", HOST, (2, 3), (2, 3)),
             victim("a", RECOMPUTE, (0, 1))),
            ["evict.to_host", "evict.to_host", "evict.to_recompute.host_full",
             "evict.multiple_victims", "evict.all_running"],
        ),
    ],
)  # fmt: skip
def test_an_eviction_is_classified_by_its_victims_and_where_it_left_the_watermark(
    free_gpu, free_host, victims, expected
):
    request = EvictionRequest(snapshot(free_gpu, free_host), RUNNING, 3)
    assert outcomes_of("evict", request, EvictionPlan(victims), {}, set()) == expected


def test_an_eviction_with_nothing_running_is_its_own_outcome():
    request = EvictionRequest(snapshot(0, 0), PageColumns((), (), ()), 0)
    assert outcomes_of("evict", request, EvictionPlan(()), {}, set()) == ["evict.none.no_running"]


# s1 (2 pages, swapped at step 4), s2 (swapped this step), s3 (3 pages); max_num_seqs is 4
TWO_RUNNING = PageColumns(RUNNING.uuids[:2], RUNNING.num_tokens[:2], RUNNING.gpu_page_ids[:2])
SWAPPED = SwappedColumns(("s1", "s2", "s3"), ((0, 1), (2,), (3, 4, 5)), (4, 5, 3))


@pytest.mark.parametrize(
    "free_gpu, running, loads, expected",
    [
        # 8 - 3 (demand) - 2 (s1) == 3 == W: s1 fits exactly; s3 does not
        (8, TWO_RUNNING, ("s1",), ["migrate.load.exact_fit", "migrate.skip.swapped_this_step",
                               "migrate.stop.watermark"]),
        (20, TWO_RUNNING, ("s1", "s3"), ["migrate.load", "migrate.skip.swapped_this_step",
                                     "migrate.load", "migrate.all_loaded"]),
        # 3 running + 1 loading == max_num_seqs 4: the first one not skipped stops it
        (20, RUNNING, (), ["migrate.stop.max_num_seqs"]),
    ],
)  # fmt: skip
def test_a_migration_is_classified_by_what_each_swapped_request_met(
    free_gpu, running, loads, expected
):
    num_loading = 0 if loads else 1
    request = MigrationRequest(snapshot(free_gpu, 0), SWAPPED, running, 3, num_loading)
    plan = MigrationPlan(tuple(LoadStart(uuid, (), ()) for uuid in loads))
    assert outcomes_of("migrate", request, plan, {}, set()) == expected


def test_a_migration_with_nothing_swapped_is_its_own_outcome():
    request = MigrationRequest(snapshot(8, 0), SwappedColumns((), (), ()), RUNNING, 3, 0)
    assert outcomes_of("migrate", request, MigrationPlan(()), {}, set()) == [
        "migrate.none.nothing_swapped"
    ]


# a: RUNNING, 5 tokens on 1 page (needs 1); w: WAITING, 8 tokens (needs 2); v: RUNNING, 9 on 2 (1)
NEEDING = PageColumns(("w", "a", "v"), (8, 5, 9), ((), (0,), (1, 2)))


@pytest.mark.parametrize(
    "free_gpu, grants, expected",
    [
        (5, {"w": 2, "a": 1, "v": 1}, ["alloc.admit", "alloc.new_page", "alloc.new_page"]),
        (4, {"w": 2, "a": 1, "v": 1}, ["alloc.admit", "alloc.new_page", "alloc.new_page",
                                       "alloc.exact_fit"]),
        (1, {"a": 1}, ["alloc.does_not_fit", "alloc.new_page", "alloc.exact_fit",
                       "alloc.fits_after_does_not_fit", "alloc.does_not_fit"]),
    ],
)  # fmt: skip
def test_an_allocation_is_classified_per_request_in_batch_order(free_gpu, grants, expected):
    request = AllocRequest(snapshot(free_gpu, 0), NEEDING, ("w", "a", "v"))
    plan = AllocPlan(
        tuple(PageGrant(uuid, tuple(range(n))) for uuid, n in grants.items()),
        tuple(DoesNotFit(u, 1, 0) for u in NEEDING.uuids if u not in grants),
    )
    assert outcomes_of("alloc", request, plan, {}, set()) == expected


def test_an_allocation_of_nothing_needed_is_its_own_outcome():
    request = AllocRequest(snapshot(0, 0), PageColumns((), (), ()), ("a",))
    assert outcomes_of("alloc", request, AllocPlan((), ()), {}, set()) == ["alloc.none_needed"]


def test_a_poll_is_classified_per_load_with_its_last_retry_and_timeouts_apart():
    errors = (None, "OSError: x", "LoadTimeout: no completion after 4 steps", "OSError: y")
    request = PollRequest(snapshot(0, 0), ("l1", "l2", "l3", "l4"), errors, (0, 0, 1, 2))
    actions = (PollAction.COMPLETE, PollAction.RETRY, PollAction.RETRY, PollAction.FAIL)
    plan = PollPlan(request.uuids, actions, (None, None, None, "load failed: OSError: y"))
    assert outcomes_of("poll", request, plan, {}, set()) == [
        "poll.complete", "poll.retry", "poll.timeout", "poll.retry.last", "poll.fail",
    ]  # fmt: skip


def prior(uuid: str, phase: Phase, *, gpu=(), host=(), loading=False) -> RequestState:
    handle = CompletedHandle() if loading else None
    return RequestState(
        Request(uuid, (1, 2), 4), 0, phase, gpu_page_ids=gpu, host_page_ids=host, load_handle=handle
    )


def test_a_release_is_classified_by_what_each_request_still_held():
    written = {
        "done": prior("done", Phase.FINISHED, gpu=(0,)),
        "failed": prior("failed", Phase.FAILED),
        "aborted": prior("aborted", Phase.FINISHED, gpu=(1,), host=(2,), loading=True),
    }
    request = ReleaseRequest(snapshot(0, 0), tuple(written))
    assert outcomes_of("release", request, None, written, {"done"}) == [
        "release.finished", "release.with_pending_append",
        "release.failed", "release.without_pages",
        "release.finished", "release.with_host_pages", "release.with_inflight_load",
    ]  # fmt: skip


# ---- the validation reaches every reachable outcome ----------------------------------------
def compare_worker(workload, tmp_path, *, path="plan", gate_log="log.jsonl") -> Worker:
    gate = KvGateConfig(path=path, compare="raise", compare_log=str(tmp_path / gate_log))
    faults = FaultInjector(FaultSpec.parse(workload.faults)) if workload.faults else None
    return gated_worker(
        NullModel(TINY_MODELS["tiny"]), cache_config=workload.cache,
        engine_config=workload.engine, kv_gate=gate, faults=faults, kv_storage=False,
    )  # fmt: skip


def test_the_l2_traces_and_the_corpus_together_reach_every_required_outcome(tmp_path):
    """What ``batchgen validate`` runs (on the weightless model: the decisions depend on token
    counts, not ids), in one direction; none reaches an outcome the catalog rules out."""
    reached = set()
    l2 = [builtin_workload(name) for name in BACK_TO_BACK_WORKLOADS]
    shared = compare_worker(l2[-1], tmp_path)
    for workload in l2:
        reached |= run_workload(shared, workload).compare_summary.coverage.keys()
    l2_reached = set(reached)
    corpus = corpus_workloads(CORPUS_DIR)
    assert 0 < len(corpus) <= 30  # the bound on the corpus
    for workload in corpus:
        worker = compare_worker(workload, tmp_path)
        reached |= run_workload(worker, workload).compare_summary.coverage.keys()
    assert set(REQUIRED) <= reached, sorted(set(REQUIRED) - reached)
    assert reached <= set(REQUIRED)
    assert set(REQUIRED) - l2_reached  # the corpus is there for what the L2 traces miss


# ---- what the catalog marks unreachable, and why -------------------------------------------
def admits_everything(state, num_free_gpu_pages, cache, engine, gpu_kv=None) -> list[str]:
    """A scheduler that admits every WAITING request, with requests SWAPPED, past max_num_seqs
    and past the free pages: the states the real scheduler never builds."""
    waiting = sorted(state.in_phase(Phase.WAITING), key=lambda r: r.arrival_index)
    return [r.uuid for r in (*state.in_phase(Phase.RUNNING), *waiting)]


@pytest.mark.parametrize("path", ["plan", "legacy"])
def test_the_unreachable_outcomes_are_compared_on_states_built_for_them(
    path, tmp_path, monkeypatch
):
    monkeypatch.setattr("batchgen.engine.worker.schedule", admits_everything)
    workload = builtin_workload("smoke", scale=2).with_cache(num_host_pages=12)
    workload = workload.model_copy(
        update={"engine": workload.engine.model_copy(update={"max_num_seqs": 3})}
    )
    worker = compare_worker(workload, tmp_path, path=path)
    run_workload(worker, workload)  # compare mode raise: a divergence fails the test
    scheduler_made = {
        outcome.id
        for outcome in CATALOG
        if outcome.unreachable and outcome.unreachable != NO_PENDING_WHILE_LOADING
    }  # the other one: tests/test_interactions.py builds its state
    assert scheduler_made <= worker.kv_compare.end_run().coverage.keys()


def run_generated_workloads(num_workloads: int) -> int:
    """Generated workloads (those ``batchgen explore`` draws) on the plan path, faults included;
    the steps they ran."""
    rng, num_steps = random.Random(7), 0
    for index in range(num_workloads):
        workload = workload_from(random_params(rng), name=f"w{index}", vocab_size=512)
        faults = FaultInjector(FaultSpec.parse(workload.faults)) if workload.faults else None
        worker = Worker(
            NullModel(TINY_MODELS["tiny"]), cache_config=workload.cache,
            engine_config=workload.engine, faults=faults, kv_storage=False,
        )  # fmt: skip
        try:
            run_workload(worker, workload, max_steps=5000)
        except RunStalled:  # a fault schedule that holds the pools: no finding
            pass
        num_steps += worker.state.step
    return num_steps


def test_the_invariants_behind_the_unreachable_outcomes_hold_on_generated_workloads(monkeypatch):
    """The scheduler admits nothing while a request is SWAPPED (so RUNNING + LOADING + SWAPPED
    stays within max_num_seqs), and every request it schedules fits (so allocation never leaves
    one out): checked after every step of 40 generated workloads, faults included."""
    from batchgen.engine import worker as worker_module

    schedule, left_out, crowded = worker_module.schedule, [], []

    def checked_schedule(state, num_free_gpu_pages, cache, engine, gpu_kv=None):
        active = state.in_phase(Phase.RUNNING, Phase.LOADING, Phase.SWAPPED)
        if len(active) > engine.max_num_seqs:
            crowded.append(len(active))
        batch = schedule(state, num_free_gpu_pages, cache, engine, gpu_kv)
        needed = sum(
            max(0, -(-r.num_tokens // cache.page_size) - len(r.gpu_page_ids))
            for r in map(state.requests.__getitem__, batch)
        )
        if needed > num_free_gpu_pages:
            left_out.append(needed - num_free_gpu_pages)
        return batch

    monkeypatch.setattr(worker_module, "schedule", checked_schedule)
    num_steps = run_generated_workloads(40)
    assert num_steps > 1000 and crowded == [] and left_out == []
