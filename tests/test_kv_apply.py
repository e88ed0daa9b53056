"""Plan application: every invalid plan of the one catalog (``batchgen.validation.plan_refusals``,
validate's self-checks too) is rejected naming its field with its exact message, the target
untouched; valid plans give exactly the expected state.

The target (``make_target``): ``batchgen.validation.plan_fixture`` draws it (every phase, a load
in flight, pending appends), page_size 4, GPU pool 12 pages, host pool 8, step 7.
"""

from __future__ import annotations

import dataclasses

import pytest
from kv_dumps import kv_dump

from batchgen.kv.appliers import (
    apply_alloc_plan,
    apply_eviction_plan,
    apply_migration_plan,
    apply_poll_plan,
    apply_release_plan,
)
from batchgen.kv.backends import CopyOp
from batchgen.kv.gate import build_kv_path
from batchgen.kv.plan_checks import PlanRejected
from batchgen.kv.plan_path import PlanKvPath
from batchgen.kv.plans import (
    AllocPlan,
    AllocRequest,
    Destination,
    DoesNotFit,
    EvictionPlan,
    EvictionRequest,
    KvSnapshot,
    LoadStart,
    MigrationPlan,
    MigrationRequest,
    PageColumns,
    PageGrant,
    PollAction,
    PollRequest,
    ReleasePlan,
    ReleaseRequest,
    RequestKvView,
    SwappedColumns,
    Victim,
)
from batchgen.shadow.fork import view_of
from batchgen.state import (
    Phase,
    RequestOutput,
)
from batchgen.validation.plan_fixture import (
    D0,
    ENGINE,
    LOGPROBS,
    alloc,
    make_target,
    poll_plan,
    with_cached_prefix,
)
from batchgen.validation.plan_refusal import PlanRefusal
from batchgen.validation.plan_refusals import PLAN_REFUSALS


class FailingHandle:
    """A load whose copy failed: ``wait`` raises."""

    def __init__(self):
        self.num_waits = 0

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        self.num_waits += 1
        raise OSError("injected copy failure")


def free_queue(pool) -> list[int]:
    return list(pool.pages.free_page_ids())


def test_the_fixture_target_is_consistent():
    target = make_target()
    target.gpu_kv.check_integrity(target.state.requests)
    target.host_kv.check_integrity(target.state.requests)
    assert free_queue(target.gpu_kv) == [8, 9, 10, 11] and free_queue(target.host_kv) == [5, 6, 7]


def test_op_requests_hold_the_columns_of_the_requests_each_op_reads():
    target = make_target()
    path = PlanKvPath(target)
    snapshot = KvSnapshot(7, path.geometry, num_free_gpu_pages=4, num_free_host_pages=3)
    running = PageColumns(("run0", "run1"), (7, 9), ((0, 1), (2, 3)))
    # run1's 9 tokens need a third page of 4; run0's 7 fit its 2: a decode demand of 1
    assert path.eviction_request() == EvictionRequest(snapshot, running, decode_demand=1)
    assert path.migration_request() == MigrationRequest(
        snapshot,
        SwappedColumns(("swap2", "swap6"), ((0, 1), (4,)), (6, 6)),
        running,
        decode_demand=1,
        num_loading=1,
    )
    # run0's 7 tokens fit its 2 pages of 4: it needs nothing and is left out of the columns
    assert path.alloc_request(["run1", "wait4", "run0"]) == AllocRequest(
        snapshot, PageColumns(("run1", "wait4"), (9, 5), ((2, 3), ())), ("run1", "wait4", "run0")
    )
    assert path.poll_request({"load3": "OSError: x"}) == PollRequest(
        snapshot, ("load3",), ("OSError: x",), (0,)
    )
    assert path.poll_request({"load3": None}) == PollRequest(snapshot, ("load3",), (None,), (0,))
    assert path.release_request(["done5"]) == ReleaseRequest(snapshot, ("done5",))


