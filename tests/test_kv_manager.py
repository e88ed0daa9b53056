"""KVCacheManager: a stateless planner over injected backends; exact plans for exact states.

The plan layer's pre-merge checklist, each item with its tests (the import boundaries are in
``test_import_boundaries.py``, immutability and JSON in ``test_kv_plans.py``):

- backends by injection, only read ...... test_manager_keeps_only_its_injected_backends,
                                          test_manager_never_mutates_its_backends
- no live config: a frozen snapshot ..... test_watermark_*, test_eviction_reads_*,
                                          test_engine_config_is_not_what_the_manager_reads
- stateless ............................. test_the_same_request_planned_twice_gives_equal_plans,
                                          test_planning_never_touches_pending_appends
"""

from __future__ import annotations

import copy
import dataclasses
import enum

import pytest
from kv_dumps import pool_dump
from test_kv_plans import assert_round_trips

from batchgen.config import TINY_MODELS, EngineConfig
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import builtin_workload
from batchgen.kv import plans as kv_plans
from batchgen.kv.backends import GpuKvPool, HostKvPool
from batchgen.kv.manager import KVCacheManager, eviction_watermark_pages
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
    RequestKvView,
    SwappedColumns,
    Victim,
    decode_demand,
)
from batchgen.model.null_model import NullModel
from batchgen.state import Phase, Request

RUNNING, SWAPPED, LOADING, WAITING = "running", "swapped", "loading", "waiting"
READ_ONLY_BACKEND_METHODS = {"peek_free_pages", "free_pages", "free_page_ids"}
MAX_STEPS = 2000  # smoke ends in about 50


# ---- factories --------------------------------------------------------------------------
def geometry(**changes) -> KvGeometry:
    fields = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        dtype_size=4,
        num_gpu_pages=12,
        num_host_pages=8,
        watermark=0.0,
        max_num_seqs=8,
        max_load_retries=1,
    )
    fields.update(changes)
    return KvGeometry(**fields)


def view(
    uuid: str,
    phase: str,
    arrival_index: int,
    num_tokens: int,
    *,
    gpu=(),
    host=(),
    cached=None,
    retries=0,
    swapped_step=None,
) -> RequestKvView:
    return RequestKvView(
        uuid,
        phase,
        arrival_index,
        num_tokens,
        num_tokens - 1 if cached is None else cached,
        tuple(gpu),
        tuple(host),
        retries,
        swapped_step,
        num_tokens,
    )


def pools(
    num_gpu: int, num_host: int, *, gpu_owned=None, host_owned=None, gpu_rotate=0, host_rotate=0
):
    """Bookkeeping pools whose free queues are rotated by ``*_rotate`` pages, then owned as
    given."""
    gpu = GpuKvPool(num_gpu)
    host = HostKvPool(num_host, None, gpu)
    for pool, rotate, owned in ((gpu, gpu_rotate, gpu_owned), (host, host_rotate, host_owned)):
        if rotate:
            pool.allocate_pages("rotate", rotate)
            pool.release_pages("rotate")
        for uuid, page_ids in (owned or {}).items():
            pool.take_pages(uuid, list(page_ids))
    return gpu, host


def snapshot_of(geom: KvGeometry, gpu: GpuKvPool, host: HostKvPool, *, step=5) -> KvSnapshot:
    return KvSnapshot(
        step=step,
        geometry=geom,
        num_free_gpu_pages=gpu.free_pages(),
        num_free_host_pages=host.free_pages(),
    )


def page_columns(views) -> PageColumns:
    views = list(views)
    return PageColumns(
        tuple(v.uuid for v in views),
        tuple(v.num_tokens for v in views),
        tuple(v.gpu_page_ids for v in views),
    )


def running_columns(snap: KvSnapshot, views) -> tuple[PageColumns, int]:
    """The RUNNING requests of ``views`` as columns, and their decode demand."""
    running = page_columns(v for v in views if v.phase == RUNNING)
    return running, decode_demand(running, snap.geometry.page_size)


def eviction_request(snap: KvSnapshot, views) -> EvictionRequest:
    return EvictionRequest(snap, *running_columns(snap, views))


