"""The plan path on the worker side: build snapshots, ask the manager, apply plans.

One function per plan type applies it to a :class:`KvTarget`. Each validates the
whole plan against the target first and raises :class:`PlanRejected` (naming the
plan field) before anything changes; only then does it mutate. The pending
append tensors stay the worker's: a plan only names which ones to drop.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Mapping, Sequence, Set

from batchgen.config import DTYPE_SIZES
from batchgen.engine.state import DONE_PHASES, Phase, RequestState
from batchgen.kv.manager import KVCacheManager
from batchgen.kv.page_pool import PAGE_ID_TYPES, Grants, PageOwnershipError
from batchgen.kv.plans import (
    AllocPlan,
    AllocRequest,
    Destination,
    EvictionPlan,
    EvictionRequest,
    KvGeometry,
    KvSnapshot,
    MigrationPlan,
    MigrationRequest,
    PageColumns,
    PollAction,
    PollPlan,
    PollRequest,
    ReleasePlan,
    ReleaseRequest,
    SwappedColumns,
    decode_demand,
)
from batchgen.kv.target import KvTarget


class PlanRejected(ValueError):
    """A plan cannot be applied; the target is unchanged."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def geometry_of(target: KvTarget) -> KvGeometry:
    model, cache, engine = target.model_config, target.cache_config, target.engine_config
    return KvGeometry(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        page_size=cache.page_size,
        dtype_size=DTYPE_SIZES[cache.dtype],
        num_gpu_pages=cache.num_gpu_pages,
        num_host_pages=cache.num_host_pages,
        watermark=cache.watermark,
        max_num_seqs=engine.max_num_seqs,
        max_load_retries=engine.max_load_retries,
        load_failure=engine.load_failure,
    )


# Phases as module constants: ``Phase.X`` is a class attribute lookup of ~0.1 us, and these run per
# request.
WAITING, RUNNING, SWAPPED, LOADING, FAILED = (
    Phase.WAITING,
    Phase.RUNNING,
    Phase.SWAPPED,
    Phase.LOADING,
    Phase.FAILED,
)
COMPLETE, RETRY, FAIL, TO_HOST = (
    PollAction.COMPLETE,
    PollAction.RETRY,
    PollAction.FAIL,
    Destination.HOST,
)
NO_PAGES, NO_SWAPPED = PageColumns((), (), ()), SwappedColumns((), (), ())
_ADMISSIBLE = (RUNNING, WAITING)  # phases a request may be allocated pages in
_GRANT_UUID = operator.itemgetter(0)  # PageGrant.uuid, read in C
_UUID = operator.attrgetter("uuid")
_NUM_LOAD_RETRIES = operator.attrgetter("num_load_retries")
_NONE_LEFT_OUT: frozenset[str] = frozenset()


# Columns are built by comprehensions: on Python 3.11 a specialised slot read in a comprehension
# costs about half of what ``map(attrgetter(...), scope)`` does per request (measured: 0.5 against
# 1.0 us for 27 requests).
def page_columns(scope: Sequence[RequestState]) -> PageColumns:
    if not scope:
        return NO_PAGES
    return PageColumns.new(
        tuple([r.uuid for r in scope]),
        tuple([r.num_tokens for r in scope]),
        tuple([r.gpu_page_ids for r in scope]),
    )


def swapped_columns(scope: Sequence[RequestState]) -> SwappedColumns:
    return SwappedColumns.new(
        tuple([r.uuid for r in scope]),
        tuple([r.host_page_ids for r in scope]),
        tuple([r.swapped_step for r in scope]),
    )


