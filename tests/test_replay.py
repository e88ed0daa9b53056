import pytest
from injected_bugs import prefix_bug

import batchgen.kv.manager as kv_manager
import batchgen.kv.plan_path as plan_path
from batchgen.config import TINY_MODELS
from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.runner import run_workload
from batchgen.engine.workloads import builtin_workload
from batchgen.kv.gate import KvGateConfig
from batchgen.kv.plan_path import PlanKvPath
from batchgen.kv.plans import (
    AllocPlan,
    Destination,
    EvictionPlan,
    LoadStart,
    MigrationPlan,
    PageGrant,
    PollAction,
    PollPlan,
    ReleasePlan,
    RequestKvView,
    Victim,
)
from batchgen.model.null_model import NullModel
from batchgen.shadow.wiring import gated_worker
from batchgen.state import Phase
from batchgen.triage.rebuild import ReplayError, rebuild_target
from batchgen.triage.rebuild_pools import PLACEHOLDER_OWNER
from batchgen.triage.replay import ReplayOutcome, replay_record
from compare import DivergenceRecord, read_log

Manager = kv_manager.KVCacheManager


def reversed_grants(plan):
    return AllocPlan(
        tuple(PageGrant(g.uuid, g.new_page_ids[::-1], g.shared_page_ids) for g in plan.grants),
        plan.not_fitting,
    )


def victims_recomputed(plan):
    return EvictionPlan(
        tuple(Victim(v.uuid, Destination.RECOMPUTE, v.gpu_page_ids, ()) for v in plan.victims)
    )


def reversed_loads(plan):
    return MigrationPlan(
        tuple(
            LoadStart(load.uuid, load.gpu_page_ids[::-1], load.host_page_ids) for load in plan.loads
        )
    )


def pending_appends_kept(plan):
    return ReleasePlan(plan.released, ())


def completed_loads_retried(plan):
    return PollPlan(plan.uuids, (PollAction.RETRY,) * len(plan.uuids), plan.reasons)


BUGS = {  # op -> (plan method, how the bug rewrites its plan)
    "alloc": ("plan_allocation", reversed_grants),
    "evict": ("plan_eviction", victims_recomputed),
    "migrate": ("plan_migration", reversed_loads),
    "release": ("plan_release", pending_appends_kept),
    "poll": ("plan_poll", completed_loads_retried),
}


def inject(monkeypatch, op):
    """Make one KVCacheManager method return a wrong plan (undone by monkeypatch.undo())."""
    name, rewrite = BUGS[op]
    correct = getattr(Manager, name)
    monkeypatch.setattr(Manager, name, lambda self, req: rewrite(correct(self, req)))


def divergences(tmp_path, *, path="legacy", faults=None, workload="smoke", demo_bug=None):
    """Run ``workload`` in compare mode log (with a fault schedule SPEC, and ``demo_bug`` planted in
    the shadow path); the divergence records it wrote."""
    trace = builtin_workload(workload)
    log = tmp_path / "kv.jsonl"
    gate = KvGateConfig(path=path, compare="log", compare_log=str(log), compare_demo_bug=demo_bug)
    worker = gated_worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=trace.cache,
        engine_config=trace.engine,
        kv_storage=False,
        kv_gate=gate,
        faults=FaultInjector(FaultSpec.parse(faults)) if faults else None,
    )
    run_workload(worker, trace, source=workload)
    return (
        [r for r in read_log(log).records if isinstance(r, DivergenceRecord)]
        if log.exists()
        else []
    )


@pytest.mark.parametrize("op", sorted(BUGS))
def test_a_logged_divergence_reproduces_from_its_record_alone(tmp_path, monkeypatch, op):
    inject(monkeypatch, op)
    records = divergences(tmp_path)
    assert records and {r.op for r in records} == {op}
    for record in records:
        outcome = replay_record(record)
        assert outcome.reproduced, (record.step, outcome)
        assert outcome.kind == record.kind
        assert outcome.field_paths == tuple(record.field_paths)


