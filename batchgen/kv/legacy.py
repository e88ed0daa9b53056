"""The legacy KV path: worker methods that mutate state and pools directly.

The reference the plan path is proven against in compare mode, imported only when the gate asks
for it. It makes the decisions of the policy in ``batchgen.kv.manager``'s docstring, written
here again on purpose: it is an independent reference copy and shares no transition code with
the plan path's appliers (compare mode could not see a bug in code both paths ran). It reads and
writes the target's ``state``, ``gpu_kv``, ``host_kv`` and ``pending_appends``: the worker's own
(authoritative) or a fork's (shadow).

Every branch carries a ``# decision:`` comment naming the outcomes it decides (the catalog in
``batchgen.shadow.coverage``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from batchgen.config import pages_needed
from batchgen.kv.prefix_digests import reusable_pages
from batchgen.kv.target import KvTarget
from batchgen.state import Phase, RequestState


class LegacyKvPath:
    """The KV helper methods. Every method mutates the target directly."""

    name = "legacy"

    def __init__(self, target: KvTarget):
        self.state = target.state
        self.gpu_kv = target.gpu_kv
        self.host_kv = target.host_kv
        # the one way to drop one (see KvTarget)
        self._drop_pending_kv_append = target.drop_pending_append
        self.cache_config = target.cache_config
        self.engine_config = target.engine_config
        self._kv_watermark_pages = self.cache_config.watermark_pages

    def _decode_demand(self, req: RequestState) -> int:
        return pages_needed(req.num_tokens, self.cache_config.page_size) - len(req.gpu_page_ids)

    # ---- poll --------------------------------------------------------------------
    def poll(self, observed: Mapping[str, str | None]) -> None:
        """Act on observed load outcomes (uuid -> None if done, else the error).

        Mutates request phases, page tables, pools and stats.
        """
        stats = self.state.stats
        for uuid, error in observed.items():
            req = self.state.edit(uuid)
            if error is None:  # decision: poll.complete
                req.load_handle = None
                self.host_kv.release_pages(uuid)
                req.host_page_ids = ()
                req.load_started_step = None
                req.phase = Phase.RUNNING
                continue
            stats.load_failures += 1  # decision: poll.timeout (a timed-out load failed too)
            # decision: poll.retry, poll.retry.last
            if req.num_load_retries < self.engine_config.max_load_retries:
                req.num_load_retries += 1
                req.load_handle = self.host_kv.load_to_gpu_async(uuid, list(req.load_page_ids()))
                req.load_started_step = self.state.step
                stats.loads += 1
                continue
            # a timed-out load's copy may still be writing into the GPU pages freed next
            req.drain_load()
            self.gpu_kv.release_pages(uuid)
            self.host_kv.release_pages(uuid)
            req.gpu_page_ids, req.host_page_ids = (), ()
            req.num_cached_tokens = 0
            req.num_load_retries = 0
            req.load_started_step = None
            if self.engine_config.load_failure == "fail":  # decision: poll.fail, poll.recompute
                req.phase, req.finish_reason = Phase.FAILED, f"load failed: {error}"
            else:
                req.phase = Phase.WAITING
                stats.recompute_preemptions += 1

    # ---- release -----------------------------------------------------------------
    def release(self, uuids: Sequence[str]) -> None:
        """Retire done requests. Mutates requests, outputs, pools, pending appends."""
        for uuid in uuids:  # decision: release.finished, release.failed, release.without_pages
            req = self.state.remove(uuid)
            req.drain_load()  # decision: release.with_inflight_load
            self.gpu_kv.release_pages(uuid)
            self.host_kv.release_pages(uuid)  # decision: release.with_host_pages
            self._drop_pending_kv_append(uuid)  # decision: release.with_pending_append
            self.state.outputs[uuid] = req.to_output()

    # ---- evict -------------------------------------------------------------------
    def evict(self) -> None:
        """Evict the youngest running requests until the watermark holds.

        Mutates victims (phase, page tables), both pools (copies, pages), stats.
        """
        running = sorted(self.state.in_phase(Phase.RUNNING), key=lambda r: r.arrival_index)
        demand = sum(self._decode_demand(r) for r in running)
        free = self.gpu_kv.free_pages()
        # decision: evict.none.no_running, evict.none.above_watermark, evict.none.at_watermark,
        # evict.stop.above_watermark, evict.stop.at_watermark, evict.all_running
        while running and free - demand < self._kv_watermark_pages:
            victim = running.pop()  # decision: evict.multiple_victims (one per turn)
            demand -= self._decode_demand(victim)
            # decision: evict.shared_page_kept (a page another request holds stays, not freed)
            free += sum(1 for p in victim.gpu_page_ids if self.gpu_kv.holders(p) == 1)
            self._evict_one(victim)

    def _evict_one(self, victim: RequestState) -> None:
        uuid, num_pages = victim.uuid, len(victim.gpu_page_ids)
        victim = self.state.edit(uuid)
        # decision: evict.to_host, evict.to_host.exact_fit
        if self.host_kv.free_pages() >= num_pages:
            victim.host_page_ids = tuple(self.host_kv.allocate_pages(uuid, num_pages))
            self.host_kv.store_from_gpu(uuid, list(victim.gpu_page_ids))
            victim.phase = Phase.SWAPPED
            victim.swapped_step = self.state.step
            self.state.stats.evictions += 1
        else:  # decision: evict.to_recompute.host_full
            victim.num_cached_tokens = 0
            victim.phase = Phase.WAITING
            self.state.stats.recompute_preemptions += 1
        self.gpu_kv.release_pages(uuid)
        victim.gpu_page_ids = ()

    # ---- migrate -----------------------------------------------------------------
    def migrate(self) -> None:
        """Start async loads for swapped requests that fit, oldest first.

        Mutates their phase, page tables, the GPU pool, stats.
        """
        running = self.state.in_phase(Phase.RUNNING)
        demand = sum(self._decode_demand(r) for r in running)
        num_active = len(running) + len(self.state.in_phase(Phase.LOADING))
        free = self.gpu_kv.free_pages()
        swapped = sorted(self.state.in_phase(Phase.SWAPPED), key=lambda r: r.arrival_index)
        for req in swapped:  # decision: migrate.none.nothing_swapped, migrate.all_loaded
            if req.swapped_step == self.state.step:  # decision: migrate.skip.swapped_this_step
                continue
            if num_active >= self.engine_config.max_num_seqs:  # decision: migrate.stop.max_num_seqs
                break
            relinked = self.gpu_kv.cached_prefix(req.prompt_digests)
            num_new = len(req.host_page_ids) - len(relinked)
            cost = num_new + sum(1 for p in relinked if not self.gpu_kv.holders(p))
            # decision: migrate.stop.watermark, migrate.load, migrate.load.exact_fit
            if free - demand - cost < self._kv_watermark_pages:
                break
            self._start_load(req.uuid, relinked, num_new)
            num_active += 1
            free -= cost

    def _start_load(self, uuid: str, relinked: list[int], num_new: int) -> None:
        """Re-link ``relinked`` cached pages (their host pages freed now), load the rest into
        ``num_new`` new pages. Mutates the request, both pools, stats."""
        req = self.state.edit(uuid)
        if relinked:  # decision: migrate.relink
            self.gpu_kv.grant_pages_for([(uuid, relinked, ())])
            self.host_kv.release_first_pages(uuid, len(relinked))
            req.host_page_ids = req.host_page_ids[len(relinked) :]
        new = tuple(self.gpu_kv.allocate_pages(uuid, num_new))
        req.gpu_page_ids = (*relinked, *new)
        req.load_handle = self.host_kv.load_to_gpu_async(uuid, list(new))
        req.load_started_step = self.state.step
        req.phase = Phase.LOADING
        req.num_load_retries = 0
        self.state.stats.loads += 1

    # ---- alloc -------------------------------------------------------------------
    def allocate(self, batch: Sequence[str]) -> list[str]:
        """Give each scheduled request pages for all its tokens; returns those served.

        Mutates page tables, the GPU pool, and admitted requests' phase (-> RUNNING).
        """
        served = []
        for uuid in batch:
            req = self.state.requests[uuid]
            admitting = req.phase is not Phase.RUNNING
            # decision: alloc.prefix_hit, alloc.prefix_hit.cache_entry
            hits = self._prefix_hits(req) if admitting else []
            need = self._decode_demand(req) - len(hits)
            cost = need + sum(1 for p in hits if not self.gpu_kv.holders(p))
            if cost > self.gpu_kv.free_pages():  # decision: alloc.does_not_fit, alloc.exact_fit
                continue  # decision: alloc.fits_after_does_not_fit (a later one may fit)
            # decision: alloc.admit, alloc.new_page, alloc.none_needed
            if need > 0 or admitting:
                req = self.state.edit(uuid)
                if admitting:  # decision: alloc.admit, alloc.prefix_hit
                    self._admit(uuid, hits)
                if need > 0:  # decision: alloc.admit, alloc.new_page
                    req.gpu_page_ids += tuple(self.gpu_kv.allocate_pages(uuid, need))
                req.phase = Phase.RUNNING
            served.append(uuid)
        return served

    def _prefix_hits(self, req: RequestState) -> list[int]:
        """The cached pages an admitted ``req`` takes: the longest cached prefix of its prompt
        digests, one token short of all its tokens. Pure."""
        if not self.cache_config.enable_prefix_caching:  # decision: alloc.admit
            return []
        page_size = self.cache_config.page_size
        usable = reusable_pages(len(req.prompt_digests), req.num_tokens, page_size)
        return self.gpu_kv.cached_prefix(req.prompt_digests[:usable])

    def _admit(self, uuid: str, hits: list[int]) -> None:
        """Share ``hits`` with the request ``uuid`` being admitted and count the lookup. Mutates
        the request, the GPU pool, stats."""
        if not self.cache_config.enable_prefix_caching:  # decision: alloc.admit
            return
        req = self.state.edit(uuid)
        stats, num_hit_tokens = self.state.stats, len(hits) * self.cache_config.page_size
        stats.prefix_cache_queries += req.num_tokens
        stats.prefix_cache_hits += num_hit_tokens
        self.gpu_kv.grant_pages_for([(uuid, hits, ())])
        req.gpu_page_ids = tuple(hits)
        req.num_cached_tokens = num_hit_tokens
        if not req.output_ids:  # decision: alloc.prefix_hit (first admission: usage's count)
            req.num_cached_prompt_tokens = num_hit_tokens
