"""The plan path on the worker side: build an op request, ask the manager, apply the plan.

Each op reads only its scope, as columns (``plans``), builds its request from the target as it
is at that moment, and keeps nothing for the next op: the path is stateless between ops. Its
``last_request`` and ``last_plan`` say what the last op read and decided, for an observer
(compare mode's replay context and decision coverage); the path never reads them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from batchgen.config import DTYPE_SIZES
from batchgen.kv.appliers import (
    apply_alloc_plan,
    apply_eviction_plan,
    apply_migration_plan,
    apply_poll_plan,
    apply_release_plan,
)
from batchgen.kv.manager import KVCacheManager
from batchgen.kv.plans import (
    AllocRequest,
    EvictionRequest,
    KvGeometry,
    KvSnapshot,
    MigrationRequest,
    PageColumns,
    PollRequest,
    ReleaseRequest,
    SwappedColumns,
    decode_demand,
)
from batchgen.kv.prefix_digests import reusable_pages
from batchgen.kv.target import KvTarget
from batchgen.state import Phase, RequestState

# op -> (the method every KV path has, this path's request builder, the manager's planner)
OP_METHODS = {
    "poll": ("poll", "poll_request", "plan_poll"),
    "release": ("release", "release_request", "plan_release"),
    "evict": ("evict", "eviction_request", "plan_eviction"),
    "migrate": ("migrate", "migration_request", "plan_migration"),
    "alloc": ("allocate", "alloc_request", "plan_allocation"),
}


def geometry_of(target: KvTarget) -> KvGeometry:
    """The frozen geometry the manager plans with, from the target's configs. Pure."""
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
        prefix_caching=cache.enable_prefix_caching,
    )


def page_columns(scope: Sequence[RequestState]) -> PageColumns:
    """The uuids, token counts and GPU page tables of ``scope``, as columns. Pure."""
    # each column from a list: a generator would add a frame per column
    return PageColumns(
        tuple([r.uuid for r in scope]),
        tuple([r.num_tokens for r in scope]),
        tuple([r.gpu_page_ids for r in scope]),
    )


def swapped_columns(
    scope: Sequence[RequestState], cached_pages: tuple[tuple[int, ...], ...] = ()
) -> SwappedColumns:
    """The uuids, host page tables and swap steps of ``scope``, as columns, and the pages holding
    each one's cached prompt prefix (prefix caching). Pure."""
    return SwappedColumns(
        tuple([r.uuid for r in scope]),
        tuple([r.host_page_ids for r in scope]),
        tuple([r.swapped_step for r in scope]),
        cached_pages,
    )