@pytest.mark.parametrize(
    "op, change",
    [
        (
            "evict",
            lambda request: request.update(
                snapshot={
                    **request["snapshot"],
                    "geometry": {**request["snapshot"]["geometry"], "page_size": 16.0},
                }
            ),
        ),
        (
            "evict",
            lambda request: (
                request["running"].update(
                    num_tokens=[10**400, *request["running"]["num_tokens"][1:]]
                ),
                request["snapshot"]["geometry"].update(page_size=16.0),
            ),
        ),
        ("evict", lambda request: request["running"].update(num_tokens="many")),
        (
            "migrate",
            lambda request: request["running"].update(
                gpu_page_ids=[None] * len(request["running"]["uuids"])
            ),
        ),
        ("migrate", lambda request: request.update(snapshot=None)),
        ("poll", lambda request: request.update(num_load_retries="garbage")),
        (
            "poll",
            lambda request: request.update(num_load_retries=[0] * (len(request["errors"]) + 1)),
        ),
    ],
)
def test_a_malformed_record_is_refused_by_validation_not_by_a_crash(
    tmp_path, monkeypatch, op, change
):
    inject(monkeypatch, op)
    record = next(r for r in divergences(tmp_path) if op != "poll" or r.replay["request"]["uuids"])
    old = record.model_copy(deep=True)
    change(old.replay["request"])
    with pytest.raises(
        ReplayError,
        match=(
            f"(op '{op}': the recorded request is not a valid |"
            f"{op} step .*: the rebuilt pre-state gives a different op request)"
        ),
    ):
        replay_record(old)


FAULTS = (
    "seed=3,load_fail=0.3,load_fail_late=0.2,load_hang=0.1,abort=0.15,host_shrink=0.2,"
    "gpu_refuse=0.1"
)


@pytest.mark.parametrize("op", ["migrate", "poll", "release"])
def test_divergences_under_failed_loads_aborts_and_held_pages_reproduce(tmp_path, monkeypatch, op):
    inject(monkeypatch, op)
    records = divergences(tmp_path, faults=FAULTS)
    assert records
    assert all(replay_record(record).reproduced for record in records)


def test_a_divergence_on_the_authoritative_plan_path_reproduces_with_the_same_page_ids(
    tmp_path, monkeypatch
):
    inject(monkeypatch, "alloc")
    records = divergences(tmp_path, path="plan")
    assert records and all(r.authoritative == "plan" for r in records)
    for record in records:
        outcome = replay_record(record)
        assert outcome.reproduced and outcome.diff == record.diff


def test_an_invalid_plan_reproduces_as_the_same_exception_kind(tmp_path, monkeypatch):
    inject(monkeypatch, "poll")
    record = divergences(tmp_path)[0]
    outcome = replay_record(record)
    assert record.kind == outcome.kind == "invalid_plan"
    assert outcome.reproduced and outcome.field_paths == ()
    assert len(outcome.exceptions) == 1 and outcome.exceptions[0].startswith(
        "plan raised PlanRejected: PollPlan"
    )


def test_a_record_whose_plan_path_raised_before_its_request_is_refused_pointing_to_minimize(
    tmp_path, monkeypatch
):
    def failing_request(self):
        raise RuntimeError("no request")

    monkeypatch.setattr(PlanKvPath, "migration_request", failing_request)
    record = divergences(tmp_path)[0]
    assert (record.op, record.kind, record.replay["pre_state"]) == ("migrate", "exception", None)
    with pytest.raises(
        ReplayError,
        match=r"migrate step \d+: the plan path raised before building its op request, "
        r"so the record holds no pre-state to replay \(plan raised RuntimeError: "
        r"no request\); `batchgen minimize` reruns its workload instead",
    ):
        replay_record(record)


def forgets_generated_tokens(monkeypatch):
    """A recompute eviction that sets the victim's token count back to its prompt's: a field KV ops
    only read."""
    apply = plan_path.apply_eviction_plan

    def buggy(target, plan):
        apply(target, plan)
        for victim in plan.victims:
            if victim.destination is Destination.RECOMPUTE:
                # written by the op already: the fork's own copy
                req = target.state.requests[victim.uuid]
                req.num_tokens = len(req.request.prompt_ids)

    monkeypatch.setattr(plan_path, "apply_eviction_plan", buggy)