def test_migration_reads_no_running_request_while_nothing_is_swapped():
    target = make_target()
    for uuid in ("swap2", "swap6"):
        target.state.requests[uuid].phase = Phase.WAITING
    request = PlanKvPath(target).migration_request()
    assert request.swapped == SwappedColumns((), (), ()) and request.running == PageColumns(
        (), (), ()
    )
    assert (request.decode_demand, request.num_loading) == (0, 0)


def test_a_request_view_holds_what_a_kv_op_may_read_of_it():
    requests = make_target().state.requests
    assert view_of(requests["run1"]) == RequestKvView(
        "run1", "running", 1, 9, 8, (2, 3), (), 0, None, num_prompt_tokens=8
    )
    assert view_of(requests["load3"]) == RequestKvView(
        "load3", "loading", 3, 5, 4, (4, 5), (2, 3), 0, 5, num_prompt_tokens=4
    )


# ---- invalid plans: the one catalog (batchgen.validation.plan_refusals) -------------------------
@pytest.mark.parametrize("check", PLAN_REFUSALS, ids=[check.id for check in PLAN_REFUSALS])
def test_an_invalid_plan_is_refused_naming_its_field_with_its_message_and_changes_nothing(
    check: PlanRefusal,
):
    target = make_target()
    if check.setup is not None:
        check.setup(target)
    before = kv_dump(target, target.host_kv.copies)
    with pytest.raises(PlanRejected) as raised:
        check.apply(target)
    assert (raised.value.field, str(raised.value)) == (
        check.field,
        f"{check.field}: {check.message}",
    )
    assert kv_dump(target, target.host_kv.copies) == before


def test_plan_rejected_is_a_value_error_whose_message_says_why():
    target = make_target()
    with pytest.raises(
        ValueError,
        match=r"^EvictionPlan\.victims\[0\]\.host_page_ids: page 0 is not free in the host pool$",
    ):
        apply_eviction_plan(target, EvictionPlan((Victim("run1", HOST, (2, 3), (0, 5)),)))


def test_an_alloc_request_built_before_the_pool_changed_is_rejected_as_stale():
    target = make_target()
    path = PlanKvPath(target)
    request = path.alloc_request(["run1", "wait4"])
    plan = path.manager.plan_allocation(request)
    target.gpu_kv.take_pages("intruder", [11])
    before = kv_dump(target, target.host_kv.copies)
    with pytest.raises(
        PlanRejected,
        match=r"^AllocRequest\.snapshot: stale: step 7 with 4 free GPU pages, the target "
        r"is at step 7 with 3$",
    ):
        apply_alloc_plan(target, plan, request)
    assert kv_dump(target, target.host_kv.copies) == before


def test_a_waiting_request_holding_pages_enough_is_admitted_with_an_empty_grant():
    target = make_target()
    # 5 tokens, 2 pages of 4: nothing more needed
    target.state.requests["wait4"].gpu_page_ids = (8, 9)
    assert PlanKvPath(target).allocate(["wait4"]) == ["wait4"]
    assert (target.state.requests["wait4"].phase, target.state.requests["wait4"].gpu_page_ids) == (
        Phase.RUNNING,
        (8, 9),
    )


def test_a_plan_built_before_the_pool_changed_is_rejected_not_half_applied():
    target = make_target()
    path = PlanKvPath(target)
    plan = path.manager.plan_allocation(path.alloc_request(["run1", "wait4"]))
    assert plan == AllocPlan((PageGrant("run1", (8,)), PageGrant("wait4", (9, 10))), ())
    target.gpu_kv.take_pages("intruder", [10])  # page 10 was taken after the snapshot
    before = kv_dump(target, target.host_kv.copies)
    with pytest.raises(
        PlanRejected, match=r"^AllocPlan\.grants\[1\]\.new_page_ids: page 10 is not free"
    ):
        apply_alloc_plan(target, plan, path.alloc_request(["run1", "wait4"]))
    assert kv_dump(target, target.host_kv.copies) == before