def migration_request(snap: KvSnapshot, views, num_loading: int) -> MigrationRequest:
    swapped = [v for v in views if v.phase == SWAPPED]
    columns = SwappedColumns(
        tuple(v.uuid for v in swapped),
        tuple(v.host_page_ids for v in swapped),
        tuple(v.swapped_step for v in swapped),
    )
    return MigrationRequest(snap, columns, *running_columns(snap, views), num_loading)


def alloc_request(snap: KvSnapshot, views, batch: tuple[str, ...]) -> AllocRequest:
    by_uuid = {v.uuid: v for v in views}
    needing = [
        by_uuid[u]
        for u in batch
        if by_uuid[u].num_tokens > len(by_uuid[u].gpu_page_ids) * snap.geometry.page_size
    ]
    return AllocRequest(snap, page_columns(needing), batch)


def free_queue(pool) -> list[int]:
    return list(pool.pages.free_page_ids())


# Five RUNNING requests on a 12-page GPU pool, page_size 4 (demand = pages for all tokens - pages
# held):
#   a  arrival 0  9 tokens  pages 0,1     demand 1
#   b  arrival 1  9 tokens  pages 2,3     demand 1
#   c  arrival 2  5 tokens  page  4       demand 1
#   d  arrival 3  8 tokens  pages 5,6     demand 0
#   e  arrival 4  13 tokens pages 7,8,9   demand 1
# free 2 (10, 11), total demand 4. With watermark 0.25 (3 pages): e goes
# (free 5 - demand 3 = 2 < 3), then d (free 7 - demand 3 = 4 >= 3): two victims, youngest first.
EVICTION_VIEWS = (
    view("a", RUNNING, 0, 9, gpu=(0, 1)),
    view("b", RUNNING, 1, 9, gpu=(2, 3)),
    view("c", RUNNING, 2, 5, gpu=(4,)),
    view("d", RUNNING, 3, 8, gpu=(5, 6)),
    view("e", RUNNING, 4, 13, gpu=(7, 8, 9)),
)
EVICTION_GPU_OWNED = {v.uuid: v.gpu_page_ids for v in EVICTION_VIEWS}


def eviction_setup(num_host: int, *, host_owned=None, host_rotate=0, watermark=0.25):
    gpu, host = pools(
        12, num_host, gpu_owned=EVICTION_GPU_OWNED, host_owned=host_owned, host_rotate=host_rotate
    )
    snap = snapshot_of(geometry(watermark=watermark, num_host_pages=num_host), gpu, host)
    return KVCacheManager(gpu_kv=gpu, host_kv=host), eviction_request(snap, EVICTION_VIEWS)


def test_manager_keeps_only_its_injected_backends():
    gpu, host = pools(8, 4)
    manager = KVCacheManager(gpu_kv=gpu, host_kv=host)
    before = dict(vars(manager))
    snap = snapshot_of(geometry(num_gpu_pages=8, num_host_pages=4), gpu, host)
    views = [view("a", RUNNING, 0, 9, gpu=()), view("s", SWAPPED, 1, 4, host=(0,), swapped_step=1)]
    manager.plan_allocation(alloc_request(snap, views, ("a",)))
    manager.plan_eviction(eviction_request(snap, views))
    manager.plan_migration(migration_request(snap, views, 0))
    assert vars(manager) == before
    assert list(before) == ["_gpu_kv", "_host_kv"]
    assert before["_gpu_kv"] is gpu and before["_host_kv"] is host


# ---- checklist: watermark from the snapshot ---------------------------------------------------
def test_watermark_is_the_same_for_the_same_snapshot():
    snap = KvSnapshot(0, geometry(num_gpu_pages=100, watermark=0.05), 10, 0)
    assert eviction_watermark_pages(snap) == eviction_watermark_pages(snap) == 5
    assert eviction_watermark_pages(dataclasses.replace(snap, step=9, num_free_gpu_pages=0)) == 5


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"watermark": 0.0}, 0),
        ({"watermark": 0.05}, 5),
        ({"watermark": 0.051}, 6),
        ({"num_gpu_pages": 7, "watermark": 0.25}, 2),
        ({"num_gpu_pages": 200, "watermark": 0.05}, 10),
    ],
)
def test_watermark_follows_the_geometry_of_a_new_snapshot(changes, expected):
    snap = KvSnapshot(0, geometry(**{"num_gpu_pages": 100, **changes}), 0, 0)
    assert eviction_watermark_pages(snap) == expected