def test_a_divergence_that_depends_on_how_many_tokens_are_prompt_reproduces(tmp_path, monkeypatch):
    forgets_generated_tokens(monkeypatch)
    # a shrunk host pool: recompute evictions
    records = divergences(tmp_path, faults="seed=1,host_shrink=0.5")
    assert records and {r.op for r in records} == {"evict"}
    assert all(path.endswith(".num_tokens") for r in records for path in r.field_paths)
    # JSON arrays
    views = [RequestKvView(*view) for view in records[0].replay["pre_state"]["requests"]]
    assert all(0 < view.num_prompt_tokens <= view.num_tokens for view in views)
    assert any(view.num_prompt_tokens < view.num_tokens for view in views)
    for record in records:
        outcome = replay_record(record)
        assert outcome.reproduced and outcome.field_paths == tuple(record.field_paths), (
            record.step,
            outcome,
        )


def test_a_view_splits_its_tokens_into_prompt_and_outputs_and_a_bad_split_is_refused():
    split = alloc_record(
        views=[[*VIEWS[0][:9], 4], VIEWS[1]],
        num_free_gpu=5,
        authoritative_ids=[7, 2],
        shadow_ids=[7, 9],
        batch=["a", "b"],
    )
    a = rebuild_target(split).state.requests["a"]
    assert (len(a.request.prompt_ids), len(a.output_ids), a.num_tokens) == (4, 5, 9)
    bad = alloc_record(
        views=[[*VIEWS[0][:9], 10], VIEWS[1]],
        num_free_gpu=5,
        authoritative_ids=[7, 2],
        shadow_ids=[7, 9],
        batch=["a", "b"],
    )
    with pytest.raises(
        ReplayError, match=r"request a: num_prompt_tokens 10 is not in \[1, num_tokens = 9\]"
    ):
        rebuild_target(bad)
    unsplit = alloc_record(
        views=[VIEWS[0][:9], VIEWS[1]],
        num_free_gpu=5,
        authoritative_ids=[7, 2],
        shadow_ids=[7, 9],
        batch=["a", "b"],
    )
    with pytest.raises(ReplayError, match=r"the recorded pre-state is not a valid KvPreState"):
        rebuild_target(unsplit)


@pytest.mark.parametrize("op", sorted(BUGS))
def test_replay_says_not_reproduced_once_the_bug_is_gone(tmp_path, monkeypatch, op):
    inject(monkeypatch, op)
    records = divergences(tmp_path)
    monkeypatch.undo()
    assert records and {r.op for r in records} == {op}
    for record in records:
        outcome = replay_record(record)
        assert not outcome.reproduced
        assert (outcome.kind, outcome.field_paths, outcome.exceptions) == (None, (), ())


def test_replay_is_a_pure_function_of_the_record(tmp_path, monkeypatch):
    inject(monkeypatch, "evict")
    record = divergences(tmp_path)[0]
    before = record.model_dump_json()
    assert replay_record(record) == replay_record(record)
    assert record.model_dump_json() == before


# ---- prefix caching: shared pages, digests, cache entries, holds outside the scope -------------
def plant_in_plan_path(monkeypatch, bug: str) -> str | None:
    """Plant ``bug`` in the plan path: ``reversed-grants`` (each grant's new pages reversed, its
    shared ones kept) and ``take_new`` (new pages handed out over the cache entries the plan shares)
    process-wide, the demo bug ``shared-pages-freed`` in the shadow only; returns the demo bug's
    name (None for the others)."""
    if bug == "reversed-grants":
        inject(monkeypatch, "alloc")
    elif bug == "take_new":
        prefix_bug("take_new").inject(monkeypatch)
    else:
        return bug
    return None


def without_the_bug(record: DivergenceRecord, monkeypatch) -> DivergenceRecord:
    """``record`` with its demo bug dropped, and the injected bugs undone."""
    monkeypatch.undo()
    replay = {key: value for key, value in record.replay.items() if key != "demo_bug"}
    return record.model_copy(update={"replay": replay})


