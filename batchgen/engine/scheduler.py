"""Which requests run this step: the RUNNING decodes, then the WAITING requests that fit, in the
order of the engine's ``schedule_policy``.

No request is admitted while any is SWAPPED: swapped requests come back first. So RUNNING +
LOADING + SWAPPED never exceeds ``max_num_seqs``, an invariant the KV policy relies on
(``batchgen.shadow.coverage`` marks migration's ``max_num_seqs`` stop unreachable for it).
"""

from __future__ import annotations

from batchgen.config import CacheConfig, EngineConfig, pages_needed
from batchgen.state import Phase, RequestState, WorkerState


def oldest_first(req: RequestState) -> int:
    return req.arrival_index


def longest_output_first(req: RequestState) -> tuple[int, int]:
    """Most new tokens still allowed first (the last to finish starts first), then oldest."""
    return len(req.output_ids) - req.request.max_new_tokens, req.arrival_index


ADMISSION_ORDER = {"fcfs": oldest_first, "lof": longest_output_first}


def schedule(
    state: WorkerState, num_free_gpu_pages: int, cache: CacheConfig, engine: EngineConfig
) -> list[str]:
    """The step's batch: every RUNNING request, then WAITING ones in ``ADMISSION_ORDER``, each
    admitted if it fits: pages above the watermark once every decode has its page, a free sequence
    slot, and tokens within ``max_num_batched_tokens`` less the decodes, which the step's first
    admitted request may exceed (no chunked prefill: a long prompt runs whole). Pure."""
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
    admitted = 0
    waiting = sorted(state.in_phase(Phase.WAITING), key=ADMISSION_ORDER[engine.schedule_policy])
    for req in waiting:
        if num_active >= engine.max_num_seqs:
            break
        num_pages = pages_needed(req.num_tokens, page_size)
        if free - num_pages < cache.watermark_pages or (admitted and req.num_tokens > budget):
            continue  # a later, smaller request may still fit; this one goes first later
        batch.append(req.uuid)
        admitted += 1
        num_active += 1
        budget -= req.num_tokens
        free -= num_pages
    return batch
