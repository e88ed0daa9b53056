"""Rebuild one logged KV op's pre-state from its divergence record alone.

:func:`rebuild_target` turns a :class:`compare.DivergenceRecord`'s ``replay`` payload back into
the op's pre-state (``replay`` runs both paths on it). Nothing outside the record is read.

What the record gives and what is synthesised (nothing an op's result depends on, unless noted)::

    record                                  rebuilt as
    request (the op request, JSON)          the op's input: loads observed, uuids released,
                                            batch allocated; checked against the rebuilt state
    pre_state.snapshot.geometry             model / cache / engine configs (other model
                                            fields: any valid values; the KV ops never read them)
    pre_state.requests (the op's scope,     a RequestState each: phase, page tables, cached
      as it was before the op)              count, retries, swapped step, prompt digests and
                                            cached prompt count; prompt and outputs:
                                            zeros, num_prompt_tokens and the rest of
                                            num_tokens, finish reason None; a
                                            CompletedHandle as the load of a LOADING request
                                            (or of a done one holding both tiers' pages),
                                            issued the step before
    free counts + pools' alloc and share    bookkeeping-only pools (``rebuild_pools``): scope
      events                                pages held as the views say, in arrival order (a
                                            page named twice is shared: prefix caching only);
                                            free queue = ids the sides allocated or shared
                                            (the legacy side's order, then the other's extras),
                                            then the op request's cache entries, then other
                                            unowned ids ascending, cut at the free count;
                                            every other page held by PLACEHOLDER_OWNER
    prefix caching: the op request's        digests: each page of alloc's and migrate's
      cached_pages / cache_entries,         cached prefixes under its request's prompt digest
      evict's shared_page_holders           there (a cache entry: free, in the queue, its
                                            digest kept), each shared page under a holder's
                                            digest at its index; holds outside the scope (a
                                            cached page the scope does not hold, evict's
                                            holders beyond the scope's): PLACEHOLDER_OWNER,
                                            then "<...> #2", ... Other held pages: no digest
                                            (no op looks them up)
    (not recorded) outside holds on scope   poll / release: none (the scope's holds only),
      pages                                 so a page they free that another request held
                                            shows as freed: other free counts in the diff
    (not recorded) counters                 zero: a counter divergence has the same path,
                                            but other absolute values in the diff detail
    (not recorded) pending appends          poll / release (before the flush) only: a done
                                            request served last step (0 < cached ==
                                            num_tokens - 1, GPU pages only). Inferred: a
                                            request aborted after an unserved step looks the same
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from batchgen.config import DTYPE_SIZES, CacheConfig, EngineConfig, ModelConfig, validation_summary
from batchgen.kv.backends import CompletedHandle, GpuKvPool, HostKvPool
from batchgen.kv.plans import OP_REQUEST_TYPES, KvGeometry, KvPreState, RequestKvView, from_json
from batchgen.kv.target import KvTarget
from batchgen.state import (
    DONE_PHASES,
    Phase,
    Request,
    RequestState,
    TokenLogprobs,
    WorkerState,
)
from batchgen.triage.rebuild_pools import (
    CacheFacts,
    ReplayError,
    cache_facts,
    gpu_index,
    rebuilt_pool,
)
from compare import DivergenceRecord

_PRE_FLUSH_OPS = ("poll", "release")  # ops that run before the worker flushes pending appends


def op_request(record: DivergenceRecord):
    """The record's typed op request (snapshot + op input). Pure."""
    replay = record.replay
    op = replay.get("op")
    cls = OP_REQUEST_TYPES.get(op)
    if cls is None:
        raise ReplayError(
            f"record of step {record.step}: unknown op {op!r}; known: {', '.join(OP_REQUEST_TYPES)}"
        )
    # what compare mode records when no request was built
    if replay.get("request_type") == "NoneType":
        raise ReplayError(
            f"{op} step {record.step}: the plan path raised before building its op request, so the"
            f" record holds no pre-state to replay ({record.exception}); `batchgen minimize` reruns"
            " its workload instead"
        )
    if replay.get("request_type") != cls.__name__:
        raise ReplayError(
            f"op {op!r} needs a {cls.__name__}, the record holds {replay.get('request_type')!r}"
        )
    return _from_record(cls, replay.get("request"), f"op {op!r}: the recorded request")


