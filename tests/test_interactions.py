"""Interactions: the classifier names each one on hand-built op inputs, the run history it reads
is kept from the compared ops alone, and the one no engine run reaches is compared on a state
built for it, its invariant checked on generated workloads."""

from __future__ import annotations

import random

import pytest

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig
from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.runner import RunStalled, run_workload
from batchgen.engine.worker import PendingAppend, Worker
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
    ReleasePlan,
    ReleaseRequest,
    SwappedColumns,
    Victim,
)
from batchgen.model.null_model import NullModel
from batchgen.shadow.coverage import CATALOG, DECISIONS
from batchgen.shadow.history import RunHistory
from batchgen.shadow.interactions import INTERACTIONS, interactions_of
from batchgen.shadow.wiring import gated_worker
from batchgen.state import Phase, Request, RequestState
from batchgen.validation.explore_space import random_params, workload_from

GEOMETRY = KvGeometry(
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    page_size=4,
    dtype_size=4,
    num_gpu_pages=12,
    num_host_pages=8,
    watermark=0.25,
    max_num_seqs=6,
    max_load_retries=3,
)  # fmt: skip  (W = 3 pages)
HOST, RECOMPUTE = Destination.HOST, Destination.RECOMPUTE
# a, b, c, d RUNNING, one page each (4 tokens: no demand), in arrival order
RUNNING = PageColumns(("a", "b", "c", "d"), (4, 4, 4, 4), ((0,), (1,), (2,), (3,)))


def snapshot(free_gpu: int, free_host: int, step: int = 5) -> KvSnapshot:
    return KvSnapshot(step, GEOMETRY, free_gpu, free_host)


def classify(op, request, plan, history=None, written=None, dropped=()):
    return interactions_of(op, request, plan, written or {}, set(dropped), history or RunHistory())


def test_interaction_ids_are_new_start_with_their_op_and_are_of_their_own_kind():
    decision_ids = {outcome.id for outcome in DECISIONS}
    assert all(i.kind == "interaction" and i.id.startswith(f"{i.op}.") for i in INTERACTIONS)
    assert not decision_ids & {i.id for i in INTERACTIONS}
    assert len({o.id for o in CATALOG}) == len(CATALOG) == len(DECISIONS) + len(INTERACTIONS)


# ---- sequences inside one op ---------------------------------------------------------------
def evict(destinations: str, free_host: int, history=None) -> list[str]:
    """An eviction of the youngest ``len(destinations)`` of RUNNING, ``h`` to host, ``r`` to
    recompute, in that order."""
    victims, host_id = [], 0
    for k, kind in enumerate(destinations):
        uuid, page = RUNNING.uuids[-1 - k], RUNNING.gpu_page_ids[-1 - k]
        if kind == "h":
            victims.append(Victim(uuid, HOST, page, (host_id,)))
            host_id += 1
        else:
            victims.append(Victim(uuid, RECOMPUTE, page, ()))
    request = EvictionRequest(snapshot(0, free_host), RUNNING, 0)
    return classify("evict", request, EvictionPlan(tuple(victims)), history)


@pytest.mark.parametrize(
    "destinations, free_host, expected",
    [
        ("h", 1, []),
        ("hr", 1, ["evict.seq.host_then_recompute"]),
        ("rh", 1, ["evict.seq.recompute_then_host"]),
        ("hh", 2, ["evict.seq.all_host_last_exact_fit"]),
        ("hh", 5, []),
        ("hhh", 3, ["evict.seq.all_host_last_exact_fit", "evict.seq.host_3plus"]),
        ("hhhr", 3, ["evict.seq.host_then_recompute", "evict.seq.host_3plus"]),
    ],
)
def test_an_evictions_victims_are_named_by_the_order_of_their_destinations(
    destinations, free_host, expected
):
    assert evict(destinations, free_host) == expected


TWO_RUNNING = PageColumns(RUNNING.uuids[:2], RUNNING.num_tokens[:2], RUNNING.gpu_page_ids[:2])
SWAPPED = SwappedColumns(("s1", "s2", "s3", "s4"), ((4,), (5,), (6,), (7,)), (1, 2, 5, 3))


@pytest.mark.parametrize(
    "loads, expected",
    [
        (("s1", "s2"), ["migrate.seq.loads_then_watermark"]),  # s3 skipped, s4 stopped
        (("s1", "s2", "s4"), []),  # all loaded
        (("s1",), []),  # one load only
    ],
)
def test_a_migration_of_several_loads_then_a_stop_is_named(loads, expected):
    request = MigrationRequest(snapshot(9, 0), SWAPPED, TWO_RUNNING, 0, 0)
    plan = MigrationPlan(tuple(LoadStart(uuid, (), ()) for uuid in loads))
    assert classify("migrate", request, plan) == expected


def test_a_migration_stopped_by_max_num_seqs_is_not_a_stop_at_the_watermark():
    request = MigrationRequest(snapshot(9, 0), SWAPPED, RUNNING, 0, 0)  # 4 running + 2 == 6
    plan = MigrationPlan((LoadStart("s1", (), ()), LoadStart("s2", (), ())))
    assert classify("migrate", request, plan) == []


