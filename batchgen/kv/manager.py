"""KVCacheManager: the stateless plan layer of the KV ops, and the KV policy, written once.

The policy (every other description of it points here)::

    watermark  keep W = ceil(watermark x num_gpu_pages) GPU pages free
    demand     D = the pages RUNNING requests lack for all their tokens (decode demand)
    poll       a landed load: RUNNING, its host pages freed; a failed or timed-out one: retried
               into the same pages while its retries < max_load_retries, then recomputed
               (WAITING), or FAILED when load_failure is "fail"
    release    done requests free both tiers, drop their pending appends, become outputs
    evict      while free - D < W: take the youngest RUNNING request (highest arrival index);
               store its KV to host if the host pool has its page count free, else drop it for
               recompute; its pages free up and its share of D leaves with it
    migrate    SWAPPED requests oldest first, skipping those swapped this step: start a load
               into new GPU pages while free - D - pages >= W and RUNNING + LOADING (loads just
               started included) < max_num_seqs; stop at the first that does not
    alloc      scheduled requests in batch order: each gets pages for all its tokens if they
               fit in what is free, else it is left out of this step (all or nothing per
               request); a later, smaller one may still fit

Each ``plan_*`` method reads one op request and returns a plan; it mutates nothing, neither the
request nor the backends, and keeps nothing after ``__init__``. Page ids come from the backends'
``peek_free_pages`` (a read): a plan names the ids the next allocation would get. The worker
applies the plan (``appliers``). The legacy path (``legacy``) implements the same decisions
independently, as compare mode's reference.

Every branch carries a ``# decision:`` comment naming the outcomes it decides, as ids of the
catalog in ``batchgen.shadow.coverage`` (a test keeps the two in step).
"""

from __future__ import annotations

import math

from batchgen.kv.backends import GpuKvBackend, HostKvBackend
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
    Victim,
    pages_needed,
)


def eviction_watermark_pages(snapshot: KvSnapshot) -> int:
    """W, the GPU pages to keep free, computed from the snapshot alone. Pure."""
    geometry = snapshot.geometry
    return math.ceil(geometry.watermark * geometry.num_gpu_pages)


def load_failure_reason(error: str) -> str:
    """The finish reason of a request failed by its load. Pure."""
    return f"load failed: {error}"