class PlanKvPath:
    """The KV ops through :class:`KVCacheManager` plans, applied to ``target``. Its one piece of
    state between ops is what an evict leaves for the migrate that follows it (``_evicted``); every
    other op drops it."""

    name = "plan"

    def __init__(self, target: KvTarget, geometry: KvGeometry | None = None):
        """``geometry``: the target's (``geometry_of``), when the caller has it already."""
        self.target = target
        # What a snapshot reads, held as the legacy path holds them: a target's state and pools are
        # set once.
        self._state, self._gpu_pages, self._host_pages = (
            target.state,
            target.gpu_kv.pages,
            target.host_kv.pages,
        )
        self.manager = KVCacheManager(gpu_kv=target.gpu_kv, host_kv=target.host_kv)
        self.geometry = geometry or geometry_of(target)
        # the last op, when it was evict
        self._evicted: tuple[EvictionRequest, EvictionPlan] | None = None

    def snapshot(self) -> KvSnapshot:
        return KvSnapshot.new(
            self._state.step, self.geometry, self._gpu_pages.num_free, self._host_pages.num_free
        )

    # Requests (op inputs) are built by these, so compare mode can log and replay them.
    def poll_request(self, observed: Mapping[str, str | None]) -> PollRequest:
        """The observed loads, and each request's retries when any load failed (no request is read
        when all landed)."""
        errors = tuple(observed.values())
        retries = ()
        if errors.count(None) != len(errors):
            retries = tuple(
                map(_NUM_LOAD_RETRIES, map(self.target.state.requests.__getitem__, observed))
            )
        return PollRequest.new(self.snapshot(), tuple(observed), errors, retries)

    def release_request(self, uuids: Sequence[str]) -> ReleaseRequest:
        return ReleaseRequest.new(self.snapshot(), tuple(uuids))

    def eviction_request(self) -> EvictionRequest:
        requests = self.target.state.requests.values()
        running = page_columns([r for r in requests if r.phase is RUNNING])
        return EvictionRequest.new(
            self.snapshot(),
            running,
            decode_demand(running.num_tokens, running.gpu_page_ids, self.geometry.page_size),
        )

    def migration_request(self) -> MigrationRequest:
        """Columns of the SWAPPED requests, and of the RUNNING ones with their decode demand when
        any is SWAPPED: right after an evict, that eviction's, less its victims, when
        :func:`running_after` can vouch for them. Takes what evict kept (mutates ``_evicted``)."""
        evicted, self._evicted = self._evicted, None
        requests = self.target.state.requests.values()
        swapped = [r for r in requests if r.phase is SWAPPED]
        snapshot = self.snapshot()
        if not swapped:
            # nothing to decide: no more to read
            return MigrationRequest.new(
                snapshot, NO_SWAPPED, NO_PAGES, decode_demand=0, num_loading=0
            )
        after = running_after(*evicted, snapshot) if evicted is not None else None
        if after is not None:
            running, demand = after
        else:
            running = page_columns([r for r in requests if r.phase is RUNNING])
            demand = decode_demand(
                running.num_tokens, running.gpu_page_ids, self.geometry.page_size
            )
        num_loading = len([r for r in requests if r.phase is LOADING])
        return MigrationRequest.new(
            snapshot, swapped_columns(swapped), running, demand, num_loading
        )

    def alloc_request(self, batch: Sequence[str]) -> AllocRequest:
        """Columns of the scheduled requests the op must act on: those whose tokens run past their
        last page, or not RUNNING yet (admitted by their grant). The rest are served as they are."""
        requests, page_size = self._state.requests, self.geometry.page_size
        # a subscript in the comprehension: cheaper than map(requests.__getitem__)
        scope = [
            r
            for uuid in batch
            if (r := requests[uuid]).num_tokens > len(r.gpu_page_ids) * page_size
            or r.phase is not RUNNING
        ]
        return AllocRequest.new(self.snapshot(), page_columns(scope), tuple(batch))

    # The KvPath interface (same as LegacyKvPath).
    def poll(self, observed: Mapping[str, str | None]) -> None:
        self._evicted = None
        apply_poll_plan(self.target, self.manager.plan_poll(self.poll_request(observed)), observed)

    def release(self, uuids: Sequence[str]) -> None:
        self._evicted = None
        apply_release_plan(self.target, self.manager.plan_release(self.release_request(uuids)))

    def evict(self) -> None:
        """Keeps its request and plan for the migrate that directly follows (the worker's step
        order): the RUNNING columns that migrate reads are the eviction's, less its victims
        (:func:`running_after`)."""
        self._evicted = None
        request = self.eviction_request()
        plan = self.manager.plan_eviction(request)
        apply_eviction_plan(self.target, plan)
        self._evicted = request, plan

    def migrate(self) -> None:
        apply_migration_plan(self.target, self.manager.plan_migration(self.migration_request()))

    def allocate(self, batch: Sequence[str]) -> list[str]:
        self._evicted = None
        request = self.alloc_request(batch)
        return apply_alloc_plan(self.target, self.manager.plan_allocation(request), request)