def recorded_pre_state(record: DivergenceRecord) -> KvPreState:
    """The op's pre-state as the record holds it. Pure."""
    return _from_record(
        KvPreState, record.replay.get("pre_state"), f"op {record.op!r}: the recorded pre-state"
    )


def _from_record(cls, value, what: str):
    try:
        return from_json(cls, json.dumps(value))
    except ValidationError as error:
        raise ReplayError(
            f"{what} is not a valid {cls.__name__}: {validation_summary(error)}"
        ) from None


def rebuild_target(record: DivergenceRecord) -> KvTarget:
    """A fresh target holding the op's pre-state as the record describes it. Pure."""
    pre = recorded_pre_state(record)
    snapshot, views = pre.snapshot, pre.requests
    geometry = snapshot.geometry
    model_config, cache_config, engine_config = _configs(geometry)
    state = WorkerState(step=snapshot.step)
    # the worker's requests keep arrival order
    for view in sorted(views, key=lambda v: v.arrival_index):
        state.requests[view.uuid] = _request_state(view, snapshot.step)
    state.num_submitted = max((view.arrival_index for view in views), default=-1) + 1
    facts = cache_facts(op_request(record), views) if geometry.prefix_caching else CacheFacts()
    gpu_pages = rebuilt_pool(
        "gpu",
        geometry.num_gpu_pages,
        {v.uuid: v.gpu_page_ids for v in views},
        snapshot.num_free_gpu_pages,
        _queue_head(record.replay, "gpu"),
        gpu_index(views, facts) if geometry.prefix_caching else None,
        facts,
    )
    host_pages = rebuilt_pool(
        "host",
        geometry.num_host_pages,
        {v.uuid: v.host_page_ids for v in views},
        snapshot.num_free_host_pages,
        _queue_head(record.replay, "host"),
    )
    gpu = GpuKvPool(geometry.num_gpu_pages, None, pages=gpu_pages)
    host = HostKvPool(geometry.num_host_pages, None, gpu, pages=host_pages)
    pre_flush = record.replay["op"] in _PRE_FLUSH_OPS  # only then is a K/V append pending
    pending = {view.uuid: None for view in views if pre_flush and _served_last_step(view)}
    return KvTarget(state, gpu, host, pending, model_config, cache_config, engine_config)


def kv_paths(replay: dict) -> tuple[str, str]:
    """A record's authoritative and shadow KV paths (``replay``: its payload); ReplayError unless
    each is plan or legacy. Pure."""
    paths = replay.get("kv_path"), replay.get("shadow_path")
    for key, path in zip(("kv_path", "shadow_path"), paths):
        if path not in ("plan", "legacy"):
            raise ReplayError(f"the record's {key} must be plan or legacy, not {path!r}")
    return paths


def _configs(geometry: KvGeometry) -> tuple[ModelConfig, CacheConfig, EngineConfig]:
    dtype = next((name for name, size in DTYPE_SIZES.items() if size == geometry.dtype_size), None)
    if dtype is None:
        raise ReplayError(
            f"no cache dtype has {geometry.dtype_size}-byte elements; known: {DTYPE_SIZES}"
        )
    try:
        return _valid_configs(geometry, dtype)
    except ValidationError as error:
        raise ReplayError(
            f"the recorded geometry is not valid: {validation_summary(error)}"
        ) from None


def _valid_configs(
    geometry: KvGeometry, dtype: str
) -> tuple[ModelConfig, CacheConfig, EngineConfig]:
    model = ModelConfig(
        vocab_size=2,
        hidden_size=geometry.num_kv_heads * geometry.head_dim,
        intermediate_size=1,
        num_layers=geometry.num_layers,
        num_heads=geometry.num_kv_heads,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        max_context=geometry.num_gpu_pages * geometry.page_size,
    )
    cache = CacheConfig(
        page_size=geometry.page_size,
        num_gpu_pages=geometry.num_gpu_pages,
        num_host_pages=geometry.num_host_pages,
        dtype=dtype,
        watermark=geometry.watermark,
        enable_prefix_caching=geometry.prefix_caching,
    )
    engine = EngineConfig(
        max_num_seqs=geometry.max_num_seqs,
        max_load_retries=geometry.max_load_retries,
        load_failure=geometry.load_failure,
    )
    return model, cache, engine