class KVCacheManager:
    def __init__(self, *, gpu_kv: GpuKvBackend, host_kv: HostKvBackend):
        self._gpu_kv = gpu_kv
        self._host_kv = host_kv

    def plan_poll(self, req: PollRequest) -> PollPlan:
        geometry = req.snapshot.geometry
        # decision: poll.timeout (a load that never completed is decided as a failed one)
        decisions = [
            _poll_decision(error, retries, geometry)
            for error, retries in zip(req.errors, req.num_load_retries, strict=True)
        ]
        actions = tuple(action for action, _ in decisions)
        return PollPlan(req.uuids, actions, tuple(reason for _, reason in decisions))

    def plan_release(self, req: ReleaseRequest) -> ReleasePlan:
        # decision: release.finished, release.failed, release.without_pages,
        # release.with_host_pages, release.with_inflight_load, release.with_pending_append
        return ReleasePlan(released=req.uuids, drop_pending_append_ids=req.uuids)

    def plan_eviction(self, req: EvictionRequest) -> EvictionPlan:
        snapshot, running = req.snapshot, req.running
        page_size = snapshot.geometry.page_size
        watermark = eviction_watermark_pages(snapshot)
        free_gpu, free_host = snapshot.num_free_gpu_pages, snapshot.num_free_host_pages
        demand = req.decode_demand
        chosen: list[tuple[int, Destination]] = []
        # youngest first (columns keep arrival order); decision: evict.multiple_victims
        for i in reversed(range(len(running.uuids))):
            # decision: evict.none.no_running, evict.none.above_watermark, evict.none.at_watermark,
            # evict.stop.above_watermark, evict.stop.at_watermark, evict.all_running
            if free_gpu - demand >= watermark:
                break
            num_pages = len(running.gpu_page_ids[i])
            demand -= pages_needed(running.num_tokens[i], page_size) - num_pages
            free_gpu += num_pages
            if free_host >= num_pages:  # decision: evict.to_host, evict.to_host.exact_fit
                free_host -= num_pages
                chosen.append((i, Destination.HOST))
            else:  # decision: evict.to_recompute.host_full
                chosen.append((i, Destination.RECOMPUTE))
        host_ids = _peek(self._host_kv, snapshot.num_free_host_pages - free_host)
        return EvictionPlan(_victims(running, chosen, host_ids))

    def plan_migration(self, req: MigrationRequest) -> MigrationPlan:
        snapshot, swapped = req.snapshot, req.swapped
        free = snapshot.num_free_gpu_pages
        demand = req.decode_demand
        num_active = len(req.running.uuids) + req.num_loading
        watermark = eviction_watermark_pages(snapshot)
        chosen: list[int] = []
        # oldest first; decision: migrate.none.nothing_swapped, migrate.all_loaded
        for i, swapped_step in enumerate(swapped.swapped_steps):
            num_pages = len(swapped.host_page_ids[i])
            if swapped_step == snapshot.step:  # decision: migrate.skip.swapped_this_step
                continue
            if num_active >= snapshot.geometry.max_num_seqs:  # decision: migrate.stop.max_num_seqs
                break
            # decision: migrate.stop.watermark, migrate.load, migrate.load.exact_fit
            if free - demand - num_pages < watermark:
                break
            chosen.append(i)
            num_active += 1
            free -= num_pages
        gpu_ids = _peek(self._gpu_kv, snapshot.num_free_gpu_pages - free)
        loads, start = [], 0
        for i in chosen:
            host_page_ids = swapped.host_page_ids[i]
            end = start + len(host_page_ids)
            loads.append(LoadStart(swapped.uuids[i], tuple(gpu_ids[start:end]), host_page_ids))
            start = end
        return MigrationPlan(tuple(loads))

    def plan_allocation(self, req: AllocRequest) -> AllocPlan:
        needing, page_size = req.needing, req.snapshot.geometry.page_size
        free = req.snapshot.num_free_gpu_pages
        served: list[tuple[str, int]] = []
        not_fitting: list[DoesNotFit] = []
        # batch order; decision: alloc.none_needed, alloc.new_page, alloc.admit
        for uuid, num_tokens, page_ids in zip(
            needing.uuids, needing.num_tokens, needing.gpu_page_ids
        ):
            need = max(0, pages_needed(num_tokens, page_size) - len(page_ids))
            if need > free:  # decision: alloc.does_not_fit, alloc.exact_fit
                not_fitting.append(DoesNotFit(uuid, need, free))
                continue  # decision: alloc.fits_after_does_not_fit (a later one may fit)
            served.append((uuid, need))
            free -= need
        page_ids = _peek(self._gpu_kv, req.snapshot.num_free_gpu_pages - free)
        grants, start = [], 0
        for uuid, need in served:
            grants.append(PageGrant(uuid, tuple(page_ids[start : start + need])))
            start += need
        return AllocPlan(tuple(grants), tuple(not_fitting))


def _peek(backend: GpuKvBackend | HostKvBackend, num_pages: int) -> list[int]:
    """The ids the backend's next allocation of ``num_pages`` would get (no call for none)."""
    return backend.peek_free_pages(num_pages) if num_pages else []


def _poll_decision(
    error: str | None, num_retries: int, geometry: KvGeometry
) -> tuple[PollAction, str | None]:
    """The action for one observed load, and the failure reason that goes with FAIL. Pure."""
    if error is None:  # decision: poll.complete
        return PollAction.COMPLETE, None
    if num_retries < geometry.max_load_retries:  # decision: poll.retry, poll.retry.last
        return PollAction.RETRY, None
    if geometry.load_failure == "fail":  # decision: poll.fail, poll.recompute
        return PollAction.FAIL, load_failure_reason(error)
    return PollAction.RECOMPUTE, None


def _victims(
    running: PageColumns, chosen: list[tuple[int, Destination]], host_ids: list[int]
) -> tuple[Victim, ...]:
    """The victims ``chosen`` (column index, destination), in order, each HOST one granted the
    next of ``host_ids``. Pure."""
    victims, start = [], 0
    for i, destination in chosen:
        gpu_page_ids = running.gpu_page_ids[i]
        granted = ()
        if destination is Destination.HOST:  # decision: evict.to_host
            granted = tuple(host_ids[start : start + len(gpu_page_ids)])
            start += len(granted)
        victims.append(Victim(running.uuids[i], destination, gpu_page_ids, granted))
    return tuple(victims)
