"""Validate's self-checks: the safety nets no sound run can trip must still trip on what they
exist to refuse.

    id prefix    must be caught                                       built on
    -----------  ---------------------------------------------------  -------------------------
    plan.*       a malformed plan: PlanRejected naming its field       plan_fixture's target,
                 (``plan_refusals``)                                   fresh for each plan
    integrity.*  a corrupted worker: ``Worker.check_integrity``        a bookkeeping worker of
                 raises                                                its own, run to a load in
                                                                       flight, fresh each time
    counters.*   a run's stats disagreeing with what it produced       every run validate finishes

``self_check_results`` yields the first two kinds (milliseconds: a null model, no KV tensors);
``counter_failures`` judges one finished run. Validate's own workers are never corrupted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig
from batchgen.engine.runner import RunResult
from batchgen.engine.worker import PendingAppend, Worker
from batchgen.model.null_model import NullModel
from batchgen.state import Phase, Request, RequestState
from batchgen.validation.plan_refusal import refusal_failure
from batchgen.validation.plan_refusals import PLAN_REFUSALS

# The integrity run: 5 requests of 6 prompt tokens on 12 GPU pages of 4 tokens; r4 is evicted to
# host and is loading back after step 6, beside RUNNING r1..r3, one GPU page free.
INTEGRITY_CACHE = CacheConfig(page_size=4, num_gpu_pages=12, num_host_pages=8, watermark=0.0)
INTEGRITY_MAX_NEW_TOKENS = (6, 12, 12, 12, 12)
INTEGRITY_MAX_STEPS = 40
TOKENS_CHECK = "counters.tokens_generated"


@dataclass(frozen=True, slots=True)
class Corruption:
    """One corruption of a worker mid-run, which ``check_integrity`` must catch."""

    id: str
    meaning: str
    corrupt: Callable[[Worker, RequestState, RequestState], None]  # (worker, running, loading)


def _replace_gpu_pages(worker: Worker, req: RequestState, page_ids: tuple[int, ...]) -> None:
    """Give ``req`` exactly ``page_ids`` in the GPU pool and its page table (both agree). Mutates
    the worker's GPU pool and ``req``."""
    worker.gpu_kv.release_pages(req.uuid)
    worker.gpu_kv.take_pages(req.uuid, list(page_ids))
    req.gpu_page_ids = page_ids


def _set_phase(phase: Phase) -> Callable[[Worker, RequestState, RequestState], None]:
    def corrupt(worker, running, loading):
        running.phase = phase

    return corrupt


def _c(check_id: str, meaning: str, corrupt) -> Corruption:
    """A corruption whose id is ``integrity.`` + ``check_id``."""
    return Corruption(f"integrity.{check_id}", meaning, corrupt)


CORRUPTIONS = (
    _c("gpu_table_extra_page", "a RUNNING request's GPU page table naming a page the pool does"
       " not give it", lambda w, run, load: setattr(
           run, "gpu_page_ids", run.gpu_page_ids + load.gpu_page_ids[:1])),
    _c("gpu_table_missing_page", "a RUNNING request's GPU page table missing a page the pool"
       " gives it", lambda w, run, load: setattr(run, "gpu_page_ids", run.gpu_page_ids[:-1])),
    _c("host_table_missing_page", "a LOADING request's host page table missing a page the host"
       " pool gives it", lambda w, run, load: setattr(
           load, "host_page_ids", load.host_page_ids[:-1])),
    _c("loading_extra_gpu_page", "a LOADING request holding one GPU page more than its host"
       " pages", lambda w, run, load: _replace_gpu_pages(
           w, load, load.gpu_page_ids + tuple(w.gpu_kv.peek_free_pages(1)))),
    _c("loading_missing_gpu_page", "a LOADING request holding one GPU page fewer than its host"
       " pages", lambda w, run, load: _replace_gpu_pages(w, load, load.gpu_page_ids[:-1])),
    _c("loading_without_handle", "a LOADING request without its load's handle",
       lambda w, run, load: setattr(load, "load_handle", None)),
    _c("orphan_host_page", "a host page owned by no live request",
       lambda w, run, load: w.host_kv.take_pages("ghost", w.host_kv.peek_free_pages(1))),
    _c("swapped_on_gpu", "a SWAPPED request holding GPU pages and no host pages",
       _set_phase(Phase.SWAPPED)),
    _c("waiting_with_pages", "a WAITING request holding pages and cached tokens",
       _set_phase(Phase.WAITING)),
    _c("running_short", "a RUNNING request with more cached tokens than its pages hold",
       lambda w, run, load: setattr(
           run, "num_cached_tokens", len(run.gpu_page_ids) * w.cache_config.page_size + 1)),
    _c("shared_set_not_the_holders", "a GPU page counted as held twice (prefix caching) that one"
       " request holds", lambda w, run, load: w.gpu_kv.pages._shared.add(run.gpu_page_ids[0])),
    _c("stray_append", "a pending append of a request no longer live",
       lambda w, run, load: w.kv_target().pending_appends.update(ghost=PendingAppend(0, None))),
)  # fmt: skip


