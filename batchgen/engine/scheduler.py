"""Which requests run this step: the RUNNING decodes, then the WAITING requests that fit, in the
order of the engine's ``schedule_policy``.

No request is admitted while any is SWAPPED: swapped requests come back first. So RUNNING +
LOADING + SWAPPED never exceeds ``max_num_seqs``, an invariant the KV policy relies on
(``batchgen.shadow.coverage`` marks migration's ``max_num_seqs`` stop unreachable for it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from batchgen.config import CacheConfig, EngineConfig, pages_needed
from batchgen.kv.prefix_digests import reusable_pages
from batchgen.state import Phase, RequestState, WorkerState


def oldest_first(req: RequestState) -> int:
    return req.arrival_index


def longest_output_first(req: RequestState) -> tuple[int, int]:
    """Most new tokens still allowed first (the last to finish starts first), then oldest."""
    return len(req.output_ids) - req.request.max_new_tokens, req.arrival_index


ADMISSION_ORDER = {"fcfs": oldest_first, "lof": longest_output_first}


def schedule(
    state: WorkerState,
    num_free_gpu_pages: int,
    cache: CacheConfig,
    engine: EngineConfig,
    gpu_kv: PrefixIndex | None = None,
) -> list[str]:
    """The step's batch: every RUNNING request, then WAITING ones in ``ADMISSION_ORDER``, each
    admitted if it fits: pages above the watermark once every decode has its page, a free sequence
    slot, and tokens within ``max_num_batched_tokens`` less the decodes, which the step's first
    admitted request may exceed (no chunked prefill: a long prompt runs whole). With prefix
    caching (``gpu_kv``: the GPU pool's index) a request counts only the pages and tokens its
    cached prefix does not cover, and one whose first prompt page is not cached waits a step when
    a request admitted this step starts with the same page (it hits that request's pages next
    step: ``n`` samples of a prompt compute it once). Pure."""
    running = state.in_phase(Phase.RUNNING)
    batch = [r.uuid for r in running]
    if state.in_phase(Phase.SWAPPED):
        return batch
    page_size = cache.page_size
    free = num_free_gpu_pages - sum(
        pages_needed(r.num_tokens, page_size) - len(r.gpu_page_ids) for r in running
    )
    num_active = len(running) + len(state.in_phase(Phase.LOADING))
    budget = engine.max_num_batched_tokens - len(running)
    admitted, first_pages = 0, set()
    waiting = sorted(state.in_phase(Phase.WAITING), key=ADMISSION_ORDER[engine.schedule_policy])
    for req in waiting:
        if num_active >= engine.max_num_seqs:
            break
        num_pages, num_tokens = _uncached(req, page_size, gpu_kv)
        if free - num_pages < cache.watermark_pages or (admitted and num_tokens > budget):
            continue  # a later, smaller request may still fit; this one goes first later
        first_page = req.prompt_digests[:1]
        if first_page and num_tokens == req.num_tokens and first_page in first_pages:
            continue  # its first page is being computed this step: it hits it next step
        first_pages.add(first_page)
        batch.append(req.uuid)
        admitted += 1
        num_active += 1
        budget -= num_tokens
        free -= num_pages
    return batch


class PrefixIndex(Protocol):
    def cached_prefix(self, digests: Iterable[str]) -> list[int]: ...
    def holders(self, page_id: int) -> int: ...


def _uncached(req: RequestState, page_size: int, gpu_kv: PrefixIndex | None) -> tuple[int, int]:
    """The free pages admitting ``req`` takes and the tokens it computes, past the cached prefix
    it would hit (``gpu_kv``: the prefix index; None: no caching). Pure."""
    num_pages = pages_needed(req.num_tokens, page_size)
    if gpu_kv is None or not req.prompt_digests:
        return num_pages, req.num_tokens
    usable = reusable_pages(len(req.prompt_digests), req.num_tokens, page_size)
    hits = gpu_kv.cached_prefix(req.prompt_digests[:usable])
    cache_entries = sum(1 for page_id in hits if not gpu_kv.holders(page_id))
    return num_pages - len(hits) + cache_entries, req.num_tokens - len(hits) * page_size