def test_grants_after_a_request_that_did_not_fit_are_named_from_two_on():
    needing = PageColumns(("w", "a", "b"), (8, 5, 5), ((), (0,), (1,)))
    request = AllocRequest(snapshot(2, 0), needing, needing.uuids)
    not_fitting = (DoesNotFit("w", 2, 2),)
    two = AllocPlan((PageGrant("a", (3,)), PageGrant("b", (4,))), not_fitting)
    one = AllocPlan((PageGrant("a", (3,)),), (*not_fitting, DoesNotFit("b", 1, 0)))
    assert classify("alloc", request, two) == ["alloc.seq.grants_after_does_not_fit"]
    assert classify("alloc", request, one) == []


# ---- after a history -----------------------------------------------------------------------
def test_each_poll_action_is_named_by_the_retries_its_load_took_before():
    actions = (PollAction.COMPLETE, PollAction.RETRY, PollAction.RECOMPUTE, PollAction.FAIL)
    uuids = ("l1", "l2", "l3", "l4")
    request = PollRequest(snapshot(0, 0), uuids, (None, "e", "e", "e"), (0, 1, 2, 5))
    plan = PollPlan(uuids, actions, (None, None, None, "load failed: e"))
    assert classify("poll", request, plan) == [
        "poll.complete.after_retries_0", "poll.retry.after_retries_1",
        "poll.recompute.after_retries_2plus", "poll.fail.after_retries_2plus",
    ]  # fmt: skip


@pytest.mark.parametrize("action", list(PollAction))
@pytest.mark.parametrize("retries, suffix", [(0, "0"), (1, "1"), (2, "2plus"), (3, "2plus")])
def test_every_poll_action_has_an_id_for_no_one_and_two_or_more_retries(action, retries, suffix):
    error = None if action is PollAction.COMPLETE else "e"
    request = PollRequest(snapshot(0, 0), ("l",), (error,), (retries,))
    plan = PollPlan(("l",), (action,), (None,))
    expected = f"poll.{action.value}.after_retries_{suffix}"
    assert classify("poll", request, plan) == [expected]
    assert expected in {interaction.id for interaction in INTERACTIONS}


def poll(uuid: str, action: PollAction, step: int) -> tuple[PollRequest, PollPlan]:
    error = None if action is PollAction.COMPLETE else "e"
    request = PollRequest(snapshot(0, 0, step), (uuid,), (error,), (0,))
    return request, PollPlan((uuid,), (action,), (None,))


def test_a_victim_is_named_by_when_its_load_landed():
    history = RunHistory()
    history.record("poll", *poll("d", PollAction.COMPLETE, 4), {})
    history.record("poll", *poll("c", PollAction.COMPLETE, 5), {})
    assert evict("hh", 8, history) == [
        "evict.victim.loaded_last_step",
        "evict.victim.loaded_this_step",
    ]
    history.record("poll", *poll("d", PollAction.COMPLETE, 2), {})  # landed long ago
    assert evict("h", 8, history) == []


def test_a_load_of_a_request_recomputed_before_is_named():
    history = RunHistory()
    request = MigrationRequest(snapshot(9, 0), SWAPPED, RUNNING, 0, 0)
    plan = MigrationPlan((LoadStart("s1", (), ()),))
    assert classify("migrate", request, plan, history) == []
    history.record("poll", *poll("s1", PollAction.RECOMPUTE, 2), {})
    assert classify("migrate", request, plan, history) == ["migrate.load.recomputed_before"]


def before(uuid: str, *, gpu=(), loading=False) -> RequestState:
    handle = CompletedHandle() if loading else None
    return RequestState(Request(uuid, (1, 2), 4), 0, Phase.FINISHED, gpu_page_ids=gpu,
                        load_handle=handle)  # fmt: skip


def test_a_release_with_a_load_in_flight_and_a_pending_append_is_named():
    written = {"x": before("x", loading=True), "y": before("y", loading=True), "z": before("z")}
    request = ReleaseRequest(snapshot(0, 0), ("x", "y", "z"))
    plan = ReleasePlan(request.uuids, request.uuids)
    assert classify("release", request, plan, written=written, dropped={"x", "z"}) == [
        "release.inflight_load_and_pending_append"
    ]


def test_a_release_of_a_request_an_abort_landed_on_after_it_was_done_is_named_once():
    history, written = RunHistory(), {"x": before("x"), "y": before("y")}
    history.note_abort_of_done("x")
    request = ReleaseRequest(snapshot(0, 0), ("x", "y"))
    plan = ReleasePlan(request.uuids, request.uuids)
    assert classify("release", request, plan, history, written) == ["release.abort_after_done"]
    history.record("release", request, plan, written)
    assert history.aborted_done == set()