def test_eviction_reads_the_watermark_from_the_snapshot_geometry():
    _, request = eviction_setup(8, watermark=0.0)
    manager, strict_request = eviction_setup(8, watermark=0.25)
    assert [v.uuid for v in manager.plan_eviction(request).victims] == ["e"]
    assert [v.uuid for v in manager.plan_eviction(strict_request).victims] == ["e", "d"]


# ---- checklist: backends are only read --------------------------------------------------------
class SpyBackend:
    """Delegates to a pool, records every method called; a mutating call raises."""

    def __init__(self, pool):
        self._pool = pool
        self.calls: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._pool, name)
        if not callable(attr):
            self.calls.append(name)
            return attr

        def spy(*args, **kwargs):
            self.calls.append(name)
            if name not in READ_ONLY_BACKEND_METHODS:
                raise AssertionError(f"the manager called {name}{args} on a backend")
            return attr(*args, **kwargs)

        return spy


class TripwireDict(dict):
    """A dict that records every access while ``armed``."""

    armed = False

    def __init__(self, *args):
        super().__init__(*args)
        self.accesses: list[str] = []

    def _touch(name):  # noqa: N805 (a decorator factory in the class body)
        def method(self, *args, **kwargs):
            if self.armed:
                self.accesses.append(name)
            return getattr(dict, name)(self, *args, **kwargs)

        return method

    for _name in (
        "__getitem__",
        "__setitem__",
        "__delitem__",
        "__contains__",
        "__iter__",
        "__len__",
        "get",
        "pop",
        "popitem",
        "setdefault",
        "update",
        "clear",
        "keys",
        "values",
        "items",
        "copy",
        "__eq__",
        "__or__",
    ):
        locals()[_name] = _touch(_name)
    del _name, _touch


PLAIN_LEAVES = (str, int, float, bool, type(None), enum.Enum)
PLAN_MODULE_TYPES = {
    obj
    for obj in vars(kv_plans).values()
    if isinstance(obj, type) and obj.__module__ == kv_plans.__name__
}


def assert_plain(obj, where="plan") -> None:
    """``obj`` is built only of kv_plans records, tuples and plain values (no lists, dicts, tensors,
    states)."""
    if isinstance(obj, PLAIN_LEAVES):
        return
    assert type(obj) in PLAN_MODULE_TYPES or type(obj) is tuple, (
        f"{where} holds a {type(obj).__name__}"
    )
    if dataclasses.is_dataclass(obj):
        for field in dataclasses.fields(obj):
            assert_plain(getattr(obj, field.name), f"{where}.{field.name}")
    else:
        for i, item in enumerate(obj):
            assert_plain(item, f"{where}[{i}]")


@dataclasses.dataclass
class AuditedRun:
    gpu_calls: list[str]
    host_calls: list[str]
    pairs: list[tuple[object, object]]  # (op request, plan) of every plan call
    pending_sizes: list[int]  # pending appends held while planning, per audited plan call
    pending_accesses: list[str]
    stats: object
    replans: list[tuple[object, object]]  # (plan, the plan of the same request asked again)


def _all_requests(path, worker):
    requests = worker.state.requests
    loading = {u: None for u, r in requests.items() if r.phase is Phase.LOADING}
    done = [u for u, r in requests.items() if r.phase in (Phase.FINISHED, Phase.FAILED)]
    batch = [u for u, r in requests.items() if r.phase in (Phase.RUNNING, Phase.WAITING)]
    return [
        ("plan_poll", path.poll_request(loading)),
        ("plan_release", path.release_request(done)),
        ("plan_eviction", path.eviction_request()),
        ("plan_migration", path.migration_request()),
        ("plan_allocation", path.alloc_request(batch)),
    ]