def cached_prefixes(
    gpu_kv, scope: Sequence[tuple[str, ...]]
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """For each digest tuple of ``scope``, the GPU pages holding its longest cached prefix, and
    which of all those pages are free (cache entries). Reads the pool."""
    pages = tuple(tuple(gpu_kv.cached_prefix(digests)) if digests else () for digests in scope)
    entries = {p for prefix in pages for p in prefix if not gpu_kv.holders(p)}
    return pages, tuple(sorted(entries))


class PlanKvPath:
    """The KV ops through :class:`KVCacheManager` plans, applied to ``target``."""

    name = "plan"

    def __init__(self, target: KvTarget, geometry: KvGeometry | None = None):
        """``geometry``: the target's (``geometry_of``), when the caller has it already."""
        self.target = target
        self.manager = KVCacheManager(gpu_kv=target.gpu_kv, host_kv=target.host_kv)
        self.geometry = geometry or geometry_of(target)
        self.last_request = None  # the last op's request, set as soon as it is built
        self.last_plan = None  # the last op's plan, set once the manager made it

    def snapshot(self) -> KvSnapshot:
        gpu, host = self.target.gpu_kv, self.target.host_kv
        return KvSnapshot(
            self.target.state.step, self.geometry, gpu.free_pages(), host.free_pages()
        )

    # ---- op requests: what each op reads (pure) --------------------------------------------
    def poll_request(self, observed: Mapping[str, str | None]) -> PollRequest:
        requests = self.target.state.requests
        retries = tuple(requests[uuid].num_load_retries for uuid in observed)
        return PollRequest(self.snapshot(), tuple(observed), tuple(observed.values()), retries)

    def release_request(self, uuids: Sequence[str]) -> ReleaseRequest:
        return ReleaseRequest(self.snapshot(), tuple(uuids))

    def eviction_request(self) -> EvictionRequest:
        running = page_columns(self._in_phase(Phase.RUNNING))
        demand = decode_demand(running, self.geometry.page_size)
        shared = ()
        if self.geometry.prefix_caching:
            shared = tuple(sorted(self.target.gpu_kv.shared_pages().items()))
        return EvictionRequest(self.snapshot(), running, demand, shared)

    def migration_request(self) -> MigrationRequest:
        """The SWAPPED requests, and the RUNNING ones with the LOADING count when any is
        SWAPPED (with nothing SWAPPED there is nothing to decide, and nothing more to read)."""
        swapped = self._in_phase(Phase.SWAPPED)
        if not swapped:
            return MigrationRequest(self.snapshot(), swapped_columns(()), page_columns(()), 0, 0)
        running = page_columns(self._in_phase(Phase.RUNNING))
        demand = decode_demand(running, self.geometry.page_size)
        num_loading = len(self._in_phase(Phase.LOADING))
        cached, entries = (), ()
        if self.geometry.prefix_caching:
            digests = [r.prompt_digests for r in swapped]
            cached, entries = cached_prefixes(self.target.gpu_kv, digests)
        columns = swapped_columns(swapped, cached)
        return MigrationRequest(self.snapshot(), columns, running, demand, num_loading, entries)

    def alloc_request(self, batch: Sequence[str]) -> AllocRequest:
        """The scheduled requests the op must act on: those whose tokens run past their last
        page, or not RUNNING yet (admitted by their grant). The rest are served as they are."""
        requests, page_size = self.target.state.requests, self.geometry.page_size
        scheduled = [requests[uuid] for uuid in batch]
        needing = [
            req
            for req in scheduled
            if req.phase is not Phase.RUNNING or req.num_tokens > len(req.gpu_page_ids) * page_size
        ]
        cached, entries = (), ()
        if self.geometry.prefix_caching:
            digests = [_reusable_digests(r, page_size) for r in needing]
            cached, entries = cached_prefixes(self.target.gpu_kv, digests)
        return AllocRequest(self.snapshot(), page_columns(needing), tuple(batch), cached, entries)

    def _in_phase(self, phase: Phase) -> list[RequestState]:
        return [r for r in self.target.state.requests.values() if r.phase is phase]

    # ---- the KV ops (the interface every path has) ------------------------------------------
    def poll(self, observed: Mapping[str, str | None]) -> None:
        plan = self._plan(self.poll_request(observed), self.manager.plan_poll)
        apply_poll_plan(self.target, plan, observed)

    def release(self, uuids: Sequence[str]) -> None:
        plan = self._plan(self.release_request(uuids), self.manager.plan_release)
        apply_release_plan(self.target, plan)

    def evict(self) -> None:
        apply_eviction_plan(
            self.target, self._plan(self.eviction_request(), self.manager.plan_eviction)
        )

    def migrate(self) -> None:
        plan = self._plan(self.migration_request(), self.manager.plan_migration)
        apply_migration_plan(self.target, plan)

    def allocate(self, batch: Sequence[str]) -> list[str]:
        request = self.alloc_request(batch)
        return apply_alloc_plan(
            self.target, self._plan(request, self.manager.plan_allocation), request
        )

    def _plan(self, request, plan_op):
        """``plan_op(request)``, with the request and plan noted as the last op's. Mutates
        ``last_request`` and ``last_plan``."""
        self.last_request, self.last_plan = request, None
        self.last_plan = plan_op(request)
        return self.last_plan


def _reusable_digests(req: RequestState, page_size: int) -> tuple[str, ...]:
    """The prompt digests ``req`` may take from the cache if admitted now; none when RUNNING
    already (``reusable_pages``). Pure."""
    if req.phase is Phase.RUNNING:
        return ()
    return req.prompt_digests[: reusable_pages(len(req.prompt_digests), req.num_tokens, page_size)]