def running_after(
    request: EvictionRequest, plan: EvictionPlan, snapshot: KvSnapshot
) -> tuple[PageColumns, int] | None:
    """The RUNNING columns and their decode demand once ``plan`` is applied to the state ``request``
    was built from: ``request``'s, less the victims, which are their tail (the youngest, last
    first), and less the victims' share of the demand. None when the victims are not that tail, or
    when ``snapshot`` (taken since) is not of that step with the free pages the plan leaves:
    something else changed the pools. Only KV ops change which requests run and what pages they
    hold, and the worker runs none between its evict and its migrate. Pure."""
    before, running, victims = request.snapshot, request.running, plan.victims
    freed_gpu = taken_host = 0
    for victim in victims:
        freed_gpu += len(victim.gpu_page_ids)
        taken_host += len(victim.host_page_ids)
    if (
        snapshot.step != before.step
        or snapshot.num_free_gpu_pages != before.num_free_gpu_pages + freed_gpu
        or snapshot.num_free_host_pages != before.num_free_host_pages - taken_host
    ):
        return None
    if not victims:
        return running, request.decode_demand
    kept = len(running.uuids) - len(victims)
    if kept < 0 or running.uuids[kept:] != tuple([victim.uuid for victim in reversed(victims)]):
        return None
    victims_demand = decode_demand(
        running.num_tokens[kept:], running.gpu_page_ids[kept:], before.geometry.page_size
    )
    return (
        PageColumns.new(
            running.uuids[:kept], running.num_tokens[:kept], running.gpu_page_ids[:kept]
        ),
        request.decode_demand - victims_demand,
    )


# ---- validation helpers ------------------------------------------------------------------
def _request(target: KvTarget, field: str, uuid: str, phases: Collection[Phase]) -> RequestState:
    """The live request ``uuid`` if it is in one of ``phases``; else PlanRejected naming ``field``
    and why."""
    if type(uuid) is not str:
        raise PlanRejected(field, f"{uuid!r} is not a request id")
    req = target.state.requests.get(uuid)
    if req is None:
        raise PlanRejected(field, f"unknown request {uuid!r}")
    if req.phase not in phases:
        allowed = "/".join(p.name for p in phases)
        raise PlanRejected(field, f"request {uuid!r} is {req.phase.name}, expected {allowed}")
    return req


def _take_pages(pool, grants: Grants, field: str) -> None:
    """``pool.take_pages_for(grants)``: all validated, then all taken, or PlanRejected naming the
    refused grant's field (``field`` with ``{}`` for its index) and nothing changed. Mutates the
    pool."""
    try:
        pool.take_pages_for(grants)
    except PageOwnershipError as refused:
        raise PlanRejected(
            field.format(refused.index), f"{refused.reason} in the {pool.pages.name} pool"
        ) from None


def _check_unique(field: str, uuids: Sequence[str]) -> None:
    if len(_uuid_set(field + "[{}]", uuids)) != len(uuids):
        raise PlanRejected(field, f"a request is named twice in {list(uuids)}")


def _uuid_set(field: str, items: Sequence, uuid_of: Callable | None = None) -> set[str]:
    """The request ids of ``items`` (``uuid_of(item)``, or the items themselves), as a set;
    PlanRejected naming ``field`` (``{}``: the item's index) for the first that cannot be a request
    id."""
    uuids = items if uuid_of is None else map(uuid_of, items)
    try:
        return set(uuids)
    except TypeError:
        for i, uuid in enumerate(items if uuid_of is None else map(uuid_of, items)):
            try:
                hash(uuid)
            except TypeError:
                raise PlanRejected(field.format(i), f"{uuid!r} is not a request id") from None
        raise