@pytest.fixture(scope="module")
def audited_run() -> AuditedRun:
    """smoke with a small host pool (evicts, migrates, recomputes) on the plan path with spy
    backends, planning every op after every step while the pending appends of the step's forward are
    still held."""
    workload = builtin_workload("smoke").with_cache(num_host_pages=8)
    worker = Worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_storage=False,
    )
    pending = TripwireDict()
    worker._pending_kv_append_tensors = worker._kv.target.pending_appends = pending
    gpu_spy, host_spy = SpyBackend(worker.gpu_kv), SpyBackend(worker.host_kv)
    manager = KVCacheManager(gpu_kv=gpu_spy, host_kv=host_spy)
    path = worker._kv
    run = AuditedRun(
        gpu_spy.calls, host_spy.calls, [], [], pending.accesses, worker.state.stats, []
    )

    def audited(name):
        def plan(request):
            before = (
                pool_dump(worker.gpu_kv.pages),
                pool_dump(worker.host_kv.pages),
                copy.deepcopy(dict(pending)),
            )
            request_copy = copy.deepcopy(request)
            pending.armed = True
            try:
                result = getattr(manager, name)(request)
            finally:
                pending.armed = False
            assert (
                pool_dump(worker.gpu_kv.pages),
                pool_dump(worker.host_kv.pages),
                dict(pending),
            ) == before, name
            assert request == request_copy, f"{name} changed its request"
            run.pairs.append((request, result))
            run.replans.append((result, getattr(manager, name)(request)))
            return result

        return plan

    path.manager = type(
        "AuditedManager",
        (),
        {
            name: staticmethod(audited(name))
            for name in (
                "plan_poll",
                "plan_release",
                "plan_eviction",
                "plan_migration",
                "plan_allocation",
            )
        },
    )()
    arrivals = sorted(workload.requests, key=lambda r: r.arrival_step)
    for _ in range(MAX_STEPS):  # bounded: a bug that stops the run fails here, not by hanging
        if not (arrivals or worker.has_unfinished()):
            break
        while arrivals and arrivals[0].arrival_step <= worker.state.step:
            worker.add_request(arrivals.pop(0).to_request())
        worker.step()
        if pending:
            run.pending_sizes.append(len(pending))
            for name, request in _all_requests(path, worker):
                getattr(path.manager, name)(request)
    else:
        pytest.fail(f"smoke still live after {MAX_STEPS} steps")
    return run


def test_manager_never_mutates_its_backends(audited_run):
    stats = audited_run.stats
    # every kind of op was planned
    assert (stats.evictions, stats.loads, stats.recompute_preemptions) == (3, 3, 2)
    assert set(audited_run.gpu_calls) | set(audited_run.host_calls) <= READ_ONLY_BACKEND_METHODS
    assert "free_page_ids" in audited_run.gpu_calls and "peek_free_pages" in audited_run.host_calls


def test_planning_never_touches_pending_appends(audited_run):
    assert audited_run.pending_sizes and min(audited_run.pending_sizes) > 0
    assert audited_run.pending_accesses == []
    for request, plan in audited_run.pairs:
        assert_plain(request, type(request).__name__)
        assert_plain(plan, type(plan).__name__)


def test_the_same_request_planned_twice_gives_equal_plans(audited_run):
    assert len(audited_run.replans) == len(audited_run.pairs) > 100
    assert [first for first, _ in audited_run.replans] == [
        again for _, again in audited_run.replans
    ]


def test_every_request_and_plan_of_a_run_round_trips_through_json(audited_run):
    non_empty = {
        type(plan).__name__
        for _, plan in audited_run.pairs
        if any(getattr(plan, f.name) for f in dataclasses.fields(plan))
    }
    assert non_empty == {"EvictionPlan", "MigrationPlan", "AllocPlan", "ReleasePlan", "PollPlan"}
    # repr is exact for these records
    unique = {repr(obj): obj for pair in audited_run.pairs for obj in pair}
    for obj in unique.values():
        assert_round_trips(obj)
        if hasattr(obj, "snapshot"):
            assert_round_trips(obj.snapshot)


