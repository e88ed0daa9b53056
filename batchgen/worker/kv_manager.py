"""KVCacheManager: the stateless plan layer of the KV ops.

Each ``plan_*`` method reads one op request (a frozen snapshot plus the op's
input) and returns a plan; it mutates nothing, neither the request nor the
backends, and keeps no state after ``__init__``. The only thing it asks a
backend is which page ids the next allocation would get (``peek_free_pages``,
a read). The worker applies the plan (``kv_apply``).

The decisions are the legacy path's, by contract (see ``legacy_kv``'s module
docstring): watermark, youngest-first eviction, oldest-first migration,
all-or-nothing page grants per request, retry-then-recompute on failed loads.
"""

from __future__ import annotations

import math

from batchgen.worker.kv_backends import GpuKvBackend, HostKvBackend
from batchgen.worker.kv_plans import (
    AllocPlan, AllocRequest, Destination, DoesNotFit, EvictionPlan, EvictionRequest, KvSnapshot,
    LoadStart, MigrationPlan, MigrationRequest, PageGrant, PollAction, PollPlan, PollRequest,
    PollStep, ReleasePlan, ReleaseRequest, RequestKvView, Victim,
)

RUNNING, SWAPPED = "running", "swapped"


def eviction_watermark_pages(snapshot: KvSnapshot) -> int:
    """GPU pages to keep free; a pure function of the snapshot."""
    geometry = snapshot.geometry
    return math.ceil(geometry.watermark * geometry.num_gpu_pages)


def decode_demand(view: RequestKvView, page_size: int) -> int:
    """GPU pages the request needs so that all its tokens have a slot."""
    return -(-view.num_tokens // page_size) - len(view.gpu_page_ids)


def load_failure_reason(error: str) -> str:
    """The finish reason of a request failed by its load."""
    return f"load failed: {error}"


def _split(page_ids: list[int], sizes: list[int]) -> list[tuple[int, ...]]:
    out, start = [], 0
    for size in sizes:
        out.append(tuple(page_ids[start:start + size]))
        start += size
    return out


class KVCacheManager:
    def __init__(self, *, gpu_kv: GpuKvBackend, host_kv: HostKvBackend):
        self._gpu_kv = gpu_kv
        self._host_kv = host_kv

    def plan_poll(self, req: PollRequest) -> PollPlan:
        views = {view.uuid: view for view in req.snapshot.requests}
        geometry = req.snapshot.geometry
        steps = []
        for outcome in req.outcomes:
            if outcome.error is None:
                steps.append(PollStep(outcome.uuid, PollAction.COMPLETE))
            elif views[outcome.uuid].num_load_retries < geometry.max_load_retries:
                steps.append(PollStep(outcome.uuid, PollAction.RETRY))
            elif geometry.load_failure == "fail":
                steps.append(PollStep(outcome.uuid, PollAction.FAIL, load_failure_reason(outcome.error)))
            else:
                steps.append(PollStep(outcome.uuid, PollAction.RECOMPUTE))
        return PollPlan(tuple(steps))

    def plan_release(self, req: ReleaseRequest) -> ReleasePlan:
        return ReleasePlan(released=req.uuids, drop_pending_append_ids=req.uuids)

    def plan_eviction(self, req: EvictionRequest) -> EvictionPlan:
        snapshot = req.snapshot
        page_size = snapshot.geometry.page_size
        running = [v for v in snapshot.requests if v.phase == RUNNING]  # oldest first: snapshots keep arrival order
        demand = sum(-(-v.num_tokens // page_size) - len(v.gpu_page_ids) for v in running)
        free_gpu, free_host = snapshot.num_free_gpu_pages, snapshot.num_free_host_pages
        watermark = eviction_watermark_pages(snapshot)
        chosen: list[tuple[RequestKvView, Destination]] = []
        while running and free_gpu - demand < watermark:
            victim = running.pop()
            demand -= decode_demand(victim, page_size)
            num_pages = len(victim.gpu_page_ids)
            free_gpu += num_pages
            if free_host >= num_pages:
                free_host -= num_pages
                chosen.append((victim, Destination.HOST))
            else:
                chosen.append((victim, Destination.RECOMPUTE))
        if not chosen:
            return EvictionPlan(())
        host_sizes = [len(v.gpu_page_ids) if d is Destination.HOST else 0 for v, d in chosen]
        host_ids = _split(self._host_kv.peek_free_pages(sum(host_sizes)), host_sizes)
        return EvictionPlan(tuple(Victim(v.uuid, d, v.gpu_page_ids, h) for (v, d), h in zip(chosen, host_ids)))

    def plan_migration(self, req: MigrationRequest) -> MigrationPlan:
        snapshot = req.snapshot
        page_size = snapshot.geometry.page_size
        running, swapped = [], []  # each oldest first: snapshots keep arrival order
        for view in snapshot.requests:
            if view.phase == RUNNING:
                running.append(view)
            elif view.phase == SWAPPED:
                swapped.append(view)
        if not swapped:
            return MigrationPlan(())
        demand = sum(-(-v.num_tokens // page_size) - len(v.gpu_page_ids) for v in running)
        num_active = len(running) + snapshot.num_loading
        free = snapshot.num_free_gpu_pages
        watermark = eviction_watermark_pages(snapshot)
        chosen: list[RequestKvView] = []
        for view in swapped:
            if view.swapped_step == snapshot.step:
                continue
            num_pages = len(view.host_page_ids)
            if num_active >= snapshot.geometry.max_num_seqs or free - demand - num_pages < watermark:
                break
            chosen.append(view)
            num_active += 1
            free -= num_pages
        if not chosen:
            return MigrationPlan(())
        sizes = [len(v.host_page_ids) for v in chosen]
        gpu_ids = _split(self._gpu_kv.peek_free_pages(sum(sizes)), sizes)
        return MigrationPlan(tuple(LoadStart(v.uuid, g, v.host_page_ids) for v, g in zip(chosen, gpu_ids)))

    def plan_allocation(self, req: AllocRequest) -> AllocPlan:
        snapshot = req.snapshot
        page_size = snapshot.geometry.page_size
        free = snapshot.num_free_gpu_pages
        served: list[tuple[str, int]] = []
        not_fitting = []
        views = {view.uuid: view for view in snapshot.requests}  # only requests that may need pages
        for view in filter(None, map(views.get, req.batch)):
            need = -(-view.num_tokens // page_size) - len(view.gpu_page_ids)
            if need <= 0:
                continue
            if need > free:
                not_fitting.append(DoesNotFit(view.uuid, need, free))
                continue
            served.append((view.uuid, need))
            free -= need
        page_ids = self._gpu_kv.peek_free_pages(snapshot.num_free_gpu_pages - free)
        grants, start = [], 0
        for uuid, need in served:
            grants.append(PageGrant(uuid, tuple(page_ids[start:start + need])))
            start += need
        return AllocPlan(tuple(grants), tuple(not_fitting))