def _reject_member(field: str, value, enum_type) -> None:
    """Raise PlanRejected: ``value`` (at ``field``) is not an ``enum_type`` member. Str enums
    compare equal to their values, so the appliers check the type, not equality."""
    allowed = ", ".join(f"{enum_type.__name__}.{member.name}" for member in enum_type)
    raise PlanRejected(field, f"{value!r} is not one of {allowed}")


def _reject_ids(field: str, page_ids) -> None:
    """Raise PlanRejected: ``page_ids`` (at ``field``) is not a tuple (page tables are tuples)."""
    raise PlanRejected(
        field, f"page ids must be a tuple of ints, not {type(page_ids).__name__} {page_ids!r}"
    )


# ---- appliers: validate everything, then mutate ------------------------------------------
def _check_poll_row(
    target: KvTarget, i: int, req: RequestState, action, reason, error: str | None
) -> None:
    """PlanRejected naming row ``i`` of a poll plan unless ``action`` (with ``reason``) is one the
    load of ``req``, observed with ``error`` (None: it landed), allows: complete a landed load,
    retry one that failed with retries left, recompute it, or fail it with a reason (a non-empty
    str); a reason goes with FAIL only. Pure."""
    uuid = req.uuid
    if type(action) is not PollAction:
        _reject_member(f"PollPlan.actions[{i}]", action, PollAction)
    if action is COMPLETE:
        if error is not None:
            raise PlanRejected(f"PollPlan.actions[{i}]", f"{uuid!r} load failed; cannot complete")
    elif error is None:
        raise PlanRejected(
            f"PollPlan.actions[{i}]", f"{uuid!r} load completed; nothing to {action.value}"
        )
    if action is RETRY and req.num_load_retries >= target.engine_config.max_load_retries:
        raise PlanRejected(f"PollPlan.actions[{i}]", f"{uuid!r} has no retries left")
    if action is FAIL:
        if type(reason) is not str or not reason:
            raise PlanRejected(
                f"PollPlan.reasons[{i}]",
                f"failing {uuid!r} needs a reason (a non-empty str), not {reason!r}",
            )
    elif reason is not None:
        raise PlanRejected(
            f"PollPlan.reasons[{i}]",
            f"{uuid!r} is to {action.value}, not to fail: its reason must be None, not {reason!r}",
        )


def apply_poll_plan(target: KvTarget, plan: PollPlan, observed: Mapping[str, str | None]) -> None:
    """Mutates phases, page tables, pools (host frees, retried loads), stats."""
    uuids, actions, reasons = plan.uuids, plan.actions, plan.reasons
    if uuids != tuple(observed):  # else: each observed load once, in order
        if type(uuids) is not tuple:
            raise PlanRejected(
                "PollPlan.uuids", f"must be a tuple of request ids, not {type(uuids).__name__}"
            )
        named = _uuid_set("PollPlan.uuids[{}]", uuids)
        if len(named) != len(uuids):
            _check_unique("PollPlan.uuids", uuids)  # raises, naming the loads
        if observed.keys() != named:
            raise PlanRejected(
                "PollPlan.uuids", f"covers {sorted(named, key=repr)}, observed {sorted(observed)}"
            )
    if not (
        type(actions) is tuple
        and type(reasons) is tuple
        and len(actions) == len(reasons) == len(uuids)
    ):
        for field, column in (("actions", actions), ("reasons", reasons)):  # names the bad column
            if type(column) is not tuple or len(column) != len(uuids):
                raise PlanRejected(
                    f"PollPlan.{field}",
                    f"must be a tuple with one entry per load ({len(uuids)}), "
                    f"not {type(column).__name__} {column!r}",
                )
    requests = target.state.requests
    # the ids are unique here: uuids.index names a row
    for uuid, action, reason in zip(uuids, actions, reasons):
        req = requests.get(uuid)
        if req is None or req.phase is not LOADING:
            # raises, naming why
            _request(target, f"PollPlan.uuids[{uuids.index(uuid)}]", uuid, (LOADING,))
        if action is not COMPLETE or reason is not None or observed[uuid] is not None:
            _check_poll_row(target, uuids.index(uuid), req, action, reason, observed[uuid])
    stats = target.state.stats
    for uuid, action, reason in zip(uuids, actions, reasons):
        req = target.state.edit(uuid)
        if action is COMPLETE:
            req.load_handle = None
            req.load_started_step = None
            target.host_kv.release_pages(uuid)
            req.host_page_ids = ()
            req.phase = RUNNING
            continue
        stats.load_failures += 1
        if action is RETRY:
            req.num_load_retries += 1
            req.load_handle = target.host_kv.load_to_gpu_async(uuid, list(req.gpu_page_ids))
            req.load_started_step = target.state.step
            stats.loads += 1
            continue
        # a timed-out load's copy may still be writing into the GPU pages freed next
        req.drain_load()
        target.gpu_kv.release_pages(uuid)
        target.host_kv.release_pages(uuid)
        req.gpu_page_ids, req.host_page_ids = (), ()
        req.num_cached_tokens = 0
        req.num_load_retries = 0
        req.load_started_step = None
        if action is FAIL:
            req.phase, req.finish_reason = FAILED, reason
        else:
            req.phase = WAITING
            stats.recompute_preemptions += 1