# ---- exact plans: eviction -----------------------------------------------------------------------
def test_eviction_takes_the_youngest_first_and_grants_host_pages_from_the_free_queue_head():
    manager, request = eviction_setup(8, host_rotate=3)  # host free queue 3,4,5,6,7,0,1,2
    assert manager.plan_eviction(request) == EvictionPlan(
        (
            Victim("e", Destination.HOST, (7, 8, 9), (3, 4, 5)),
            Victim("d", Destination.HOST, (5, 6), (6, 7)),
        )
    )


def test_eviction_recomputes_a_victim_the_host_pool_cannot_hold_and_still_stores_a_smaller_one():
    # host: 5 pages, queue rotated to 1,2,3,4,0; a swapped request holds 1,2,3 -> free 4,0
    manager, request = eviction_setup(5, host_rotate=1, host_owned={"s": (1, 2, 3)})
    assert manager.plan_eviction(request) == EvictionPlan(
        (
            Victim("e", Destination.RECOMPUTE, (7, 8, 9), ()),
            Victim("d", Destination.HOST, (5, 6), (4, 0)),
        )
    )


def test_eviction_recomputes_every_victim_when_the_host_pool_is_full():
    manager, request = eviction_setup(2, host_owned={"s": (0, 1)})
    assert manager.plan_eviction(request) == EvictionPlan(
        (
            Victim("e", Destination.RECOMPUTE, (7, 8, 9), ()),
            Victim("d", Destination.RECOMPUTE, (5, 6), ()),
        )
    )


def test_eviction_plans_nothing_above_the_watermark_and_asks_no_backend():
    gpu, host = pools(12, 4, gpu_owned={"a": (0, 1)})
    request = eviction_request(
        snapshot_of(geometry(watermark=0.25), gpu, host), [view("a", RUNNING, 0, 9, gpu=(0, 1))]
    )
    gpu_spy, host_spy = SpyBackend(gpu), SpyBackend(host)
    assert KVCacheManager(gpu_kv=gpu_spy, host_kv=host_spy).plan_eviction(request) == EvictionPlan(
        ()
    )
    assert gpu_spy.calls == host_spy.calls == []


def test_eviction_of_the_only_running_request_moves_all_its_pages_to_the_host_queue_head():
    gpu, host = pools(4, 6, gpu_owned={"a": (0, 1, 2, 3)}, host_owned={"s": (0, 1)})
    snap = snapshot_of(geometry(num_gpu_pages=4, num_host_pages=6), gpu, host)
    plan = KVCacheManager(gpu_kv=gpu, host_kv=host).plan_eviction(
        eviction_request(snap, [view("a", RUNNING, 1, 17, gpu=(0, 1, 2, 3))])
    )
    assert plan == EvictionPlan((Victim("a", Destination.HOST, (0, 1, 2, 3), (2, 3, 4, 5)),))


# ---- exact plans: migration ----------------------------------------------------------------------
# GPU pool of 12: r holds 0,1, a LOADING request (outside the scope) holds 3..7
# -> free queue 2,8,9,10,11.
#   s1  arrival 1  host 0,1    swapped step 3  -> comes back into 2,8       (free 5 -> 3)
#   s2  arrival 2  host 2      swapped step 5  -> skipped: swapped this step
#   s3  arrival 3  host 3,4    swapped step 4  -> comes back into 9,10      (free 3 -> 1)
#   s4  arrival 4  host 5,6    swapped step 4  -> does not fit: migration stops here
#   s5  arrival 5  host 7      swapped step 4  -> would fit, but comes after s4
def migration_setup(*, r_tokens=5, max_num_seqs=8, watermark=0.0):
    gpu, host = pools(12, 8, gpu_owned={"r": (0, 1), "l": (3, 4, 5, 6, 7)})
    views = [
        view("r", RUNNING, 0, r_tokens, gpu=(0, 1)),
        view("s1", SWAPPED, 1, 6, host=(0, 1), swapped_step=3),
        view("s2", SWAPPED, 2, 3, host=(2,), swapped_step=5),
        view("s3", SWAPPED, 3, 8, host=(3, 4), swapped_step=4),
        view("s4", SWAPPED, 4, 7, host=(5, 6), swapped_step=4),
        view("s5", SWAPPED, 5, 2, host=(7,), swapped_step=4),
    ]
    snap = snapshot_of(geometry(max_num_seqs=max_num_seqs, watermark=watermark), gpu, host, step=5)
    assert free_queue(gpu) == [2, 8, 9, 10, 11]
    return KVCacheManager(gpu_kv=gpu, host_kv=host), migration_request(snap, views, num_loading=1)


