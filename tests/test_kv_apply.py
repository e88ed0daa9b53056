"""Plan application: every invalid plan is rejected, naming its field, with the target untouched;
valid plans give exactly the expected state.

The target (``make_target``): ``batchgen.validation.plan_fixture`` draws it (every phase, a load
in flight, pending appends), page_size 4, GPU pool 12 pages, host pool 8, step 7.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

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
    PollPlan,
    PollRequest,
    ReleasePlan,
    ReleaseRequest,
    RequestKvView,
    SwappedColumns,
    Victim,
)
from batchgen.kv.target import KvTarget
from batchgen.shadow.fork import view_of
from batchgen.state import (
    Phase,
    RequestOutput,
    RequestState,
)
from batchgen.validation.plan_fixture import (
    ENGINE,
    LOGPROBS,
    alloc,
    evict,
    make_target,
    migrate,
    poll,
    poll_plan,
    release,
)
from batchgen.validation.plan_fixture import set_fields as _set


class FailingHandle:
    """A load whose copy failed: ``wait`` raises."""

    def __init__(self):
        self.num_waits = 0

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        self.num_waits += 1
        raise OSError("injected copy failure")


def deep_dump(target: KvTarget) -> dict:
    """Everything a plan could change: state (handles by identity), both pools' internals, copies,
    pending."""
    state = target.state

    def request(req: RequestState) -> dict:
        fields = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}
        fields["load_handle"] = id(req.load_handle) if req.load_handle is not None else None
        return copy.deepcopy(fields)

    return {
        "step": state.step,
        "num_submitted": state.num_submitted,
        "requests": [(uuid, request(req)) for uuid, req in state.requests.items()],
        "outputs": list(state.outputs.items()),
        "stats": dataclasses.asdict(state.stats),
        "gpu": copy.deepcopy(vars(target.gpu_kv.pages)),
        "host": copy.deepcopy(vars(target.host_kv.pages)),
        "copies": list(target.host_kv.copies),
        "pending": list(target.pending_appends.items()),
    }


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


# ---- invalid plans -------------------------------------------------------------------------------
COMPLETE, RETRY, RECOMPUTE, FAIL = (
    PollAction.COMPLETE,
    PollAction.RETRY,
    PollAction.RECOMPUTE,
    PollAction.FAIL,
)
HOST, DROP = Destination.HOST, Destination.RECOMPUTE

# (case id, setup applied to the fresh target first or None, the application, the field named)
INVALID = [
    # poll
    (
        "poll unknown uuid",
        None,
        poll(poll_plan(("ghost", COMPLETE)), {"ghost": None}),
        "PollPlan.uuids[0]",
    ),
    (
        "poll wrong phase",
        None,
        poll(poll_plan(("load3", COMPLETE), ("run0", COMPLETE)), {"load3": None, "run0": None}),
        "PollPlan.uuids[1]",
    ),
    (
        "poll completes a failed load",
        None,
        poll(poll_plan(("load3", COMPLETE)), {"load3": "OSError: x"}),
        "PollPlan.actions[0]",
    ),
    (
        "poll retries a landed load",
        None,
        poll(poll_plan(("load3", RETRY)), {"load3": None}),
        "PollPlan.actions[0]",
    ),
    (
        "poll retries with no retries left",
        _set("load3", num_load_retries=1),
        poll(poll_plan(("load3", RETRY)), {"load3": "OSError: x"}),
        "PollPlan.actions[0]",
    ),
    (
        "poll fails without a reason",
        None,
        poll(poll_plan(("load3", FAIL)), {"load3": "OSError: x"}),
        "PollPlan.reasons[0]",
    ),
    (
        "poll fails with a reason that is not a str",
        None,
        poll(poll_plan(("load3", FAIL, 123)), {"load3": "OSError: x"}),
        "PollPlan.reasons[0]",
    ),
    (
        "poll names a load by an unhashable id",
        None,
        poll(poll_plan((["load3"], COMPLETE)), {"load3": None}),
        "PollPlan.uuids[0]",
    ),
    ("poll misses an observed load", None, poll(poll_plan(), {"load3": None}), "PollPlan.uuids"),
    (
        "poll names an id of another type beside the load",
        None,
        poll(PollPlan((3, "load3"), (COMPLETE, COMPLETE), (None, None)), {"load3": None}),
        "PollPlan.uuids[0]",
    ),
    (
        "poll names a load twice",
        None,
        poll(poll_plan(("load3", COMPLETE), ("load3", COMPLETE)), {"load3": None}),
        "PollPlan.uuids",
    ),
    (
        "poll names its loads in a list",
        None,
        poll(PollPlan(["load3"], (COMPLETE,), (None,)), {"load3": None}),
        "PollPlan.uuids",
    ),
    (
        "poll gives fewer actions than loads",
        None,
        poll(PollPlan(("load3",), (), (None,)), {"load3": None}),
        "PollPlan.actions",
    ),
    (
        "poll gives fewer reasons than loads",
        None,
        poll(PollPlan(("load3",), (COMPLETE,), ()), {"load3": None}),
        "PollPlan.reasons",
    ),
    (
        "poll gives no actions column",
        None,
        poll(PollPlan(("load3",), None, (None,)), {"load3": None}),
        "PollPlan.actions",
    ),
    (
        "poll gives its reasons as a list",
        None,
        poll(PollPlan(("load3",), (COMPLETE,), [None]), {"load3": None}),
        "PollPlan.reasons",
    ),
    (
        "poll completes a load with a failure reason",
        None,
        poll(poll_plan(("load3", COMPLETE, "load failed: x")), {"load3": None}),
        "PollPlan.reasons[0]",
    ),
    (
        "poll retries a load with a failure reason",
        None,
        poll(poll_plan(("load3", RETRY, "load failed: x")), {"load3": "OSError: x"}),
        "PollPlan.reasons[0]",
    ),
    (
        "poll action given as its string value",
        None,
        poll(poll_plan(("load3", "retry")), {"load3": "OSError: x"}),
        "PollPlan.actions[0]",
    ),
    (
        "poll action unknown",
        None,
        poll(poll_plan(("load3", "bogus")), {"load3": "OSError: x"}),
        "PollPlan.actions[0]",
    ),
    # release
    (
        "release unknown uuid",
        None,
        release(ReleasePlan(("done5", "ghost"), ("done5",))),
        "ReleasePlan.released[1]",
    ),
    (
        "release a running request",
        None,
        release(ReleasePlan(("run0",), ())),
        "ReleasePlan.released[0]",
    ),
    (
        "release a request twice",
        None,
        release(ReleasePlan(("done5", "done5"), ())),
        "ReleasePlan.released",
    ),
    (
        "release a request by an unhashable id",
        None,
        release(ReleasePlan((["done5"],), (["done5"],))),
        "ReleasePlan.released[0]",
    ),
    (
        "complete a landed load by the action's string value",
        None,
        poll(poll_plan(("load3", "complete")), {"load3": None}),
        "PollPlan.actions[0]",
    ),
    (
        "drop the pending append of a request not released",
        None,
        release(ReleasePlan(("done5",), ("done5", "run1"))),
        "ReleasePlan.drop_pending_append_ids[1]",
    ),
    (
        "release a request and keep its pending append",
        None,
        release(ReleasePlan(("done5",), ())),
        "ReleasePlan.drop_pending_append_ids",
    ),
    (
        "drop a pending append twice",
        None,
        release(ReleasePlan(("done5",), ("done5", "done5"))),
        "ReleasePlan.drop_pending_append_ids",
    ),
    # eviction
    (
        "evict unknown uuid",
        None,
        evict(EvictionPlan((Victim("ghost", DROP, (), ()),))),
        "EvictionPlan.victims[0].uuid",
    ),
    (
        "evict a swapped request",
        None,
        evict(EvictionPlan((Victim("swap2", DROP, (), ()),))),
        "EvictionPlan.victims[0].uuid",
    ),
    (
        "evict with a stale GPU page table",
        None,
        evict(EvictionPlan((Victim("run1", DROP, (2,), ()),))),
        "EvictionPlan.victims[0].gpu_page_ids",
    ),
    (
        "evict to host with too few host pages",
        None,
        evict(
            EvictionPlan((Victim("run1", HOST, (2, 3), (5, 6)), Victim("run0", HOST, (0, 1), (7,))))
        ),
        "EvictionPlan.victims[1].host_page_ids",
    ),
    (
        "evict for recompute with host pages",
        None,
        evict(EvictionPlan((Victim("run1", DROP, (2, 3), (5, 6)),))),
        "EvictionPlan.victims[0].host_page_ids",
    ),
    (
        "evict into an owned host page",
        None,
        evict(EvictionPlan((Victim("run1", HOST, (2, 3), (5, 0)),))),
        "EvictionPlan.victims[0].host_page_ids",
    ),
    (
        "evict into a host page out of range",
        None,
        evict(EvictionPlan((Victim("run1", HOST, (2, 3), (5, 8)),))),
        "EvictionPlan.victims[0].host_page_ids",
    ),
    (
        "evict granting a host page twice",
        None,
        evict(
            EvictionPlan(
                (Victim("run1", HOST, (2, 3), (5, 6)), Victim("run0", HOST, (0, 1), (6, 7)))
            )
        ),
        "EvictionPlan.victims[1].host_page_ids",
    ),
    (
        "evict to a destination given as its string value",
        None,
        evict(EvictionPlan((Victim("run1", "host", (2, 3), (5, 6)),))),
        "EvictionPlan.victims[0].destination",
    ),
    (
        "evict into host pages given as a list",
        None,
        evict(EvictionPlan((Victim("run1", HOST, (2, 3), [5, 6]),))),
        "EvictionPlan.victims[0].host_page_ids",
    ),
    (
        "evict a request twice",
        None,
        evict(EvictionPlan((Victim("run1", DROP, (2, 3), ()),) * 2)),
        "EvictionPlan.victims",
    ),
    (
        "evict naming GPU pages as floats equal to the page table",
        None,
        evict(EvictionPlan((Victim("run1", HOST, (2.0, 3.0), (5, 6)),))),
        "EvictionPlan.victims[0].gpu_page_ids",
    ),
    (
        "evict naming GPU pages as a list",
        None,
        evict(EvictionPlan((Victim("run1", HOST, [2, 3], (5, 6)),))),
        "EvictionPlan.victims[0].gpu_page_ids",
    ),
    (
        "evict a request by an unhashable id",
        None,
        evict(EvictionPlan((Victim(["run1"], DROP, (2, 3), ()),))),
        "EvictionPlan.victims[0].uuid",
    ),
    (
        "evict two requests, one by an unhashable id",
        None,
        evict(EvictionPlan((Victim("run0", DROP, (0, 1), ()), Victim(["run1"], DROP, (2, 3), ())))),
        "EvictionPlan.victims[1].uuid",
    ),
    # migration
    (
        "migrate unknown uuid",
        None,
        migrate(MigrationPlan((LoadStart("ghost", (8,), (0,)),))),
        "MigrationPlan.loads[0].uuid",
    ),
    (
        "migrate a running request",
        None,
        migrate(MigrationPlan((LoadStart("run0", (8, 9), (0, 1)),))),
        "MigrationPlan.loads[0].uuid",
    ),
    (
        "migrate from the wrong host pages",
        None,
        migrate(MigrationPlan((LoadStart("swap2", (8, 9), (1, 0)),))),
        "MigrationPlan.loads[0].host_page_ids",
    ),
    (
        "migrate into too many GPU pages",
        None,
        migrate(MigrationPlan((LoadStart("swap2", (8, 9, 10), (0, 1)),))),
        "MigrationPlan.loads[0].gpu_page_ids",
    ),
    (
        "migrate into an owned GPU page",
        None,
        migrate(
            MigrationPlan((LoadStart("swap6", (8,), (4,)), LoadStart("swap2", (9, 0), (0, 1))))
        ),
        "MigrationPlan.loads[1].gpu_page_ids",
    ),
    (
        "migrate granting a GPU page twice in one load",
        None,
        migrate(MigrationPlan((LoadStart("swap2", (8, 8), (0, 1)),))),
        "MigrationPlan.loads[0].gpu_page_ids",
    ),
    (
        "migrate granting a GPU page twice across loads",
        None,
        migrate(
            MigrationPlan((LoadStart("swap2", (8, 9), (0, 1)), LoadStart("swap6", (9,), (4,))))
        ),
        "MigrationPlan.loads[1].gpu_page_ids",
    ),
    (
        "migrate into GPU pages given as a list",
        None,
        migrate(MigrationPlan((LoadStart("swap2", [8, 9], (0, 1)),))),
        "MigrationPlan.loads[0].gpu_page_ids",
    ),
    (
        "migrate a request by an unhashable id",
        None,
        migrate(MigrationPlan((LoadStart(["swap2"], (8, 9), (0, 1)),))),
        "MigrationPlan.loads[0].uuid",
    ),
    (
        "migrate a request by a non-str id",
        None,
        migrate(MigrationPlan((LoadStart(2, (8, 9), (0, 1)),))),
        "MigrationPlan.loads[0].uuid",
    ),
    (
        "migrate a request twice",
        None,
        migrate(MigrationPlan((LoadStart("swap6", (8,), (4,)),) * 2)),
        "MigrationPlan.loads",
    ),
    # allocation
    (
        "grant for an unscheduled request",
        None,
        alloc(AllocPlan((PageGrant("run1", (8,)), PageGrant("done5", ())), ())),
        "AllocPlan.grants[1].uuid",
    ),
    (
        "grant for an unknown scheduled request",
        None,
        alloc(AllocPlan((PageGrant("ghost", ()),), ()), batch=("ghost",)),
        "AllocPlan.grants[0].uuid",
    ),
    (
        "a request left out twice",
        None,
        alloc(AllocPlan((PageGrant("run1", (8,)),), (DoesNotFit("wait4", 2, 1),) * 2)),
        "AllocPlan.not_fitting",
    ),
    (
        "grant for a swapped request",
        None,
        alloc(AllocPlan((PageGrant("swap2", (8, 9)),), ()), batch=("swap2",)),
        "AllocPlan.grants[0].uuid",
    ),
    (
        "grant of the wrong page count",
        None,
        alloc(AllocPlan((PageGrant("wait4", (9, 10)), PageGrant("run1", (8, 11))), ())),
        "AllocPlan.grants[1].new_page_ids",
    ),
    (
        "grant of an owned page",
        None,
        alloc(AllocPlan((PageGrant("run1", (8,)), PageGrant("wait4", (9, 3))), ())),
        "AllocPlan.grants[1].new_page_ids",
    ),
    (
        "grant of a page twice",
        None,
        alloc(AllocPlan((PageGrant("run1", (8,)), PageGrant("wait4", (9, 8))), ())),
        "AllocPlan.grants[1].new_page_ids",
    ),
    (
        "grant of pages given as a list",
        None,
        alloc(AllocPlan((PageGrant("run1", [8]), PageGrant("wait4", (9, 10))), ())),
        "AllocPlan.grants[0].new_page_ids",
    ),
    (
        "grant of a page id that is not an int",
        None,
        alloc(AllocPlan((PageGrant("run1", (8,)), PageGrant("wait4", (9, 10.0))), ())),
        "AllocPlan.grants[1].new_page_ids",
    ),
    (
        "grant of an unhashable page id",
        None,
        alloc(AllocPlan((PageGrant("run1", (8,)), PageGrant("wait4", (9, [10]))), ())),
        "AllocPlan.grants[1].new_page_ids",
    ),
    (
        "grant to a request twice",
        None,
        alloc(AllocPlan((PageGrant("run1", (8,)),) * 2, ())),
        "AllocPlan.grants",
    ),
    (
        "grant to an unhashable id",
        None,
        alloc(AllocPlan((PageGrant("run1", (8,)), PageGrant(["wait4"], (9, 10))), ())),
        "AllocPlan.grants[1].uuid",
    ),
    (
        "leave out an unhashable id",
        None,
        alloc(AllocPlan((PageGrant("run1", (8,)),), (DoesNotFit(["wait4"], 2, 1),))),
        "AllocPlan.not_fitting[0].uuid",
    ),
    (
        "grant to a request that needs no pages",
        None,
        alloc(AllocPlan((PageGrant("run0", ()), PageGrant("run1", (8,))), ())),
        "AllocPlan.grants[0].uuid",
    ),
    (
        "a request left out that needs no pages",
        None,
        alloc(
            AllocPlan(
                (PageGrant("run1", (8,)), PageGrant("wait4", (9, 10))), (DoesNotFit("run0", 1, 1),)
            )
        ),
        "AllocPlan.not_fitting[0].uuid",
    ),
    (
        "a request both granted and left out",
        None,
        alloc(
            AllocPlan(
                (PageGrant("run1", (8,)), PageGrant("wait4", (9, 10))), (DoesNotFit("wait4", 2, 1),)
            )
        ),
        "AllocPlan.not_fitting[0].uuid",
    ),
    (
        "a scheduled request needing pages neither granted nor left out",
        None,
        alloc(AllocPlan((PageGrant("run1", (8,)),), ())),
        "AllocPlan.grants",
    ),
    # fits its page
    (
        "a waiting request admitted without a grant",
        _set("wait4", num_tokens=4, gpu_page_ids=(8,)),
        alloc(AllocPlan((), ()), batch=("wait4",)),
        "AllocPlan.grants",
    ),
]


@pytest.mark.parametrize(
    ("setup", "apply", "field"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID]
)
def test_an_invalid_plan_is_rejected_naming_its_field_and_changes_nothing(setup, apply, field):
    target = make_target()
    if setup is not None:
        setup(target)
    before = deep_dump(target)
    with pytest.raises(PlanRejected) as raised:
        apply(target)
    assert raised.value.field == field
    assert str(raised.value).startswith(f"{field}: ")
    assert deep_dump(target) == before


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
    before = deep_dump(target)
    with pytest.raises(
        PlanRejected,
        match=r"^AllocRequest\.snapshot: stale: step 7 with 4 free GPU pages, the target "
        r"is at step 7 with 3$",
    ):
        apply_alloc_plan(target, plan, request)
    assert deep_dump(target) == before


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
    before = deep_dump(target)
    with pytest.raises(
        PlanRejected, match=r"^AllocPlan\.grants\[1\]\.new_page_ids: page 10 is not free"
    ):
        apply_alloc_plan(target, plan, path.alloc_request(["run1", "wait4"]))
    assert deep_dump(target) == before


# ---- valid plans ---------------------------------------------------------------------------------
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
