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

from batchgen.kv.backends import GpuKvBackend, HostKvBackend
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
    PageGrant,
    PollAction,
    PollPlan,
    PollRequest,
    ReleasePlan,
    ReleaseRequest,
    Victim,
)

# Enum members as module constants: ``PollAction.X`` is a class attribute lookup of ~0.1 us on
# Python 3.11.
COMPLETE, RETRY, FAIL, RECOMPUTE_LOAD = (
    PollAction.COMPLETE,
    PollAction.RETRY,
    PollAction.FAIL,
    PollAction.RECOMPUTE,
)
TO_HOST, TO_RECOMPUTE = Destination.HOST, Destination.RECOMPUTE
# plans are immutable: the empty ones are shared
NO_VICTIMS, NO_LOADS = EvictionPlan(()), MigrationPlan(())


def eviction_watermark_pages(snapshot: KvSnapshot) -> int:
    """GPU pages to keep free; a pure function of the snapshot (``config.watermark_pages``'s rule:
    the plan layer imports nothing outside its plans and backend Protocols)."""
    geometry = snapshot.geometry
    return math.ceil(geometry.watermark * geometry.num_gpu_pages)


def load_failure_reason(error: str) -> str:
    """The finish reason of a request failed by its load."""
    return f"load failed: {error}"


class KVCacheManager:
    def __init__(self, *, gpu_kv: GpuKvBackend, host_kv: HostKvBackend):
        self._gpu_kv = gpu_kv
        self._host_kv = host_kv

    def plan_poll(self, req: PollRequest) -> PollPlan:
        uuids, errors = req.uuids, req.errors
        # every load landed: all complete, no reasons (errors is all None)
        if errors.count(None) == len(errors):
            return PollPlan.new(uuids, (COMPLETE,) * len(uuids), errors)
        geometry = req.snapshot.geometry
        actions, reasons = [], []
        for error, retries in zip(errors, req.num_load_retries, strict=True):
            reason = None
            if error is None:
                action = COMPLETE
            elif retries < geometry.max_load_retries:
                action = RETRY
            elif geometry.load_failure == "fail":
                action, reason = FAIL, load_failure_reason(error)
            else:
                action = RECOMPUTE_LOAD
            actions.append(action)
            reasons.append(reason)
        return PollPlan.new(uuids, tuple(actions), tuple(reasons))

    def plan_release(self, req: ReleaseRequest) -> ReleasePlan:
        return ReleasePlan.new(released=req.uuids, drop_pending_append_ids=req.uuids)

    def plan_eviction(self, req: EvictionRequest) -> EvictionPlan:
        snapshot, running = req.snapshot, req.running
        page_size = snapshot.geometry.page_size
        if not running.uuids:
            return NO_VICTIMS
        demand = req.decode_demand
        free_gpu, free_host = snapshot.num_free_gpu_pages, snapshot.num_free_host_pages
        watermark = eviction_watermark_pages(snapshot)
        if free_gpu - demand >= watermark:
            return NO_VICTIMS  # the watermark holds
        uuids, num_tokens, gpu_page_ids = running.uuids, running.num_tokens, running.gpu_page_ids
        up = page_size - 1
        chosen: list[tuple[int, Destination]] = []
        # youngest first: the columns keep arrival order
        for i in reversed(range(len(running.uuids))):
            num_pages = len(gpu_page_ids[i])
            # the victim's share of the demand
            demand -= (num_tokens[i] + up) // page_size - num_pages
            free_gpu += num_pages
            if free_host >= num_pages:
                free_host -= num_pages
                chosen.append((i, TO_HOST))
            else:
                chosen.append((i, TO_RECOMPUTE))
            if free_gpu - demand >= watermark:
                break
        # sliced per victim
        host_ids = tuple(self._host_kv.peek_free_pages(snapshot.num_free_host_pages - free_host))
        victims, start = [], 0
        for i, destination in chosen:
            page_ids = gpu_page_ids[i]
            if destination is TO_HOST:
                end = start + len(page_ids)
                victims.append(Victim.new(uuids[i], TO_HOST, page_ids, host_ids[start:end]))
                start = end
            else:
                victims.append(Victim.new(uuids[i], TO_RECOMPUTE, page_ids, ()))
        return EvictionPlan.new(tuple(victims))

    def plan_migration(self, req: MigrationRequest) -> MigrationPlan:
        snapshot, swapped = req.snapshot, req.swapped
        if not swapped.uuids:
            return NO_LOADS
        demand = req.decode_demand
        num_active = len(req.running.uuids) + req.num_loading
        free = snapshot.num_free_gpu_pages
        watermark = eviction_watermark_pages(snapshot)
        chosen: list[int] = []
        for i, swapped_step in enumerate(swapped.swapped_steps):  # oldest first: arrival order
            if swapped_step == snapshot.step:
                continue
            num_pages = len(swapped.host_page_ids[i])
            if (
                num_active >= snapshot.geometry.max_num_seqs
                or free - demand - num_pages < watermark
            ):
                break
            chosen.append(i)
            num_active += 1
            free -= num_pages
        if not chosen:
            return NO_LOADS
        # sliced per load
        gpu_ids = tuple(self._gpu_kv.peek_free_pages(snapshot.num_free_gpu_pages - free))
        loads, start = [], 0
        for i in chosen:
            host_page_ids = swapped.host_page_ids[i]
            end = start + len(host_page_ids)
            loads.append(LoadStart.new(swapped.uuids[i], gpu_ids[start:end], host_page_ids))
            start = end
        return MigrationPlan.new(tuple(loads))

    def plan_allocation(self, req: AllocRequest) -> AllocPlan:
        snapshot, needing = req.snapshot, req.needing
        page_size = snapshot.geometry.page_size
        up = page_size - 1
        free = snapshot.num_free_gpu_pages
        served: list[tuple[str, int]] = []
        not_fitting = []
        # batch order
        for uuid, num_tokens, page_ids in zip(
            needing.uuids, needing.num_tokens, needing.gpu_page_ids
        ):
            need = (num_tokens + up) // page_size - len(page_ids)  # pages its tokens lack
            if need < 0:
                need = 0  # admitted into the pages it holds
            if need > free:
                not_fitting.append(DoesNotFit.new(uuid, need, free))
                continue
            served.append((uuid, need))
            free -= need
        if not served:
            return AllocPlan.new((), tuple(not_fitting))
        # sliced per grant
        page_ids = tuple(self._gpu_kv.peek_free_pages(snapshot.num_free_gpu_pages - free))
        grants, start = [], 0
        for uuid, need in served:
            grants.append(PageGrant(uuid, page_ids[start : start + need]))
            start += need
        return AllocPlan.new(tuple(grants), tuple(not_fitting))