@pytest.mark.parametrize(
    "bug, op, num_records, what_caching_adds",
    [
        # prefix hits: shared pages and pages held outside the batch
        ("reversed-grants", "alloc", 25, lambda request: any(request["cached_pages"])),
        # cache entries the load re-links, free in the queue with their digests
        ("take_new", "migrate", 4, lambda request: request["cache_entries"]),
        # the holders of each shared page
        ("shared-pages-freed", "evict", 10, lambda request: request["shared_page_holders"]),
    ],
)
def test_a_divergence_with_prefix_caching_reproduces_and_not_once_the_bug_is_gone(
    tmp_path, monkeypatch, bug, op, num_records, what_caching_adds
):
    demo_bug = plant_in_plan_path(monkeypatch, bug)
    records = divergences(tmp_path, workload="shared-prefix", demo_bug=demo_bug)
    assert len(records) == num_records and {r.op for r in records} == {op}
    assert all(r.replay["request"]["snapshot"]["geometry"]["prefix_caching"] for r in records)
    assert any(what_caching_adds(r.replay["request"]) for r in records)
    for record in records:
        outcome = replay_record(record)
        assert outcome.reproduced, (record.step, outcome)
        assert (outcome.kind, outcome.field_paths) == (record.kind, tuple(record.field_paths))
    for record in (without_the_bug(r, monkeypatch) for r in records):
        assert replay_record(record) == ReplayOutcome(False, None, (), {}, ())


# ---- the rebuilt pre-state, on a hand-written record --------------------------------------------
GEOMETRY = {
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "page_size": 4,
    "dtype_size": 4,
    "num_gpu_pages": 10,
    "num_host_pages": 4,
    "watermark": 0.0,
    "max_num_seqs": 8,
    "max_load_retries": 1,
}


def alloc_record(*, views, num_free_gpu, authoritative_ids, shadow_ids, batch):
    snapshot = {
        "step": 7,
        "geometry": GEOMETRY,
        "num_free_gpu_pages": num_free_gpu,
        "num_free_host_pages": 4,
    }
    by_uuid = {view[0]: view for view in views}
    needing = [
        by_uuid[u] for u in batch if by_uuid[u][3] > len(by_uuid[u][5]) * GEOMETRY["page_size"]
    ]
    columns = {
        "uuids": [v[0] for v in needing],
        "num_tokens": [v[3] for v in needing],
        "gpu_page_ids": [v[5] for v in needing],
    }
    pools = {
        side: {
            "gpu": [{"kind": "alloc", "uuid": batch[-1], "page_ids": ids}],
            "host": [],
            "num_free_gpu": num_free_gpu - len(ids),
            "num_free_host": 4,
        }
        for side, ids in (("authoritative", authoritative_ids), ("shadow", shadow_ids))
    }
    replay = {
        "op": "alloc",
        "request_type": "AllocRequest",
        "request": {"snapshot": snapshot, "needing": columns, "batch": batch},
        "pre_state": {"snapshot": snapshot, "requests": views},
        "pools": pools,
        "kv_path": "legacy",
        "shadow_path": "plan",
        "workload_source": "smoke",
        "scale": 1.0,
    }
    return DivergenceRecord(
        binding="kv",
        run_id="r",
        workload="smoke",
        seed=0,
        step=7,
        op="alloc",
        authoritative="legacy",
        shadow="plan",
        kind="state",
        field_paths=["requests[b].gpu_page_ids[0]"],
        diff={},
        exception=None,
        replay=replay,
        created_at=0.0,
    )


VIEWS = [
    ["a", "running", 0, 9, 8, [3, 4, 5], [], 0, None, 9],
    ["b", "waiting", 1, 6, 0, [], [], 0, None, 6],
]


def test_a_record_with_pool_events_in_another_form_is_refused_by_name():
    record = alloc_record(
        views=VIEWS, num_free_gpu=5, authoritative_ids=[7, 2], shadow_ids=[7, 9], batch=["a", "b"]
    )
    # events as lists, not records
    record.replay["pools"]["authoritative"]["gpu"] = [["alloc", "b", [7, 2]]]
    with pytest.raises(ReplayError, match="authoritative gpu pool events are not records"):
        rebuild_target(record)


