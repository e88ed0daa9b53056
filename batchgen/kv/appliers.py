"""Applying plans: one function per plan type, its check first (``plan_checks``), then the
mutation. The pending append tensors stay the worker's: a plan only names which to drop.
"""

from __future__ import annotations

from collections.abc import Mapping

from batchgen.kv.plan_checks import (
    check_alloc_plan,
    check_eviction_plan,
    check_migration_plan,
    check_poll_plan,
    check_release_plan,
    grant_pages,
    take_pages,
)
from batchgen.kv.plans import (
    AllocPlan,
    AllocRequest,
    Destination,
    EvictionPlan,
    MigrationPlan,
    PollAction,
    PollPlan,
    ReleasePlan,
)
from batchgen.kv.target import KvTarget
from batchgen.state import Phase


def apply_poll_plan(target: KvTarget, plan: PollPlan, observed: Mapping[str, str | None]) -> None:
    """Mutates phases, page tables, pools (host frees, retried loads), stats."""
    check_poll_plan(target, plan, observed)
    stats = target.state.stats
    for uuid, action, reason in zip(plan.uuids, plan.actions, plan.reasons):
        req = target.state.edit(uuid)
        if action is PollAction.COMPLETE:
            req.load_handle = None
            req.load_started_step = None
            target.host_kv.release_pages(uuid)
            req.host_page_ids = ()
            req.phase = Phase.RUNNING
            continue
        stats.load_failures += 1
        if action is PollAction.RETRY:
            req.num_load_retries += 1
            req.load_handle = target.host_kv.load_to_gpu_async(uuid, list(req.load_page_ids()))
            req.load_started_step = target.state.step
            stats.loads += 1
            continue
        req.drain_load()  # a timed-out load's copy may still be writing into the pages freed next
        target.gpu_kv.release_pages(uuid)
        target.host_kv.release_pages(uuid)
        req.gpu_page_ids, req.host_page_ids = (), ()
        req.num_cached_tokens = 0
        req.num_load_retries = 0
        req.load_started_step = None
        if action is PollAction.FAIL:
            req.phase, req.finish_reason = Phase.FAILED, reason
        else:
            req.phase = Phase.WAITING
            stats.recompute_preemptions += 1


def apply_release_plan(target: KvTarget, plan: ReleasePlan) -> None:
    """Mutates requests (removed), outputs, both pools, pending appends."""
    check_release_plan(target, plan)
    for uuid in plan.released:
        req = target.state.remove(uuid)
        req.drain_load()
        target.gpu_kv.release_pages(uuid)
        target.host_kv.release_pages(uuid)
        target.state.outputs[uuid] = req.to_output()
    for uuid in plan.drop_pending_append_ids:
        target.drop_pending_append(uuid)


def apply_eviction_plan(target: KvTarget, plan: EvictionPlan) -> None:
    """Mutates victims (phase, page tables), both pools (store copies, pages), stats."""
    check_eviction_plan(target, plan)
    if not plan.victims:
        return
    grants = [(v.uuid, v.host_page_ids) for v in plan.victims]
    take_pages(target.host_kv, grants, "EvictionPlan.victims[{}].host_page_ids")
    stats = target.state.stats
    for victim in plan.victims:
        req = target.state.edit(victim.uuid)
        if victim.destination is Destination.HOST:
            target.host_kv.store_from_gpu(victim.uuid, list(req.gpu_page_ids))
            req.host_page_ids = victim.host_page_ids
            req.phase = Phase.SWAPPED
            req.swapped_step = target.state.step
            stats.evictions += 1
        else:
            req.num_cached_tokens = 0
            req.phase = Phase.WAITING
            stats.recompute_preemptions += 1
        target.gpu_kv.release_pages(victim.uuid)
        req.gpu_page_ids = ()


def apply_migration_plan(target: KvTarget, plan: MigrationPlan) -> None:
    """Mutates phases (-> LOADING), page tables, both pools (re-linked pages shared, their host
    pages freed), stats; starts async loads."""
    check_migration_plan(target, plan)
    if not plan.loads:
        return
    grants = [(load.uuid, load.shared_page_ids, load.gpu_page_ids) for load in plan.loads]
    grant_pages(target.gpu_kv, grants, "MigrationPlan.loads[{}].{}", new="gpu_page_ids")
    for load in plan.loads:
        req = target.state.edit(load.uuid)
        if load.shared_page_ids:
            target.host_kv.release_first_pages(load.uuid, len(load.shared_page_ids))
            req.host_page_ids = load.host_page_ids[len(load.shared_page_ids) :]
        req.gpu_page_ids = load.shared_page_ids + load.gpu_page_ids
        req.load_handle = target.host_kv.load_to_gpu_async(load.uuid, list(load.gpu_page_ids))
        req.load_started_step = target.state.step
        req.phase = Phase.LOADING
        req.num_load_retries = 0
        target.state.stats.loads += 1


def apply_alloc_plan(target: KvTarget, plan: AllocPlan, request: AllocRequest) -> list[str]:
    """Mutates page tables, the GPU pool, admitted phases (-> RUNNING); returns the served uuids:
    the batch, in order, less the requests left out.

    ``request`` is the op request the plan answers (``PlanKvPath.alloc_request``); one whose
    snapshot is not of the target's step and free GPU pages is refused as stale.
    """
    check_alloc_plan(target, plan, request)
    grants = [(grant.uuid, grant.shared_page_ids, grant.new_page_ids) for grant in plan.grants]
    grant_pages(target.gpu_kv, grants, "AllocPlan.grants[{}].{}", new="new_page_ids")
    caching, page_size = target.cache_config.enable_prefix_caching, target.cache_config.page_size
    for grant in plan.grants:
        req = target.state.edit(grant.uuid)
        if caching and req.phase is not Phase.RUNNING:
            _count_lookup(target, grant.uuid, len(grant.shared_page_ids) * page_size)
        req.gpu_page_ids += grant.shared_page_ids + grant.new_page_ids
        req.phase = Phase.RUNNING
    if not plan.not_fitting:
        return list(request.batch)
    left_out = {entry.uuid for entry in plan.not_fitting}
    return [uuid for uuid in request.batch if uuid not in left_out]


def _count_lookup(target: KvTarget, uuid: str, num_hit_tokens: int) -> None:
    """Admitted request ``uuid``'s prefix-cache lookup: its cached count starts past the hits,
    and the stats count it. Mutates the request and stats."""
    req = target.state.edit(uuid)
    stats = target.state.stats
    stats.prefix_cache_queries += req.num_tokens
    stats.prefix_cache_hits += num_hit_tokens
    req.num_cached_tokens = num_hit_tokens
    if not req.output_ids:
        req.num_cached_prompt_tokens = num_hit_tokens