def apply_release_plan(target: KvTarget, plan: ReleasePlan) -> None:
    """Mutates requests (removed), outputs, both pools, pending appends."""
    # one request is named once; if its id cannot be one, the lookup below says so
    if len(plan.released) > 1:
        _check_unique("ReleasePlan.released", plan.released)
    requests = target.state.requests
    for i, uuid in enumerate(plan.released):
        req = requests.get(uuid) if type(uuid) is str else None
        if req is None or req.phase not in DONE_PHASES:
            _request(target, f"ReleasePlan.released[{i}]", uuid, DONE_PHASES)  # raises, naming why
    # else checked above (the manager drops every released one)
    if plan.drop_pending_append_ids != plan.released:
        _check_drops(target, plan)
    for uuid in plan.released:
        req = target.state.remove(uuid)
        req.drain_load()
        target.gpu_kv.release_pages(uuid)
        target.host_kv.release_pages(uuid)
        target.state.outputs[uuid] = req.to_output()
    for uuid in plan.drop_pending_append_ids:
        target.drop_pending_append(uuid)


def _check_drops(target: KvTarget, plan: ReleasePlan) -> None:
    """PlanRejected unless the plan drops each pending append once, only of released requests, and
    strands none."""
    released = set(plan.released)
    _check_unique("ReleasePlan.drop_pending_append_ids", plan.drop_pending_append_ids)
    for i, uuid in enumerate(plan.drop_pending_append_ids):
        if uuid not in released:
            raise PlanRejected(
                f"ReleasePlan.drop_pending_append_ids[{i}]", f"{uuid!r} is not being released"
            )
    dropped = set(plan.drop_pending_append_ids)
    stranded = [
        uuid for uuid in plan.released if uuid not in dropped and target.has_pending_append(uuid)
    ]
    if stranded:
        raise PlanRejected(
            "ReleasePlan.drop_pending_append_ids",
            f"released {stranded} would keep their pending appends",
        )


