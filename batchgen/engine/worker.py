"""The worker: continuous batching over the two-tier paged KV cache.

One step reads as the KV ops in order, then the model::

    poll     loads issued last step: done -> RUNNING, failed -> retry/recompute
    release  done requests give back pages, loads, pending appends
    flush    last step's K/V (pending appends) written into their pages
    evict    youngest RUNNING -> host (or recompute) until the watermark holds
    migrate  oldest SWAPPED -> LOADING (async host->GPU load) while they fit
    schedule RUNNING decodes + admitted WAITING prefills (token budget)
    alloc    GPU pages for every scheduled token
    forward  model over paged KV -> new K/V become pending appends; sample
    finish   append each sampled token; end the requests it ends (FINISHED + reason)

The worker owns ``state``, both pools and ``_pending_kv_append_tensors``; its KV
ops are handed to it (``kv_ops``, a ``batchgen.kv.ops.KvFactory`` the edge builds
from a parsed gate): the plan path, the legacy path, or compare mode; so is its finish
step (``finish_ops``, a ``batchgen.finish.ops.FinishFactory``). It reads no environment and
knows nothing of compare mode but the runs it is handed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from batchgen.config import CacheConfig, EngineConfig, pages_needed
from batchgen.engine.faults import FaultInjector
from batchgen.engine.loads import observe_loads
from batchgen.engine.request_checks import RequestError, check_request
from batchgen.engine.sampler import sample
from batchgen.engine.scheduler import schedule
from batchgen.finish.ops import FinishFactory, plan_finish_ops
from batchgen.kv.backends import GpuKvPool, HostKvPool
from batchgen.kv.ops import KvFactory, plan_ops
from batchgen.kv.prefix_digests import prompt_page_digests, register_written_pages
from batchgen.kv.target import KvTarget
from batchgen.kv.tiers import tier_tensors
from batchgen.model.llama import SeqInput
from batchgen.model.paged_kv import write_kvs
from batchgen.state import (
    ABORT_REASON,
    DONE_PHASES,
    Phase,
    Request,
    RequestOutput,
    RequestState,
    WorkerState,
)


@dataclass(frozen=True, slots=True)
class PendingAppend:
    """K/V a forward produced for positions [start_pos, start_pos + n), not yet in pages."""

    start_pos: int
    kv: torch.Tensor | None  # [num_layers, 2, n, kv_heads, head_dim]; None without KV storage


def _check_config_types(cache_config: CacheConfig, engine_config: EngineConfig | None) -> None:
    """TypeError naming the first config argument of another type than the worker takes."""
    for name, value, expected, optional in (
        ("cache_config", cache_config, CacheConfig, False),
        ("engine_config", engine_config, EngineConfig, True),
    ):
        if not (isinstance(value, expected) or optional and value is None):
            raise TypeError(
                f"Worker: {name} must be a {expected.__module__}.{expected.__name__}"
                f"{' or None' if optional else ''}, not {type(value).__name__}"
            )


class Worker:
    def __init__(
        self,
        model,
        *,
        cache_config: CacheConfig,
        engine_config: EngineConfig | None = None,
        kv_ops: KvFactory = plan_ops,
        finish_ops: FinishFactory = plan_finish_ops,
        faults: FaultInjector | None = None,
        device: str | torch.device = "cpu",
        kv_storage: bool = True,
    ):
        """``kv_ops`` builds the KV ops over the worker's target, and what watches them (compare
        mode, the page-content oracle); the default is the plan path alone. ``finish_ops`` builds
        the finish step (token append, stop checks, finish reasons) over the worker's state, and
        compare mode's runs of it; the default is its plan path alone. ``faults`` injects a
        seeded fault schedule. ``kv_storage=False`` keeps the pools bookkeeping-only (null-model
        runs). TypeError naming the argument given a config of another type."""
        _check_config_types(cache_config, engine_config)
        self.model = model
        self.model_config = model.config
        self.cache_config = cache_config
        self.engine_config = engine_config or EngineConfig()
        self.device = torch.device(device)
        gpu_tensor = host_tensor = None
        if kv_storage:
            gpu_tensor, host_tensor = tier_tensors(self.model_config, cache_config, self.device)
        self.gpu_kv = GpuKvPool(cache_config.num_gpu_pages, gpu_tensor)
        self.host_kv = HostKvPool(cache_config.num_host_pages, host_tensor, self.gpu_kv)
        self.faults = faults
        if faults is not None:
            self.host_kv = faults.host_pool(self.host_kv)
        self.state = WorkerState()
        self._pending_kv_append_tensors: dict[str, PendingAppend] = {}
        # the KV ops; the gate they were built from, compare mode's runs, the page-content oracle
        self._kv, self.kv_gate, self.kv_compare, self.kv_verify = kv_ops(self.kv_target())
        self._finish, self.finish_compare = finish_ops(self.state)

    def kv_target(self) -> KvTarget:
        """The worker's live state, pools and pending appends, as the KV ops see them."""
        return KvTarget(
            self.state,
            self.gpu_kv,
            self.host_kv,
            self._pending_kv_append_tensors,
            self.model_config,
            self.cache_config,
            self.engine_config,
        )

    # ---- client API ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request (WAITING). Raises RequestError, changing nothing, if it is invalid."""
        self.validate_request(request)
        cache = self.cache_config
        digests = ()
        if cache.enable_prefix_caching:
            digests = prompt_page_digests(request.prompt_ids, cache.page_size)
        self.state.requests[request.uuid] = RequestState(
            request, arrival_index=self.state.num_submitted, prompt_digests=digests
        )
        self.state.num_submitted += 1

    def abort(self, uuid: str) -> None:
        """Mark a live request FINISHED("abort"); the next step releases it."""
        req = self.state.requests.get(uuid)
        if req is None:
            raise RequestError(f"abort: no live request {uuid!r}")
        if req.phase not in DONE_PHASES:
            req.phase, req.finish_reason = Phase.FINISHED, ABORT_REASON
        elif self.kv_compare is not None:  # too late: compare mode notes it
            self.kv_compare.note_abort_of_done(uuid)

    def take_outputs(self, uuids: Iterable[str] | None = None) -> dict[str, RequestOutput]:
        """Remove and return released outputs (all, or those of ``uuids`` that are released).

        A long-running client calls this as it collects results, so worker memory stays flat.
        Mutates ``state.outputs``.
        """
        outputs = self.state.outputs
        # one uuid is not a collection of them: its characters would be looked up
        if isinstance(uuids, str):
            raise TypeError(
                f"take_outputs takes a collection of uuids, not the string {uuids!r}; "
                f"use take_outputs([{uuids!r}])"
            )
        if uuids is None:
            taken, self.state.outputs = outputs, {}
            return taken
        if not isinstance(uuids, Iterable):
            raise TypeError(
                f"take_outputs takes a collection of uuids, not {type(uuids).__name__} {uuids!r}"
            )
        return {uuid: outputs.pop(uuid) for uuid in uuids if uuid in outputs}

    def has_unfinished(self) -> bool:
        """Live requests remain, or injected faults still hold pages."""
        return bool(self.state.requests) or (
            self.faults is not None and self.faults.has_reservations()
        )

    def step(self) -> None:
        """Run one step. Mutates state, pools, pending appends, stats."""
        if self.faults is not None:
            self.faults.before_step(self)
        observed = observe_loads(self.state, self.engine_config.load_timeout_steps)
        if observed:
            self._kv.poll(observed)
            if self.kv_verify is not None:
                self.kv_verify.check_loads()
        done = [r.uuid for r in self.state.requests.values() if r.phase in DONE_PHASES]
        if done:
            self._kv.release(done)
        self._flush_pending_kv_appends()
        self._kv.evict()
        self._kv.migrate()
        free = self.gpu_kv.free_pages()
        prefix_index = self.gpu_kv if self.cache_config.enable_prefix_caching else None
        batch = schedule(self.state, free, self.cache_config, self.engine_config, prefix_index)
        served = self._kv.allocate(batch) if batch else []
        if served:
            self._forward_and_sample(served)
        self._record_peaks()
        self.state.step += 1

    # ---- worker-side steps -------------------------------------------------------------
    def _flush_pending_kv_appends(self) -> None:
        """Write pending K/V into their pages, index the prompt pages they complete (prefix
        caching), then forget them. Mutates the GPU pool's tensor and index."""
        writes = [
            (self.state.requests[uuid].gpu_page_ids, pending.start_pos, pending.kv)
            for uuid, pending in self._pending_kv_append_tensors.items()
            if pending.kv is not None
        ]
        if writes and self.gpu_kv.tensor is not None:
            verify = self.kv_verify
            with verify.appends() if verify is not None else contextlib.nullcontext():
                write_kvs(self.gpu_kv.tensor, writes)
        if self.cache_config.enable_prefix_caching:
            for uuid, pending in self._pending_kv_append_tensors.items():
                req, page_size = self.state.requests[uuid], self.cache_config.page_size
                register_written_pages(self.gpu_kv, req, pending.start_pos, page_size)
        self._pending_kv_append_tensors.clear()

    def _forward_and_sample(self, served: list[str]) -> None:
        """Forward the served requests, keep their new K/V pending, sample a token each and hand
        them to the finish step (``batchgen.finish``: append, stop checks, finish reasons).

        Mutates requests (cached count, outputs, phase), pending appends, stats.
        """
        reqs = [self.state.requests[uuid] for uuid in served]
        seqs = [
            SeqInput(
                token_ids=r.token_ids(r.num_cached_tokens),
                start_pos=r.num_cached_tokens,
                page_ids=r.gpu_page_ids,
            )
            for r in reqs
        ]
        out = self.model.forward(seqs, self.gpu_kv.tensor)
        for req, seq, kv in zip(reqs, seqs, out.new_kv):
            self._pending_kv_append_tensors[req.uuid] = PendingAppend(seq.start_pos, kv)
            req.num_cached_tokens = req.num_tokens
        eos_ids = self.model_config.eos_token_ids
        self._finish.finish(served, sample(out.logits, reqs, eos_ids), eos_ids)

    def _record_peaks(self) -> None:
        stats = self.state.stats
        stats.peak_gpu_pages = max(
            stats.peak_gpu_pages, self.gpu_kv.num_pages - self.gpu_kv.free_pages()
        )
        stats.peak_host_pages = max(
            stats.peak_host_pages, self.host_kv.num_pages - self.host_kv.free_pages()
        )

    def validate_request(self, request: Request) -> None:
        """Raise RequestError if ``request`` cannot be served by this worker. Pure."""
        check_request(request, self.state, self.model_config, self.cache_config)

    # ---- integrity -----------------------------------------------------------------------
    def _check_relinked(self, loading: RequestState) -> None:
        """A LOADING request's GPU pages are the cached prompt pages it re-linked, each indexed
        under its prompt digest, then one per host page (the load's). Pure."""
        relinked = loading.gpu_page_ids[: len(loading.gpu_page_ids) - len(loading.host_page_ids)]
        assert len(loading.gpu_page_ids) >= len(loading.host_page_ids), loading.uuid
        assert len(relinked) <= len(loading.prompt_digests), f"{loading.uuid}: extra GPU pages"
        for page_id, digest in zip(relinked, loading.prompt_digests):
            assert self.gpu_kv.digest_of(page_id) == digest, (
                f"{loading.uuid}: re-linked page {page_id} does not hold its prompt prefix"
            )

    def check_integrity(self) -> None:
        """Raise AssertionError on any pool or page-table inconsistency. Pure."""
        live = self.state.requests
        owners = set(live) | (self.faults.owner_ids() if self.faults is not None else set())
        self.gpu_kv.check_integrity(owners)
        self.host_kv.check_integrity(owners)
        for uuid, req in live.items():
            assert self.gpu_kv.pages_of(uuid) == req.gpu_page_ids, f"{uuid}: GPU page table != pool"
            assert self.host_kv.pages_of(uuid) == req.host_page_ids, (
                f"{uuid}: host page table != pool"
            )
            if req.phase is Phase.WAITING:
                assert (
                    not req.gpu_page_ids and not req.host_page_ids and req.num_cached_tokens == 0
                ), uuid
            elif req.phase is Phase.SWAPPED:
                assert not req.gpu_page_ids and req.host_page_ids, (
                    f"{uuid}: SWAPPED needs host pages only"
                )
            elif req.phase is Phase.LOADING:
                assert req.load_handle is not None, uuid
                self._check_relinked(req)
            elif req.phase is Phase.RUNNING:
                num_pages = pages_needed(req.num_cached_tokens, self.cache_config.page_size)
                assert len(req.gpu_page_ids) >= num_pages, uuid
        stray = set(self._pending_kv_append_tensors) - set(live)
        assert not stray, f"pending appends for released requests: {sorted(stray)}"