# ---- valid plans ---------------------------------------------------------------------------------
COMPLETE, RETRY, RECOMPUTE, FAIL = (
    PollAction.COMPLETE,
    PollAction.RETRY,
    PollAction.RECOMPUTE,
    PollAction.FAIL,
)
HOST, DROP = Destination.HOST, Destination.RECOMPUTE


def test_poll_complete_makes_the_request_running_and_frees_its_host_pages():
    target = make_target()
    apply_poll_plan(target, poll_plan(("load3", COMPLETE)), {"load3": None})
    req = target.state.requests["load3"]
    assert (
        req.phase,
        req.gpu_page_ids,
        req.host_page_ids,
        req.load_handle,
        req.load_started_step,
    ) == (Phase.RUNNING, (4, 5), (), None, None)
    assert free_queue(target.host_kv) == [5, 6, 7, 2, 3]
    assert free_queue(target.gpu_kv) == [8, 9, 10, 11]
    assert dataclasses.asdict(target.state.stats) == dataclasses.asdict(type(target.state.stats)())


def test_poll_retry_restarts_the_load_into_the_same_pages():
    target = make_target()
    apply_poll_plan(target, poll_plan(("load3", RETRY)), {"load3": "OSError: x"})
    req = target.state.requests["load3"]
    assert (
        req.phase,
        req.gpu_page_ids,
        req.host_page_ids,
        req.num_load_retries,
        req.load_started_step,
    ) == (Phase.LOADING, (4, 5), (2, 3), 1, 7)
    assert req.load_handle is not None
    assert target.host_kv.copies == [CopyOp("load", "load3", (2, 3), (4, 5))]
    assert (target.state.stats.load_failures, target.state.stats.loads) == (1, 1)


def test_poll_recompute_drops_both_tiers_and_sends_the_request_back_to_waiting():
    target = make_target()
    target.state.requests["load3"].num_load_retries = 1
    apply_poll_plan(target, poll_plan(("load3", RECOMPUTE)), {"load3": "OSError: x"})
    req = target.state.requests["load3"]
    assert (
        req.phase,
        req.gpu_page_ids,
        req.host_page_ids,
        req.num_cached_tokens,
        req.num_load_retries,
    ) == (Phase.WAITING, (), (), 0, 0)
    assert free_queue(target.gpu_kv) == [8, 9, 10, 11, 4, 5]
    assert free_queue(target.host_kv) == [5, 6, 7, 2, 3]
    assert (target.state.stats.load_failures, target.state.stats.recompute_preemptions) == (1, 1)


def test_poll_fail_marks_the_request_failed_with_the_plans_reason():
    target = make_target()
    target.state.requests["load3"].num_load_retries = 1
    apply_poll_plan(
        target, poll_plan(("load3", FAIL, "load failed: OSError: x")), {"load3": "OSError: x"}
    )
    req = target.state.requests["load3"]
    assert (req.phase, req.finish_reason, req.gpu_page_ids, req.host_page_ids) == (
        Phase.FAILED,
        "load failed: OSError: x",
        (),
        (),
    )
    assert (target.state.stats.load_failures, target.state.stats.recompute_preemptions) == (1, 0)


class TimedOutCopy:
    """A stall-prone load whose copy is still running when the worker times it out: ``wait`` records
    the GPU pages its request holds at that moment (its copy must land before they are freed)."""

    may_stall = True

    def __init__(self, gpu_kv):
        self.gpu_kv, self.pages_held_at_wait = gpu_kv, []

    def done(self) -> bool:
        return False

    def wait(self) -> None:
        self.pages_held_at_wait.append(self.gpu_kv.pages_of("load3"))
        raise RuntimeError("the copy failed late")