def apply_eviction_plan(target: KvTarget, plan: EvictionPlan) -> None:
    """Mutates victims (phase, page tables), both pools (store copies, pages), stats."""
    if not plan.victims:
        return
    # one victim is named once; if its id cannot be one, the lookup below says so
    if len(plan.victims) > 1:
        _check_unique("EvictionPlan.victims", [v.uuid for v in plan.victims])
    requests, to_host = target.state.requests, False
    for i, victim in enumerate(plan.victims):  # field names are formatted only on the error paths
        req = requests.get(victim.uuid) if type(victim.uuid) is str else None
        if req is None or req.phase is not RUNNING:
            # raises, naming why
            _request(target, f"EvictionPlan.victims[{i}].uuid", victim.uuid, (RUNNING,))
        # the page table itself: equal, and a tuple of ints
        if victim.gpu_page_ids is not req.gpu_page_ids and (
            victim.gpu_page_ids != req.gpu_page_ids
            or type(victim.gpu_page_ids) is not tuple
            # (2.0,) == (2,): types too
            or not PAGE_ID_TYPES.issuperset(map(type, victim.gpu_page_ids))
        ):
            raise PlanRejected(
                f"EvictionPlan.victims[{i}].gpu_page_ids",
                f"{victim.gpu_page_ids!r} != page table {req.gpu_page_ids}",
            )
        if type(victim.destination) is not Destination:
            _reject_member(
                f"EvictionPlan.victims[{i}].destination", victim.destination, Destination
            )
        if type(victim.host_page_ids) is not tuple:
            _reject_ids(f"EvictionPlan.victims[{i}].host_page_ids", victim.host_page_ids)
        want = len(req.gpu_page_ids) if victim.destination is TO_HOST else 0
        if len(victim.host_page_ids) != want:
            raise PlanRejected(
                f"EvictionPlan.victims[{i}].host_page_ids",
                f"{len(victim.host_page_ids)} pages for {want} GPU pages",
            )
        to_host = to_host or victim.destination is TO_HOST
    if to_host:  # else no host page is named (checked above)
        _take_pages(
            target.host_kv,
            [(v.uuid, v.host_page_ids) for v in plan.victims],
            "EvictionPlan.victims[{}].host_page_ids",
        )
    stats = target.state.stats
    for victim in plan.victims:
        req = target.state.edit(victim.uuid)
        if victim.destination is TO_HOST:  # copied from the page table the plan was checked against
            target.host_kv.store_from_gpu(victim.uuid, list(req.gpu_page_ids))
            req.host_page_ids = victim.host_page_ids
            req.phase = SWAPPED
            req.swapped_step = target.state.step
            stats.evictions += 1
        else:
            req.num_cached_tokens = 0
            req.phase = WAITING
            stats.recompute_preemptions += 1
        target.gpu_kv.release_pages(victim.uuid)
        req.gpu_page_ids = ()


def apply_migration_plan(target: KvTarget, plan: MigrationPlan) -> None:
    """Mutates phases (-> LOADING), page tables, the GPU pool, stats; starts async loads."""
    if not plan.loads:
        return
    # one load is named once; if its id cannot be one, the lookup below says so
    if len(plan.loads) > 1:
        _check_unique("MigrationPlan.loads", [load.uuid for load in plan.loads])
    requests = target.state.requests
    for i, load in enumerate(plan.loads):
        req = requests.get(load.uuid) if type(load.uuid) is str else None
        if req is None or req.phase is not SWAPPED:
            # raises, naming why
            _request(target, f"MigrationPlan.loads[{i}].uuid", load.uuid, (SWAPPED,))
        if load.host_page_ids != req.host_page_ids:
            raise PlanRejected(
                f"MigrationPlan.loads[{i}].host_page_ids",
                f"{load.host_page_ids} != host page table {req.host_page_ids}",
            )
        if type(load.gpu_page_ids) is not tuple:
            _reject_ids(f"MigrationPlan.loads[{i}].gpu_page_ids", load.gpu_page_ids)
        if len(load.gpu_page_ids) != len(req.host_page_ids):
            raise PlanRejected(
                f"MigrationPlan.loads[{i}].gpu_page_ids",
                f"{len(load.gpu_page_ids)} pages for {len(req.host_page_ids)} host pages",
            )
    _take_pages(
        target.gpu_kv,
        [(load.uuid, load.gpu_page_ids) for load in plan.loads],
        "MigrationPlan.loads[{}].gpu_page_ids",
    )
    for load in plan.loads:
        req = target.state.edit(load.uuid)
        req.gpu_page_ids = load.gpu_page_ids
        req.load_handle = target.host_kv.load_to_gpu_async(load.uuid, list(load.gpu_page_ids))
        req.load_started_step = target.state.step
        req.phase = LOADING
        req.num_load_retries = 0
        target.state.stats.loads += 1


