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

Prefix caching (when the geometry's ``prefix_caching`` is on; the bookkeeping is the page pool's)::

    digests    a full prompt page is known by a digest of its tokens chained to the pages before
               (``prefix_digests``); the worker indexes a page under its digest once its K/V
               are written (the flush), unless another page holds that digest already
    hits       a request admitted by alloc takes the pages holding the longest cached prefix of
               its prompt digests, shared (one more holder each), and computes only the rest:
               full prompt pages only, stopping one token short of its last (always computed,
               for its logits), so a shared page is never written and the partial last page is
               private. A hit's pages count against the free pages only where they are cache
               entries (free); a hit is cut where an earlier request of the same plan took the
               page as a new page
    free       a page no request holds joins the free-queue tail keeping its digest: a cache
               entry, counted free (reclaimable) and reused least recently freed first; a new
               page taken from the head drops the digest of the entry it was
    evict      a victim's pages are all copied to host (shared ones included) and its holds
               dropped: only pages no other request holds become free (and count so)
    migrate    a load re-links the pages holding the longest cached prefix of the request's
               prompt digests instead of loading them (their host pages are freed at once), and
               loads the rest into new pages; the cost is the new pages and the cache entries
               it re-links. Cache entries are never demoted to host

Each ``plan_*`` method reads one op request and returns a plan; it mutates nothing, neither the
request nor the backends, and keeps nothing after ``__init__``. Page ids come from the backends'
``peek_free_pages`` (a read): a plan names the ids the next allocation would get. The worker
applies the plan (``appliers``). The legacy path (``legacy``) implements the same decisions
independently, as compare mode's reference.