@pytest.mark.parametrize("path", ["legacy", "plan"])
@pytest.mark.parametrize("load_failure", ["recompute", "fail"])
def test_poll_waits_for_a_timed_out_loads_copy_before_freeing_its_pages(path, load_failure):
    target = make_target()
    target.engine_config = ENGINE.model_copy(update={"load_failure": load_failure})
    req = target.state.requests["load3"]
    req.num_load_retries = 1  # no retry left
    handle = req.load_handle = TimedOutCopy(target.gpu_kv)
    build_kv_path(path, target).poll({"load3": "LoadTimeout: no completion after 4 steps"})
    # waited once, while the request still held its pages
    assert handle.pages_held_at_wait == [(4, 5)]
    assert (req.phase, req.load_handle, req.gpu_page_ids) == (
        Phase.WAITING if load_failure == "recompute" else Phase.FAILED,
        None,
        (),
    )
    assert free_queue(target.gpu_kv) == [8, 9, 10, 11, 4, 5]


def test_release_frees_both_tiers_keeps_the_output_and_drops_only_its_pending_append():
    target = make_target()
    apply_release_plan(target, ReleasePlan(("done5",), ("done5",)))
    assert "done5" not in target.state.requests
    assert target.state.outputs == {
        "done5": RequestOutput("done5", Phase.FINISHED, "length", (5, 5), (LOGPROBS,) * 2)
    }
    assert free_queue(target.gpu_kv) == [8, 9, 10, 11, 6, 7]
    assert list(target.pending_appends) == ["run1"]


def test_release_waits_for_an_aborted_requests_load_even_when_it_fails():
    target = make_target()
    req = target.state.requests["load3"]
    handle = req.load_handle = FailingHandle()
    req.phase, req.finish_reason = Phase.FINISHED, "abort"
    apply_release_plan(target, ReleasePlan(("load3",), ("load3",)))
    assert handle.num_waits == 1
    assert target.state.outputs["load3"].finish_reason == "abort"
    assert free_queue(target.gpu_kv) == [8, 9, 10, 11, 4, 5]
    assert free_queue(target.host_kv) == [5, 6, 7, 2, 3]


def test_eviction_stores_host_victims_drops_recompute_victims_in_plan_order():
    target = make_target()
    apply_eviction_plan(
        target,
        EvictionPlan((Victim("run1", HOST, (2, 3), (6, 5)), Victim("run0", DROP, (0, 1), ()))),
    )
    run1, run0 = target.state.requests["run1"], target.state.requests["run0"]
    assert (
        run1.phase,
        run1.gpu_page_ids,
        run1.host_page_ids,
        run1.swapped_step,
        run1.num_cached_tokens,
    ) == (Phase.SWAPPED, (), (6, 5), 7, 8)
    assert (
        run0.phase,
        run0.gpu_page_ids,
        run0.host_page_ids,
        run0.num_cached_tokens,
        run0.output_ids,
    ) == (Phase.WAITING, (), (), 0, [5])
    assert target.host_kv.copies == [CopyOp("store", "run1", (2, 3), (6, 5))]
    assert free_queue(target.gpu_kv) == [8, 9, 10, 11, 2, 3, 0, 1]
    assert free_queue(target.host_kv) == [7]
    assert (target.state.stats.evictions, target.state.stats.recompute_preemptions) == (1, 1)
    assert list(target.pending_appends) == ["run1", "done5"]  # the worker's, untouched by eviction


def test_migration_grants_exactly_the_planned_gpu_pages_and_starts_the_loads():
    target = make_target()
    apply_migration_plan(
        target,
        MigrationPlan((LoadStart("swap2", (10, 8), (0, 1)), LoadStart("swap6", (11,), (4,)))),
    )
    swap2, swap6 = target.state.requests["swap2"], target.state.requests["swap6"]
    assert (swap2.phase, swap2.gpu_page_ids, swap2.host_page_ids, swap2.load_started_step) == (
        Phase.LOADING,
        (10, 8),
        (0, 1),
        7,
    )
    assert (swap6.phase, swap6.gpu_page_ids, swap6.host_page_ids) == (Phase.LOADING, (11,), (4,))
    assert swap2.load_handle is not None and swap6.load_handle is not None
    assert target.host_kv.copies == [
        CopyOp("load", "swap2", (0, 1), (10, 8)),
        CopyOp("load", "swap6", (4,), (11,)),
    ]
    assert free_queue(target.gpu_kv) == [9]
    assert target.state.stats.loads == 2
    target.gpu_kv.check_integrity(target.state.requests)