# ---- across the ops of one step ------------------------------------------------------------
def test_a_request_evicted_then_skipped_by_the_same_steps_migration_is_named():
    history = RunHistory()
    request = MigrationRequest(snapshot(9, 0), SWAPPED, RUNNING, 0, 0)  # s3 swapped at step 5
    assert classify("migrate", request, MigrationPlan(()), history) == []
    eviction = EvictionRequest(snapshot(0, 8, 5), RUNNING, 0)
    history.record("evict", eviction, EvictionPlan((Victim("s3", HOST, (2,), (6,)),)), {})
    assert classify("migrate", request, MigrationPlan(()), history) == [
        "migrate.skip.evicted_this_step"
    ]


def test_pages_a_release_freed_this_step_granted_to_another_request_are_named():
    history, written = RunHistory(), {"x": before("x", gpu=(7, 8))}
    release = ReleaseRequest(snapshot(0, 0, 5), ("x",))
    history.record("release", release, ReleasePlan(("x",), ("x",)), written)
    needing = PageColumns(("a", "b"), (5, 5), ((0,), (1,)))
    request = AllocRequest(snapshot(4, 0, 5), needing, needing.uuids)
    plan = AllocPlan((PageGrant("a", (3,)), PageGrant("b", (8,))), ())
    assert classify("alloc", request, plan, history) == ["alloc.grant.released_pages_this_step"]
    next_step = AllocRequest(snapshot(4, 0, 6), needing, needing.uuids)
    assert classify("alloc", next_step, plan, history) == []  # the record is the step's


def test_the_history_keeps_the_step_record_of_the_latest_step_only():
    history = RunHistory()
    eviction = EvictionRequest(snapshot(0, 8, 5), RUNNING, 0)
    plan = EvictionPlan((Victim("d", HOST, (3,), (0,)), Victim("c", RECOMPUTE, (2,), ())))
    history.record("evict", eviction, plan, {})
    assert (history.step.step, history.step.evicted_to_host, history.recomputed) == (
        5, {"d"}, {"c"},
    )  # fmt: skip
    history.record("poll", *poll("a", PollAction.COMPLETE, 6), {})
    assert (history.step.step, history.step.evicted_to_host) == (6, set())
    assert history.this_step(5).evicted_to_host == set()
    assert history.load_landed_steps == {"a": 6}


# ---- the interaction no engine run reaches -------------------------------------------------
def hanging_worker(tmp_path, path: str) -> Worker:
    """A worker whose loads never land (they time out after 8 steps), evicting to host soon."""
    cache = CacheConfig(page_size=4, num_gpu_pages=6, num_host_pages=16, watermark=0.0)
    engine = EngineConfig(max_num_seqs=4, load_timeout_steps=8)
    gate = KvGateConfig(path=path, compare="raise", compare_log=str(tmp_path / "log.jsonl"))
    faults = FaultInjector(FaultSpec.parse("seed=1,load_hang=1"))
    worker = gated_worker(NullModel(TINY_MODELS["tiny"]), cache_config=cache, engine_config=engine,
                    kv_gate=gate, faults=faults, kv_storage=False)  # fmt: skip
    for i in range(3):
        worker.add_request(Request(f"r{i}", (1, 2, 3), 12))
    return worker


@pytest.mark.parametrize("path", ["plan", "legacy"])
def test_a_release_with_a_load_in_flight_and_a_pending_append_is_compared_on_a_built_state(
    path, tmp_path
):
    worker = hanging_worker(tmp_path, path)
    for _ in range(40):
        worker.step()
        loading = [r for r in worker.state.requests.values() if r.phase is Phase.LOADING]
        if loading:
            break
    assert loading, "no load started in 40 steps"
    uuid = loading[0].uuid
    worker._pending_kv_append_tensors[uuid] = PendingAppend(loading[0].num_tokens - 1, None)
    worker.abort(uuid)
    worker.step()  # compare mode raise: a divergence fails the test
    assert uuid in worker.state.outputs
    coverage = worker.kv_compare.end_run().coverage
    assert "release.inflight_load_and_pending_append" in coverage


def test_no_request_holds_a_pending_append_and_a_load_on_generated_workloads(monkeypatch):
    """The invariant behind ``release.inflight_load_and_pending_append``, at the start of every
    step (before poll and release) of 30 generated workloads, faults included."""
    from batchgen.engine import worker as worker_module

    observe, both, num_steps = worker_module.observe_loads, [], 0
    rng = random.Random(11)
    for index in range(30):
        workload = workload_from(random_params(rng), name=f"w{index}", vocab_size=512)
        faults = FaultInjector(FaultSpec.parse(workload.faults)) if workload.faults else None
        worker = Worker(
            NullModel(TINY_MODELS["tiny"]), cache_config=workload.cache,
            engine_config=workload.engine, faults=faults, kv_storage=False,
        )  # fmt: skip

        def checked(state, timeout_steps, worker=worker):
            pending = worker._pending_kv_append_tensors
            both.extend(u for u in pending if state.requests[u].load_handle is not None)
            return observe(state, timeout_steps)

        monkeypatch.setattr(worker_module, "observe_loads", checked)
        try:
            run_workload(worker, workload, max_steps=5000)
        except RunStalled:  # a fault schedule that holds the pools: no finding
            pass
        num_steps += worker.state.step
    assert num_steps > 1000 and both == []