Every branch carries a ``# decision:`` comment naming the outcomes it decides, as ids of the
catalog in ``batchgen.shadow.coverage`` (a test keeps the two in step).
"""

from __future__ import annotations

import itertools
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
        holders = dict(req.shared_page_holders)
        chosen: list[tuple[int, Destination]] = []
        # youngest first (columns keep arrival order); decision: evict.multiple_victims
        for i in reversed(range(len(running.uuids))):
            # decision: evict.none.no_running, evict.none.above_watermark, evict.none.at_watermark,
            # evict.stop.above_watermark, evict.stop.at_watermark, evict.all_running
            if free_gpu - demand >= watermark:
                break
            num_pages = len(running.gpu_page_ids[i])
            demand -= pages_needed(running.num_tokens[i], page_size) - num_pages
            # decision: evict.shared_page_kept (a page another request holds stays, not freed)
            free_gpu += drop_holds(running.gpu_page_ids[i], holders)
            if free_host >= num_pages:  # decision: evict.to_host, evict.to_host.exact_fit
                free_host -= num_pages
                chosen.append((i, Destination.HOST))
            else:  # decision: evict.to_recompute.host_full
                chosen.append((i, Destination.RECOMPUTE))
        host_ids = _peek(self._host_kv, snapshot.num_free_host_pages - free_host)
        return EvictionPlan(_victims(running, chosen, host_ids))

    def plan_migration(self, req: MigrationRequest) -> MigrationPlan:
        snapshot, swapped = req.snapshot, req.swapped
        free = _FreePages(self._gpu_kv, snapshot.num_free_gpu_pages, req.cache_entries)
        demand = req.decode_demand
        num_active = len(req.running.uuids) + req.num_loading
        watermark = eviction_watermark_pages(snapshot)
        loads: list[LoadStart] = []
        # oldest first; decision: migrate.none.nothing_swapped, migrate.all_loaded
        for i, swapped_step in enumerate(swapped.swapped_steps):
            host_page_ids = swapped.host_page_ids[i]
            if swapped_step == snapshot.step:  # decision: migrate.skip.swapped_this_step
                continue
            if num_active >= snapshot.geometry.max_num_seqs:  # decision: migrate.stop.max_num_seqs
                break
            relinked = free.hits(swapped.cached_pages[i] if swapped.cached_pages else ())
            num_new = len(host_page_ids) - len(relinked)
            # decision: migrate.stop.watermark, migrate.load, migrate.load.exact_fit
            if free.num_free - demand - num_new - free.sharing_cost(relinked) < watermark:
                break
            free.share(relinked)  # decision: migrate.relink
            new = free.take_new(num_new)
            loads.append(LoadStart(swapped.uuids[i], tuple(new), host_page_ids, tuple(relinked)))
            num_active += 1
        return MigrationPlan(tuple(loads))

    def plan_allocation(self, req: AllocRequest) -> AllocPlan:
        needing, page_size = req.needing, req.snapshot.geometry.page_size
        free = _FreePages(self._gpu_kv, req.snapshot.num_free_gpu_pages, req.cache_entries)
        cached = req.cached_pages or itertools.repeat(())
        grants: list[PageGrant] = []
        not_fitting: list[DoesNotFit] = []
        # batch order; decision: alloc.none_needed, alloc.new_page, alloc.admit
        for uuid, num_tokens, page_ids, prefix in zip(
            needing.uuids, needing.num_tokens, needing.gpu_page_ids, cached
        ):
            # decision: alloc.prefix_hit, alloc.prefix_hit.cache_entry
            hits = free.hits(prefix)
            need = max(0, pages_needed(num_tokens, page_size) - len(page_ids) - len(hits))
            cost = need + free.sharing_cost(hits)
            if cost > free.num_free:  # decision: alloc.does_not_fit, alloc.exact_fit
                not_fitting.append(DoesNotFit(uuid, cost, free.num_free))
                continue  # decision: alloc.fits_after_does_not_fit (a later one may fit)
            free.share(hits)
            grants.append(PageGrant(uuid, tuple(free.take_new(need)), tuple(hits)))
        return AllocPlan(tuple(grants), tuple(not_fitting))


class _FreePages:
    """The GPU free queue as one plan uses it up: new pages from the head, passing over the cache
    entries the plan shares. Reads the backend's queue, never mutates it."""

    def __init__(self, gpu_kv: GpuKvBackend, num_free: int, cache_entries: tuple[int, ...]):
        self._queue = gpu_kv.free_page_ids()
        self.num_free = num_free  # what is left
        self._cache_entries = set(cache_entries)  # free pages the plan may share
        self._new: set[int] = set()  # pages handed out as new
        self._shared: set[int] = set()  # cache entries the plan shares

    def hits(self, cached_pages: tuple[int, ...]) -> tuple[int, ...]:
        """``cached_pages`` (a cached prefix, in order) cut at the first one this plan handed out
        as new (that took its digest)."""
        cut = next((i for i, p in enumerate(cached_pages) if p in self._new), len(cached_pages))
        return cached_pages[:cut]

    def sharing_cost(self, page_ids: tuple[int, ...]) -> int:
        """The free pages sharing ``page_ids`` takes: cache entries the plan has not shared."""
        return sum(1 for p in page_ids if p in self._cache_entries)

    def share(self, page_ids: tuple[int, ...]) -> None:
        """Mutates the plan's view: the cache entries among ``page_ids`` are no longer free."""
        taken = [p for p in page_ids if p in self._cache_entries]
        self.num_free -= len(taken)
        self._cache_entries.difference_update(taken)
        self._shared.update(taken)

    def take_new(self, n: int) -> list[int]:
        """The next ``n`` free pages, past those shared. Mutates the plan's view."""
        page_ids = []
        while len(page_ids) < n:  # decision: alloc.admit, alloc.new_page, migrate.load
            page_id = next(self._queue)
            if page_id not in self._shared:  # decision: alloc.prefix_hit.cache_entry
                page_ids.append(page_id)
        self._new.update(page_ids)
        self.num_free -= n
        return page_ids


def drop_holds(page_ids: tuple[int, ...], holders: dict[int, int]) -> int:
    """How many of ``page_ids`` become free when their holder lets go: those no one else holds
    (``holders``: counts above one, as the plan has dropped them so far). Mutates ``holders``."""
    freed = 0
    for page_id in page_ids:  # decision: evict.shared_page_kept
        count = holders.get(page_id, 1)
        if count == 1:  # decision: evict.shared_page_kept
            freed += 1
        else:
            holders[page_id] = count - 1
    return freed


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