def test_the_rebuilt_free_queue_hands_out_the_allocated_ids_first():
    record = alloc_record(
        views=VIEWS, num_free_gpu=5, authoritative_ids=[7, 2], shadow_ids=[7, 9], batch=["a", "b"]
    )
    target = rebuild_target(record)
    assert target.gpu_kv.peek_free_pages(5) == [7, 2, 9, 0, 1]
    assert target.gpu_kv.pages_of("a") == (3, 4, 5)
    assert target.gpu_kv.pages_of(PLACEHOLDER_OWNER) == (6, 8)
    target.gpu_kv.check_integrity()
    target.host_kv.check_integrity()
    assert target.host_kv.peek_free_pages(4) == [0, 1, 2, 3]


def test_the_legacy_sides_allocation_order_comes_first_when_it_is_the_shadow():
    record = alloc_record(
        views=VIEWS, num_free_gpu=5, authoritative_ids=[2, 7], shadow_ids=[7, 2], batch=["a", "b"]
    )
    plan_first = record.model_copy(
        update={"replay": {**record.replay, "kv_path": "plan", "shadow_path": "legacy"}}
    )
    assert rebuild_target(plan_first).gpu_kv.peek_free_pages(3) == [7, 2, 0]


def test_the_rebuilt_requests_match_the_views():
    target = rebuild_target(
        alloc_record(
            views=VIEWS,
            num_free_gpu=5,
            authoritative_ids=[7, 2],
            shadow_ids=[7, 9],
            batch=["a", "b"],
        )
    )
    a, b = target.state.requests["a"], target.state.requests["b"]
    assert (a.phase, a.num_tokens, a.num_cached_tokens, a.gpu_page_ids) == (
        Phase.RUNNING,
        9,
        8,
        (3, 4, 5),
    )
    assert (b.phase, b.num_tokens, b.arrival_index) == (Phase.WAITING, 6, 1)
    assert target.state.step == 7 and target.pending_appends == {}
    assert (target.cache_config.page_size, target.engine_config.max_num_seqs) == (4, 8)


def test_a_record_whose_pages_are_owned_twice_is_refused():
    views = [VIEWS[0], ["b", "running", 1, 6, 5, [5, 6], [], 0, None, 6]]
    record = alloc_record(
        views=views, num_free_gpu=5, authoritative_ids=[7], shadow_ids=[7], batch=["a", "b"]
    )
    with pytest.raises(ReplayError, match="inconsistent"):
        rebuild_target(record)


def test_a_record_with_more_free_pages_than_unowned_ones_is_refused():
    record = alloc_record(
        views=VIEWS, num_free_gpu=8, authoritative_ids=[7], shadow_ids=[7], batch=["a", "b"]
    )
    with pytest.raises(ReplayError, match="8 free pages recorded"):
        rebuild_target(record)


def test_a_record_of_an_unknown_op_is_refused():
    record = alloc_record(
        views=VIEWS, num_free_gpu=5, authoritative_ids=[7], shadow_ids=[7], batch=["a", "b"]
    )
    bad = record.model_copy(update={"replay": {**record.replay, "op": "defrag"}})
    with pytest.raises(ReplayError, match="unknown op 'defrag'"):
        replay_record(bad)


def test_a_record_the_rebuilt_state_cannot_match_is_refused():
    record = alloc_record(
        views=VIEWS, num_free_gpu=5, authoritative_ids=[7], shadow_ids=[7], batch=["a", "b"]
    )
    request = record.replay["request"]
    tampered = {**request, "needing": {**request["needing"], "num_tokens": [7]}}
    bad = record.model_copy(update={"replay": {**record.replay, "request": tampered}})
    with pytest.raises(ReplayError, match=r"needing\.num_tokens"):
        replay_record(bad)


def test_a_record_without_its_pre_state_is_refused_by_name():
    record = alloc_record(
        views=VIEWS, num_free_gpu=5, authoritative_ids=[7], shadow_ids=[7], batch=["a", "b"]
    )
    bad = record.model_copy(update={"replay": {**record.replay, "pre_state": None}})
    with pytest.raises(
        ReplayError, match="op 'alloc': the recorded pre-state is not a valid KvPreState"
    ):
        replay_record(bad)