def test_migration_brings_back_the_oldest_first_skipping_this_steps_swaps_stopping_at_a_misfit():
    manager, request = migration_setup()
    assert manager.plan_migration(request) == MigrationPlan(
        (
            LoadStart("s1", (2, 8), (0, 1)),
            LoadStart("s3", (9, 10), (3, 4)),
        )
    )


def test_migration_leaves_room_for_the_running_requests_decode_demand():
    manager, request = migration_setup(r_tokens=13)  # r needs 2 more pages: free 5 - 2 = 3
    assert manager.plan_migration(request) == MigrationPlan((LoadStart("s1", (2, 8), (0, 1)),))


def test_migration_keeps_the_watermark():
    manager, request = migration_setup(watermark=0.25)  # 3 pages kept free: only s1 (5 - 2 = 3)
    assert manager.plan_migration(request) == MigrationPlan((LoadStart("s1", (2, 8), (0, 1)),))


def test_migration_counts_running_and_loading_requests_against_max_num_seqs():
    manager, request = migration_setup(max_num_seqs=3)  # r + the LOADING one + s1
    assert manager.plan_migration(request) == MigrationPlan((LoadStart("s1", (2, 8), (0, 1)),))
    manager, request = migration_setup(max_num_seqs=2)
    assert manager.plan_migration(request) == MigrationPlan(())


# ---- exact plans: allocation ---------------------------------------------------------------------
# GPU pool of 10, queue rotated by 2, a holds 2,3 and d holds 4,5
# -> free queue 6,7,8,9,0,1 (6 free).
#   a  RUNNING 9 tokens  (2 pages held)  needs 1 -> 6              free 5
#   w  WAITING 21 tokens                 needs 6 -> does not fit   (6 > 5)
#   v  WAITING 4 tokens                  needs 1 -> 7              free 4
#   d  RUNNING 8 tokens  (2 pages held)  needs 0 -> no grant (served as it is)
def test_allocation_grants_exact_page_ids_in_batch_order_and_reports_what_does_not_fit():
    gpu, host = pools(10, 0, gpu_rotate=2, gpu_owned={"a": (2, 3), "d": (4, 5)})
    assert free_queue(gpu) == [6, 7, 8, 9, 0, 1]
    views = [
        view("a", RUNNING, 0, 9, gpu=(2, 3)),
        view("d", RUNNING, 1, 8, gpu=(4, 5)),
        view("w", WAITING, 2, 21, cached=0),
        view("v", WAITING, 3, 4, cached=0),
    ]
    snap = snapshot_of(geometry(num_gpu_pages=10, num_host_pages=0), gpu, host)
    plan = KVCacheManager(gpu_kv=gpu, host_kv=host).plan_allocation(
        alloc_request(snap, views, ("a", "w", "v", "d"))
    )
    assert plan == AllocPlan(
        grants=(PageGrant("a", (6,)), PageGrant("v", (7,))),
        not_fitting=(DoesNotFit("w", num_pages_needed=6, num_pages_free=5),),
    )


def test_allocation_of_an_empty_pool_serves_only_requests_that_need_nothing():
    gpu, host = pools(2, 0, gpu_owned={"a": (0, 1)})
    snap = snapshot_of(geometry(num_gpu_pages=2, num_host_pages=0), gpu, host)
    views = [view("a", RUNNING, 0, 8, gpu=(0, 1)), view("w", WAITING, 1, 1, cached=0)]
    plan = KVCacheManager(gpu_kv=gpu, host_kv=host).plan_allocation(
        alloc_request(snap, views, ("w", "a"))
    )
    assert plan == AllocPlan((), (DoesNotFit("w", 1, 0),))


