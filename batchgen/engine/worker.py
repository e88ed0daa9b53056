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

The worker owns ``state``, both pools and ``_pending_kv_append_tensors``; the
KV ops run through the path the gate picked (``kv_gate.build_kv_path``), or
through compare mode (``kv_compare``).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from batchgen.config import CacheConfig, EngineConfig
from batchgen.engine.faults import OWNER_PREFIX as FAULT_OWNER_PREFIX
from batchgen.engine.faults import FaultInjector
from batchgen.engine.sampler import sample
from batchgen.engine.state import (
    ABORT_REASON,
    DONE_PHASES,
    Phase,
    Request,
    RequestOutput,
    RequestState,
    WorkerState,
)
from batchgen.kv.backends import GpuKvPool, HostKvPool
from batchgen.kv.gate import KvGateConfig, build_kv_path, gate_config
from batchgen.kv.page_copy import new_page_tensor
from batchgen.kv.target import KvTarget
from batchgen.model.llama import SeqInput
from batchgen.model.loader import SUPPORTED_DTYPES, device_memory_available
from batchgen.model.paged_kv import kv_page_shape, write_kvs


class RequestError(ValueError):
    """A request was rejected; the worker state is unchanged."""


class PoolAllocationError(ValueError):
    """The KV page pools do not fit in memory."""


LOWER_POOLS = "lower num_gpu_pages/num_host_pages (or page_size)"


def _check_pool_memory(tiers: dict[str, tuple[int, torch.device]], page_bytes: int) -> None:
    """PoolAllocationError when the tiers' pages (tier name -> page count, device) need more than a
    device has available: Linux's MemAvailable for the CPU (both tiers there on a CPU run), the free
    memory of a GPU; no check where neither is known."""
    for device in dict.fromkeys(device for _, device in tiers.values()):
        available = device_memory_available(device)
        on_device = {
            name: num_pages
            for name, (num_pages, tier_device) in tiers.items()
            if tier_device == device
        }
        num_bytes = sum(on_device.values()) * page_bytes
        if available is not None and num_bytes > available:
            pages = " + ".join(f"{num_pages} {name}" for name, num_pages in on_device.items())
            raise PoolAllocationError(
                f"the KV pools need {num_bytes / 2**30:.1f} GiB on {device} ({pages} pages of"
                f" {page_bytes} bytes), {available / 2**30:.1f} GiB is available; {LOWER_POOLS}"
            )


@dataclass(frozen=True, slots=True)
class PendingAppend:
    """K/V a forward produced for positions [start_pos, start_pos + n), not yet in pages."""

    start_pos: int
    kv: torch.Tensor | None  # [num_layers, 2, n, kv_heads, head_dim]; None without KV storage


def _check_request_types(request: Request) -> None:
    """RequestError naming the first field of ``request`` whose type the worker cannot use (a float
    token id would pass the vocabulary check and then fail every later step in the embedding).
    Pure."""
    if not isinstance(request, Request):
        raise RequestError(f"expected a Request, got {type(request).__name__}")
    uuid = request.uuid
    if type(uuid) is not str:
        raise RequestError(f"request uuid {uuid!r}: must be a str, not {type(uuid).__name__}")
    where = f"request {uuid!r}"
    prompt = request.prompt_ids
    if type(prompt) not in (tuple, list):
        raise RequestError(
            f"{where}: prompt_ids must be a tuple of ints, not {type(prompt).__name__} (convert an "
            "array or tensor with tuple(ids.tolist()))"
        )
    not_int = [token for token in prompt if not _is_integer(token)]
    if not_int:
        raise RequestError(f"{where}: prompt_ids must be ints; got {not_int[:5]!r}")
    for field, value in (("max_new_tokens", request.max_new_tokens), ("seed", request.seed)):
        if not _is_integer(value):
            raise RequestError(
                f"{where}: {field} must be an int, not {type(value).__name__} {value!r}"
            )
    if not isinstance(request.temperature, numbers.Real) or isinstance(request.temperature, bool):
        raise RequestError(
            f"{where}: temperature must be a number, not {type(request.temperature).__name__} "
            f"{request.temperature!r}"
        )