def _check_left_out(plan: AllocPlan, request: AllocRequest, needing: set[str]) -> Set[str]:
    """The requests ``plan`` leaves out; PlanRejected unless it grants or leaves out each request of
    ``needing`` once and names no other. Pure."""
    granted_uuids = _uuid_set("AllocPlan.grants[{}].uuid", plan.grants, _GRANT_UUID)
    if len(granted_uuids) != len(plan.grants):
        # raises, naming the grants
        _check_unique("AllocPlan.grants", [g.uuid for g in plan.grants])
    for i, grant in enumerate(plan.grants):
        if grant.uuid not in needing:
            raise PlanRejected(
                f"AllocPlan.grants[{i}].uuid",
                f"{grant.uuid!r} is not a scheduled request that needs pages",
            )
    left_out = (
        _uuid_set("AllocPlan.not_fitting[{}].uuid", plan.not_fitting, _UUID)
        if plan.not_fitting
        else _NONE_LEFT_OUT
    )
    if len(left_out) != len(plan.not_fitting):
        # raises, naming them
        _check_unique("AllocPlan.not_fitting", [d.uuid for d in plan.not_fitting])
    if not (left_out <= needing and left_out.isdisjoint(granted_uuids)):
        i, uuid = next(
            (i, d.uuid)
            for i, d in enumerate(plan.not_fitting)
            if d.uuid not in needing or d.uuid in granted_uuids
        )
        raise PlanRejected(
            f"AllocPlan.not_fitting[{i}].uuid",
            f"{uuid!r} is not a scheduled request that needs pages, or is also granted",
        )
    if len(left_out) + len(granted_uuids) != len(needing):
        missing = [
            uuid
            for uuid in request.needing.uuids
            if uuid not in left_out and uuid not in granted_uuids
        ]
        raise PlanRejected(
            "AllocPlan.grants",
            f"scheduled requests {missing} need pages and are neither granted them nor left out",
        )
    return left_out


def apply_alloc_plan(target: KvTarget, plan: AllocPlan, request: AllocRequest) -> list[str]:
    """Mutates page tables, the GPU pool, admitted phases (-> RUNNING); returns the served uuids.

    ``request`` is the op request the plan answers, built by :meth:`PlanKvPath.alloc_request` from
    ``target`` just before (it raises KeyError on an unknown scheduled request); a request whose
    snapshot does not match the target's step and free GPU pages is refused as stale. Each request
    it lists as needing pages is granted exactly the pages its tokens need now or left out as not
    fitting, and no other request is named; the rest of the batch is served as it is."""
    snapshot, state, requests = request.snapshot, target.state, target.state.requests
    if snapshot.step != state.step or snapshot.num_free_gpu_pages != target.gpu_kv.pages.num_free:
        raise PlanRejected(
            "AllocRequest.snapshot",
            f"stale: step {snapshot.step} with {snapshot.num_free_gpu_pages} "
            f"free GPU pages, the target is at step {state.step} with "
            f"{target.gpu_kv.pages.num_free}",
        )
    needing = set(request.needing.uuids)
    if (
        plan.not_fitting
        or len(needing) != len(plan.grants)
        or tuple(map(_GRANT_UUID, plan.grants)) != request.needing.uuids
    ):
        # else: each needing request granted, once, in order
        left_out = _check_left_out(plan, request, needing)
    else:
        left_out = _NONE_LEFT_OUT
    page_size, admissible = target.cache_config.page_size, _ADMISSIBLE
    up = page_size - 1
    # field names are formatted only on the error paths
    for i, (uuid, new_page_ids) in enumerate(plan.grants):
        req = requests.get(uuid)
        if req is None or req.phase not in admissible:
            # raises, naming the problem
            _request(target, f"AllocPlan.grants[{i}].uuid", uuid, admissible)
        need = (req.num_tokens + up) // page_size - len(req.gpu_page_ids)  # as the manager counts
        if type(new_page_ids) is not tuple:
            _reject_ids(f"AllocPlan.grants[{i}].new_page_ids", new_page_ids)
        if len(new_page_ids) != (need if need > 0 else 0):
            raise PlanRejected(
                f"AllocPlan.grants[{i}].new_page_ids",
                f"{len(new_page_ids)} pages granted, {max(0, need)} needed",
            )
    if plan.grants:
        # grants are (uuid, ids) pairs
        _take_pages(target.gpu_kv, plan.grants, "AllocPlan.grants[{}].new_page_ids")
    for uuid, new_page_ids in plan.grants:
        req = state.edit(uuid)
        req.gpu_page_ids += new_page_ids
        req.phase = RUNNING
    batch = request.batch
    return [uuid for uuid in batch if uuid not in left_out] if left_out else list(batch)