# ---- exact plans: poll and release ---------------------------------------------------------------
def poll_request(
    outcomes: dict[str, str | None], retries: dict[str, int], **changes
) -> PollRequest:
    snap = KvSnapshot(4, geometry(**changes), 0, 0)
    return PollRequest(
        snap, tuple(outcomes), tuple(outcomes.values()), tuple(retries[u] for u in outcomes)
    )


def test_poll_completes_every_load_that_landed():
    snap = KvSnapshot(4, geometry(), 0, 0)
    gpu, host = pools(8, 4)
    plan = KVCacheManager(gpu_kv=gpu, host_kv=host).plan_poll(
        PollRequest(snap, ("l2", "l1"), (None, None), (0, 1))
    )
    assert plan == PollPlan(("l2", "l1"), (PollAction.COMPLETE,) * 2, (None, None))


def test_poll_completes_landed_loads_retries_failed_ones_then_recomputes_in_observed_order():
    request = poll_request(
        {"l2": "OSError: x", "l1": None, "l3": "OSError: y"}, {"l1": 0, "l2": 1, "l3": 0}
    )
    gpu, host = pools(8, 4)
    assert KVCacheManager(gpu_kv=gpu, host_kv=host).plan_poll(request) == PollPlan(
        ("l2", "l1", "l3"),
        (PollAction.RECOMPUTE, PollAction.COMPLETE, PollAction.RETRY),
        (None, None, None),
    )


def test_a_poll_request_whose_retries_do_not_match_its_failed_loads_is_refused():
    request = poll_request({"l1": "OSError: x", "l2": None}, {"l1": 0, "l2": 0})
    gpu, host = pools(8, 4)
    with pytest.raises(ValueError, match="zip"):
        KVCacheManager(gpu_kv=gpu, host_kv=host).plan_poll(
            dataclasses.replace(request, num_load_retries=(0,))
        )


def test_poll_recomputes_at_once_when_no_retries_are_allowed():
    request = poll_request({"l1": "OSError: x"}, {"l1": 0}, max_load_retries=0)
    gpu, host = pools(8, 4)
    assert KVCacheManager(gpu_kv=gpu, host_kv=host).plan_poll(request) == PollPlan(
        ("l1",), (PollAction.RECOMPUTE,), (None,)
    )


def test_poll_fails_the_request_with_the_load_error_when_the_policy_says_fail():
    request = poll_request(
        {"l1": "OSError: x", "l2": "OSError: y"}, {"l1": 1, "l2": 0}, load_failure="fail"
    )
    gpu, host = pools(8, 4)
    assert KVCacheManager(gpu_kv=gpu, host_kv=host).plan_poll(request) == PollPlan(
        ("l1", "l2"), (PollAction.FAIL, PollAction.RETRY), ("load failed: OSError: x", None)
    )


def test_release_releases_and_drops_the_pending_appends_of_exactly_the_done_requests():
    gpu, host = pools(4, 4)
    snap = KvSnapshot(2, geometry(), 4, 4)
    plan = KVCacheManager(gpu_kv=gpu, host_kv=host).plan_release(ReleaseRequest(snap, ("f", "x")))
    assert plan == ReleasePlan(released=("f", "x"), drop_pending_append_ids=("f", "x"))


def test_engine_config_is_not_what_the_manager_reads():
    """A snapshot whose geometry disagrees with any engine config still decides by the snapshot."""
    request = poll_request({"l1": "OSError: x"}, {"l1": 0}, max_load_retries=3)
    assert EngineConfig().max_load_retries != 3
    gpu, host = pools(8, 4)
    assert KVCacheManager(gpu_kv=gpu, host_kv=host).plan_poll(request).actions == (
        PollAction.RETRY,
    )


def test_a_request_added_to_the_worker_after_the_snapshot_does_not_change_the_plan():
    workload = builtin_workload("smoke")
    worker = Worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_storage=False,
    )
    for req in workload.requests[:3]:
        worker.add_request(req.to_request())
    worker.step()
    request = worker._kv.alloc_request(list(worker.state.requests))
    plan = worker._kv.manager.plan_allocation(request)
    worker.add_request(Request("late", (1, 2, 3), 4))
    assert worker._kv.manager.plan_allocation(request) == plan