def _is_integer(value) -> bool:
    """An int, or an integer scalar such as numpy's, but not a bool (True is 1 to Python). Pure."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class Worker:
    def __init__(
        self,
        model,
        *,
        cache_config: CacheConfig,
        engine_config: EngineConfig | None = None,
        kv_gate: KvGateConfig | None = None,
        shadow_path: str | None = None,
        faults: FaultInjector | None = None,
        device: str | torch.device = "cpu",
        kv_storage: bool = True,
    ):
        """``kv_gate`` picks the KV path and compare mode; without one it is parsed from the
        ``BATCHGEN_WORKER_KV_*`` environment (GateError if invalid; unset: plan, no compare).
        ``shadow_path`` overrides the compared path (the authoritative one itself: the A/A noise
        check). ``faults`` injects a seeded fault schedule. ``kv_storage=False`` keeps the pools
        bookkeeping-only (null-model runs). TypeError naming the argument given a config of another
        type."""
        for name, value, expected, optional in (
            ("cache_config", cache_config, CacheConfig, False),
            ("engine_config", engine_config, EngineConfig, True),
            ("kv_gate", kv_gate, KvGateConfig, True),
        ):
            if not (isinstance(value, expected) or optional and value is None):
                raise TypeError(
                    f"Worker: {name} must be a {expected.__module__}.{expected.__name__}"
                    f"{' or None' if optional else ''}, not {type(value).__name__}"
                )
        self.model = model
        self.model_config = model.config
        self.cache_config = cache_config
        self.kv_gate = kv_gate if kv_gate is not None else gate_config(os.environ)
        self.engine_config = engine_config or EngineConfig()
        if self.kv_gate.load_failure is not None:
            self.engine_config = self.engine_config.model_copy(
                update={"load_failure": self.kv_gate.load_failure}
            )
        self.device = torch.device(device)
        gpu_tensor = host_tensor = None
        if kv_storage:
            gpu_tensor, host_tensor = self._page_tensors()
        self.gpu_kv = GpuKvPool(cache_config.num_gpu_pages, gpu_tensor)
        self.host_kv = HostKvPool(cache_config.num_host_pages, host_tensor, self.gpu_kv)
        self.faults = faults
        if faults is not None:
            self.host_kv = faults.host_pool(self.host_kv)
        self.state = WorkerState()
        self._pending_kv_append_tensors: dict[str, PendingAppend] = {}
        self.kv_compare = None
        if self.kv_gate.compare != "off":
            from batchgen.shadow.kv_compare import KvCompare

            self.kv_compare = self._kv = KvCompare(
                self.kv_target(),
                self.kv_gate,
                shadow_path=shadow_path,
                faults=faults.spec.to_spec() if faults is not None else None,
            )
        else:
            self._kv = build_kv_path(self.kv_gate.path, self.kv_target())

    def _page_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both tiers' page tensors; PoolAllocationError (sizes named) when memory refuses, or
        would: the tiers are zero-filled, so a pool past the memory available would have the OS kill
        the process part way."""
        cache = self.cache_config
        dtype = SUPPORTED_DTYPES[cache.dtype]
        shape = kv_page_shape(self.model_config, cache.page_size, cache.num_gpu_pages)
        host_shape = (cache.num_host_pages, *shape[1:])
        host = torch.device("cpu")
        tiers = ((shape, self.device, False), (host_shape, host, self.device.type == "cuda"))
        page_bytes = math.prod(shape[1:]) * torch.finfo(dtype).bits // 8
        _check_pool_memory(
            {"GPU-tier": (shape[0], self.device), "host-tier": (host_shape[0], host)}, page_bytes
        )
        tensors = []
        for tier_shape, device, pinned in tiers:
            try:
                tensors.append(
                    new_page_tensor(tier_shape, dtype=dtype, device=device, pin_memory=pinned)
                )
            except (RuntimeError, MemoryError) as error:
                raise PoolAllocationError(
                    f"cannot allocate {tier_shape[0]} KV pages"
                    f" ({tier_shape[0] * page_bytes / 2**30:.1f} GiB) on {device}:"
                    f" {str(error).splitlines()[0]}; {LOWER_POOLS}"
                ) from None
        return tensors[0], tensors[1]

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
        self.state.requests[request.uuid] = RequestState(
            request, arrival_index=self.state.num_submitted
        )
        self.state.num_submitted += 1

    def abort(self, uuid: str) -> None:
        """Mark a live request FINISHED("abort"); the next step releases it."""
        req = self.state.requests.get(uuid)
        if req is None:
            raise RequestError(f"abort: no live request {uuid!r}")
        if req.phase not in DONE_PHASES:
            req.phase, req.finish_reason = Phase.FINISHED, ABORT_REASON

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
        observed = self._observe_loads()
        if observed:
            self._kv_poll(observed)
        done = [r.uuid for r in self.state.requests.values() if r.phase in DONE_PHASES]
        if done:
            self._kv_release(done)
        self._flush_pending_kv_appends()
        self._kv_evict()
        self._kv_migrate()
        batch = self._schedule()
        served = self._kv_allocate(batch) if batch else []
        if served:
            self._forward_and_sample(served)
        self._record_peaks()
        self.state.step += 1

    # ---- KV ops (dispatch point of the gate) ----------------------------------------
    def _kv_poll(self, observed: dict[str, str | None]) -> None:
        self._kv.poll(observed)

    def _kv_release(self, uuids: list[str]) -> None:
        self._kv.release(uuids)

    def _kv_evict(self) -> None:
        self._kv.evict()

    def _kv_migrate(self) -> None:
        self._kv.migrate()

    def _kv_allocate(self, batch: list[str]) -> list[str]:
        return self._kv.allocate(batch)

    # ---- worker-side steps -------------------------------------------------------------
    def _observe_loads(self) -> dict[str, str | None]:
        """Outcomes of in-flight loads: uuid -> None (done) or the error text. Pure.

        A copy issued last step is waited for: it overlapped that step's forward.
        A handle that says it may stall (``may_stall``, e.g. fault injection) is
        only read when done; one incomplete after ``load_timeout_steps`` steps
        counts as failed. Loads still pending are left out.
        """
        observed = {}
        timeout = self.engine_config.load_timeout_steps
        for req in self.state.in_phase(Phase.LOADING):
            handle = req.load_handle
            if getattr(handle, "may_stall", False) and not handle.done():
                age = self.state.step - req.load_started_step
                if age >= timeout:
                    observed[req.uuid] = f"LoadTimeout: no completion after {age} steps"
                continue
            try:
                handle.wait()
                observed[req.uuid] = None
            except Exception as exc:  # a failed copy is an input to poll, not a crash
                observed[req.uuid] = f"{type(exc).__name__}: {exc}"
        return observed

    def _flush_pending_kv_appends(self) -> None:
        """Write pending K/V into their pages, then forget them. Mutates the GPU pool tensor."""
        writes = [
            (self.state.requests[uuid].gpu_page_ids, pending.start_pos, pending.kv)
            for uuid, pending in self._pending_kv_append_tensors.items()
            if pending.kv is not None
        ]
        if writes and self.gpu_kv.tensor is not None:
            write_kvs(self.gpu_kv.tensor, writes)
        self._pending_kv_append_tensors.clear()

    def _schedule(self) -> list[str]:
        """RUNNING decodes, then WAITING requests, oldest first, each admitted if it fits: pages
        above the watermark, a free sequence slot, and tokens within ``max_num_batched_tokens`` less
        the decodes, which the step's first admitted request may exceed (no chunked prefill: a long
        prompt runs whole). Pure."""
        running = self.state.in_phase(Phase.RUNNING)
        batch = [r.uuid for r in running]
        if self.state.in_phase(Phase.SWAPPED):
            return batch  # swapped requests come back before new work is admitted
        watermark = self.cache_config.watermark_pages
        page_size = self.cache_config.page_size
        free = self.gpu_kv.free_pages() - sum(
            -(-r.num_tokens // page_size) - len(r.gpu_page_ids) for r in running
        )
        num_active = len(running) + len(self.state.in_phase(Phase.LOADING))
        budget = self.engine_config.max_num_batched_tokens - len(running)
        admitted = 0
        for req in sorted(self.state.in_phase(Phase.WAITING), key=lambda r: r.arrival_index):
            if num_active >= self.engine_config.max_num_seqs:
                break
            num_pages = self.cache_config.pages_for(req.num_tokens)
            if free - num_pages < watermark or (admitted and req.num_tokens > budget):
                # a younger, smaller request may still fit; the oldest goes first when room frees
                continue
            batch.append(req.uuid)
            admitted += 1
            num_active += 1
            budget -= req.num_tokens
            free -= num_pages
        return batch

    def _forward_and_sample(self, served: list[str]) -> None:
        """Forward the served requests, keep their new K/V pending, sample a token each.

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
        for req, (token, logprobs) in zip(reqs, sample(out.logits, reqs)):
            req.append_token(token, logprobs)
            self.state.stats.tokens_generated += 1
            if len(req.output_ids) >= req.request.max_new_tokens:
                req.phase, req.finish_reason = Phase.FINISHED, "length"
            elif token in eos_ids:
                req.phase, req.finish_reason = Phase.FINISHED, "eos"

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
        _check_request_types(request)
        uuid, prompt = request.uuid, request.prompt_ids
        where = f"request {uuid!r}"
        if uuid in self.state.requests or uuid in self.state.outputs:
            raise RequestError(f"{where}: uuid already used; uuids must be unique per worker")
        if uuid.startswith(FAULT_OWNER_PREFIX):
            raise RequestError(
                f"{where}: uuids starting with {FAULT_OWNER_PREFIX!r} are reserved (fault injection"
                " holds pool pages under them)"
            )
        if not prompt:
            raise RequestError(f"{where}: empty prompt; a prompt needs at least one token")
        if request.max_new_tokens < 1:
            raise RequestError(f"{where}: max_new_tokens={request.max_new_tokens}; must be >= 1")
        if not (math.isfinite(request.temperature) and request.temperature >= 0):
            raise RequestError(
                f"{where}: temperature={request.temperature}; must be a finite number >= 0 "
                "(0 = greedy)"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{where}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        total = len(prompt) + request.max_new_tokens
        if total > self.model_config.max_context:
            raise RequestError(
                f"{where}: prompt ({len(prompt)}) + max_new_tokens ({request.max_new_tokens}) ="
                f" {total} exceeds the model's context of {self.model_config.max_context} tokens"
            )
        usable = self.cache_config.num_gpu_pages - self.cache_config.watermark_pages
        if self.cache_config.pages_for(total) > usable:
            raise RequestError(
                f"{where}: needs {self.cache_config.pages_for(total)} KV pages but the GPU pool has"
                f" {usable} usable pages ({self.cache_config.num_gpu_pages} minus the watermark)"
            )

    # ---- integrity -----------------------------------------------------------------------
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
                assert req.load_handle is not None and len(req.gpu_page_ids) == len(
                    req.host_page_ids
                ), uuid
            elif req.phase is Phase.RUNNING:
                assert len(req.gpu_page_ids) >= self.cache_config.pages_for(
                    req.num_cached_tokens
                ), uuid
        stray = set(self._pending_kv_append_tensors) - set(live)
        assert not stray, f"pending appends for released requests: {sorted(stray)}"