def test_allocation_appends_granted_pages_admits_waiting_requests_and_returns_the_served():
    target = make_target()
    # run0 fits its pages: no grant
    plan = AllocPlan((PageGrant("run1", (8,)), PageGrant("wait4", (9, 10))), ())
    assert apply_alloc_plan(
        target, plan, PlanKvPath(target).alloc_request(["run0", "run1", "wait4"])
    ) == ["run0", "run1", "wait4"]
    requests = target.state.requests
    assert [(requests[u].phase, requests[u].gpu_page_ids) for u in ("run0", "run1", "wait4")] == [
        (Phase.RUNNING, (0, 1)),
        (Phase.RUNNING, (2, 3, 8)),
        (Phase.RUNNING, (9, 10)),
    ]
    assert free_queue(target.gpu_kv) == [11]


def test_allocation_leaves_out_what_does_not_fit():
    target = make_target()
    plan = AllocPlan((PageGrant("run1", (8,)),), (DoesNotFit("wait4", 2, 1),))
    assert apply_alloc_plan(target, plan, PlanKvPath(target).alloc_request(["run1", "wait4"])) == [
        "run1"
    ]
    assert target.state.requests["wait4"].phase is Phase.WAITING
    assert free_queue(target.gpu_kv) == [9, 10, 11]


def test_the_plan_path_applies_what_its_manager_plans():
    target = make_target()
    path = PlanKvPath(target)
    assert path.allocate(["run0", "run1", "wait4"]) == ["run0", "run1", "wait4"]
    assert [target.state.requests[u].gpu_page_ids for u in ("run1", "wait4")] == [
        (2, 3, 8),
        (9, 10),
    ]
    path.release(["done5"])
    assert list(target.pending_appends) == ["run1"] and "done5" in target.state.outputs
    target.gpu_kv.check_integrity(target.state.requests)
    target.host_kv.check_integrity(target.state.requests)


def test_a_prefix_hit_shares_its_cached_pages_first_then_its_new_ones_and_counts_the_lookup():
    target = make_target()
    with_cached_prefix(target)  # D0 on page 11, a cache entry at the queue tail
    plan = AllocPlan((PageGrant("run1", (8,)), PageGrant("wait4", (9,), (11,))), ())
    assert alloc(plan)(target) == ["run0", "run1", "wait4"]
    wait4 = target.state.requests["wait4"]
    assert (wait4.phase, wait4.gpu_page_ids, wait4.num_cached_tokens) == (Phase.RUNNING, (11, 9), 4)
    assert wait4.num_cached_prompt_tokens == 4
    # the cache entry left the queue keeping its digest; new pages came from the head
    assert free_queue(target.gpu_kv) == [10]
    assert (target.gpu_kv.digest_of(11), target.gpu_kv.holders(11)) == (D0, 1)
    stats = target.state.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (5, 4)
    target.gpu_kv.check_integrity(target.state.requests)


def test_a_load_re_links_its_cached_pages_frees_their_host_pages_and_loads_only_the_rest():
    target = make_target()
    with_cached_prefix(target)
    apply_migration_plan(target, MigrationPlan((LoadStart("swap2", (8,), (0, 1), (11,)),)))
    swap2 = target.state.requests["swap2"]
    assert (swap2.phase, swap2.gpu_page_ids, swap2.host_page_ids) == (Phase.LOADING, (11, 8), (1,))
    assert swap2.load_page_ids() == (8,)
    assert target.host_kv.copies == [CopyOp("load", "swap2", (1,), (8,))]
    assert free_queue(target.host_kv) == [5, 6, 7, 0]
    assert free_queue(target.gpu_kv) == [9, 10]
    target.gpu_kv.check_integrity(target.state.requests)
    target.host_kv.check_integrity(target.state.requests)