def self_check_results() -> Iterator[tuple[str, str | None]]:
    """(check id, None when it passed or the failure line) for every plan refusal, then every
    corruption. Builds targets and workers of its own; mutates nothing else."""
    for refusal in PLAN_REFUSALS:
        yield refusal.id, refusal_failure(refusal)
    for corruption in CORRUPTIONS:
        yield corruption.id, corruption_failure(corruption)


def corruption_failure(corruption: Corruption) -> str | None:
    """None when ``check_integrity`` catches ``corruption`` on a fresh worker mid-run (and passed
    on it before); else a line naming the corruption it accepted. Mutates only that worker."""
    worker = worker_mid_run()
    phases = {}  # phase -> its first request
    for req in worker.state.requests.values():
        phases.setdefault(req.phase, req)
    if not {Phase.RUNNING, Phase.LOADING} <= phases.keys():
        return (
            f"self-check {corruption.id}: the integrity run reached no step with a RUNNING request"
            f" beside a load in flight in {INTEGRITY_MAX_STEPS} steps, so nothing was corrupted"
        )
    try:
        worker.check_integrity()
    except AssertionError as error:
        return f"self-check {corruption.id}: integrity failed before the corruption: {error}"
    corruption.corrupt(worker, phases[Phase.RUNNING], phases[Phase.LOADING])
    try:
        worker.check_integrity()
    except AssertionError:
        return None
    return f"self-check {corruption.id}: check_integrity accepted {corruption.meaning}"


def worker_mid_run() -> Worker:
    """A bookkeeping worker (null model, no KV tensors) stepped until a load is in flight beside
    a RUNNING request, or for ``INTEGRITY_MAX_STEPS``. Pure (the worker is new)."""
    worker = Worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=INTEGRITY_CACHE,
        engine_config=EngineConfig(max_num_seqs=8),
        kv_storage=False,
    )
    for i, max_new_tokens in enumerate(INTEGRITY_MAX_NEW_TOKENS):
        worker.add_request(Request(f"r{i}", tuple(range(1, 7)), max_new_tokens=max_new_tokens))
    for _ in range(INTEGRITY_MAX_STEPS):
        worker.step()
        if {Phase.RUNNING, Phase.LOADING} <= {req.phase for req in worker.state.requests.values()}:
            break
    return worker


def counter_failures(label: str, result: RunResult) -> list[str]:
    """A line when the run's ``tokens_generated`` is not the number of tokens its outputs hold
    (every sampled token is kept, recomputes and failures included). Pure."""
    produced = sum(len(output.output_ids) for output in result.outputs.values())
    if result.stats.tokens_generated == produced:
        return []
    return [
        f"self-check {TOKENS_CHECK}: {label}: stats.tokens_generated is"
        f" {result.stats.tokens_generated} but its outputs hold {produced} tokens"
    ]