NO_LOGPROBS = TokenLogprobs((0, 0), (0.0, 0.0))  # of each rebuilt output token: no KV op reads them


def _request_state(view: RequestKvView, step: int) -> RequestState:
    phases = [phase.value for phase in Phase]
    if view.phase not in phases:
        raise ReplayError(
            f"request {view.uuid}: unknown phase {view.phase!r}; known: {', '.join(phases)}"
        )
    phase = Phase(view.phase)
    num_prompt_tokens = view.num_prompt_tokens
    if not 1 <= num_prompt_tokens <= view.num_tokens:
        raise ReplayError(
            f"request {view.uuid}: num_prompt_tokens {num_prompt_tokens} is not in [1, num_tokens ="
            f" {view.num_tokens}]"
        )
    had_load = phase is Phase.LOADING or bool(view.gpu_page_ids and view.host_page_ids)
    num_outputs = view.num_tokens - num_prompt_tokens
    return RequestState(
        Request(view.uuid, (0,) * num_prompt_tokens, max_new_tokens=num_outputs + 1),
        view.arrival_index,
        phase,
        output_ids=[0] * num_outputs,
        output_logprobs=[NO_LOGPROBS] * num_outputs,
        num_cached_tokens=view.num_cached_tokens,
        gpu_page_ids=tuple(view.gpu_page_ids),
        host_page_ids=tuple(view.host_page_ids),
        load_handle=CompletedHandle() if had_load else None,
        load_started_step=step - 1 if had_load else None,
        num_load_retries=view.num_load_retries,
        swapped_step=view.swapped_step,
        prompt_digests=tuple(view.prompt_digests),
        num_cached_prompt_tokens=view.num_cached_prompt_tokens,
    )


def _served_last_step(view: RequestKvView) -> bool:
    """Whether a request still holds last step's K/V as a pending append (inferred)."""
    return (
        Phase(view.phase) in DONE_PHASES
        and 0 < view.num_cached_tokens == view.num_tokens - 1
        and bool(view.gpu_page_ids)
        and not view.host_page_ids
    )


def _queue_head(replay: dict, tier: str) -> list[int]:
    """Page ids the sides allocated or shared in ``tier``, in the order the original free queue
    held them (``rebuild_pools`` keeps those free then: a shared one is a cache entry).

    The legacy path allocates straight from the queue head, and shares a request's cache entries
    before it allocates its new pages, so its events give the queue's order (a shared entry as
    early as it may have been); the plan path's only do while it is correct. So: the legacy
    side's ids first (the authoritative's when neither or both sides are legacy), then the
    other side's extras.
    """
    kv_path, shadow_path = kv_paths(replay)
    legacy_is_shadow = shadow_path == "legacy" and kv_path != "legacy"
    sides = ("shadow", "authoritative") if legacy_is_shadow else ("authoritative", "shadow")
    pools = replay.get("pools") or {}
    if not isinstance(pools, dict) or not all(
        isinstance(pools.get(side) or {}, dict) for side in sides
    ):
        raise ReplayError(
            "the record's pools must map authoritative and shadow to their pools' events, not "
            f"{pools!r}"
        )
    ids: list[int] = []
    for side in sides:
        for event in (pools.get(side) or {}).get(tier, ()):
            if (
                not isinstance(event, dict)
                or "kind" not in event
                or not _is_id_list(event.get("page_ids"))
            ):
                raise ReplayError(
                    f"the record's {side} {tier} pool events are not records with a kind and page"
                    f" ids ({event!r}); a log written by an older batchgen cannot be replayed"
                )
            if event["kind"] in ("alloc", "share"):
                ids.extend(event["page_ids"])
    return list(dict.fromkeys(ids))


def _is_id_list(value) -> bool:
    return isinstance(value, list) and all(type(page_id) is int for page_id in value)
