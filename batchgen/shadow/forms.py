"""A KV op's post-state as compare mode sees it: forks of the worker's state, canonical forms,
verdict names.

A fork shares the requests until it writes them (copy-on-write) and overlays both
pools; a canonical form is plain comparable data with flattened paths
(``requests[r17].gpu_page_ids[3]``). ``replay`` builds the same forms from a
divergence record, so a replayed op is judged exactly as the live one was.
"""

from __future__ import annotations

import operator
from collections import ChainMap
from collections.abc import Collection, Iterable, Mapping, Sequence, Set
from functools import partial
from itertools import repeat
from types import SimpleNamespace

from batchgen.engine.state import Phase, RequestState, WorkerState
from batchgen.kv.plan_path import PlanRejected
from batchgen.kv.plans import KvPreState, RequestKvView
from batchgen.kv.target import KvTarget
from compare import Keyed

STAT_FIELDS = ("evictions", "loads", "load_failures", "recompute_preemptions")

# The RequestState fields behind canonical_kv's view of a live request (pending appends are checked
# apart): what KV ops write, and what they read that no KV op should change (num_tokens: page
# demand; arrival_index: the eviction and migration order).
KV_FIELDS = (
    "phase",
    "num_cached_tokens",
    "gpu_page_ids",
    "host_page_ids",
    "num_load_retries",
    "swapped_step",
    "finish_reason",
    "load_handle",
    "load_started_step",
    "num_tokens",
    "arrival_index",
)
_kv_fields = operator.attrgetter(*KV_FIELDS)
# stands for a request no longer live
_RELEASED = SimpleNamespace(**{name: None for name in KV_FIELDS})


def fork_target(target: KvTarget) -> KvTarget:
    """A copy-on-write fork of ``target``: its request dict and requests shared until written
    (``WorkerState.edit``), pools overlaid, pending appends shared with drops only recorded
    (``KvTarget.drop_pending_append``). Costs what the op on it writes; the original is never
    mutated through it."""
    state = target.state
    forked = WorkerState(
        step=state.step,
        requests=state.requests,
        stats=state.stats.copy(),
        num_submitted=state.num_submitted,
        written={},
        copy_on_write=True,
    )
    gpu = target.gpu_kv.fork()
    host = target.host_kv.fork(gpu)
    return KvTarget(
        forked,
        gpu,
        host,
        target.pending_appends,
        target.model_config,
        target.cache_config,
        target.engine_config,
        dropped=set(),
        shared_pending=True,
    )


def detach_fork(
    fork: KvTarget, written: Mapping[str, RequestState], dropped: Collection[str]
) -> None:
    """After the worker wrote ``written`` (uuid -> the request before its first write) and dropped
    the pending appends ``dropped``: let the fork read as its own post-state where it shares state
    with the worker, by putting those prior states in front (ChainMaps: nothing shared is written),
    and its record of the requests before it wrote them (``fork.state.written``) name their states
    before the op. Mutates ``fork.state.requests``, ``fork.state.written`` and
    ``fork.pending_appends``."""
    own = fork.state.written
    prior = {uuid: before for uuid, before in written.items() if uuid not in own}
    if prior:
        fork.state.requests = ChainMap(prior, fork.state.requests)
    # The fork noted the worker's request objects as its "before"; those the worker wrote changed
    # since.
    fork.state.written = {uuid: written.get(uuid, before) for uuid, before in own.items()}
    if dropped:
        fork.pending_appends = ChainMap(dict.fromkeys(dropped), fork.pending_appends)


def differing_requests(
    fork: KvTarget, target: KvTarget, written: Iterable[str], dropped: Set[str]
) -> list[str]:
    """The requests whose ``canonical_kv`` entries may differ between two post-states of one op:
    ``fork`` (copy-on-write, its writes in ``fork.state.written`` and ``fork.dropped``, detached:
    :func:`detach_fork`) and ``target``, which wrote ``written`` and dropped the pending appends
    ``dropped``. Pure.

    A request neither side wrote is the same object on both; so only the written ones are checked
    (one C-level field comparison each), those whose pending append one side dropped, and outputs
    of released ones. A request left out has equal entries on both sides; one named may still turn
    out equal.
    """
    candidates = list(dict.fromkeys([*written, *fork.state.written]))
    mine = map(_kv_fields, map(fork.state.requests.get, candidates, repeat(_RELEASED)))
    theirs = map(_kv_fields, map(target.state.requests.get, candidates, repeat(_RELEASED)))
    differing = [u for u, x, y in zip(candidates, mine, theirs) if x != y]
    differing += sorted(fork.dropped ^ dropped)
    gone = [
        u for u in candidates if u not in fork.state.requests and u not in target.state.requests
    ]
    differing += [u for u in gone if _output_key(fork, u) != _output_key(target, u)]
    return list(dict.fromkeys(differing))


def _output_key(target: KvTarget, uuid: str) -> tuple | None:
    out = target.state.outputs.get(uuid)
    return None if out is None else (out.phase, out.finish_reason, len(out.output_ids))


# One RequestKvView per request: its fields read in C (attrgetter), then the prompt's length.
_VIEW_FIELDS = operator.attrgetter(
    "uuid",
    "phase._value_",
    "arrival_index",
    "num_tokens",
    "num_cached_tokens",
    "gpu_page_ids",
    "host_page_ids",
    "num_load_retries",
    "swapped_step",
)
_new_view = partial(tuple.__new__, RequestKvView)
_SCOPE_PHASES = {
    "evict": (Phase.RUNNING,),
    "migrate": (Phase.RUNNING, Phase.SWAPPED, Phase.LOADING),
}


def views_of(scope: Iterable[RequestState]) -> tuple[RequestKvView, ...]:
    return tuple([_new_view((*_VIEW_FIELDS(r), len(r.request.prompt_ids))) for r in scope])


def op_scope(op: str, request, requests: Mapping[str, RequestState]) -> list[str]:
    """The requests op may read or write, given its op ``request``: those its input names (poll: the
    loads observed, release: the done requests, alloc: the batch), or for evict and migrate every
    request of ``requests`` in the phases they act on. Pure."""
    phases = _SCOPE_PHASES.get(op)
    if phases is not None:
        return [u for u, r in requests.items() if r.phase in phases]
    return list(request.uuids if op in ("poll", "release") else request.batch)


def pre_state(
    op: str, request, target: KvTarget, written: Mapping[str, RequestState]
) -> KvPreState:
    """The op's scope as it was before the op ran on ``target``, which wrote ``written`` (uuid ->
    the request before its first write), with ``request``'s snapshot. Pure; O(live requests), so
    built only to log a divergence."""
    prior = {u: written.get(u, r) for u, r in target.state.requests.items()}
    prior.update((u, r) for u, r in written.items() if u not in prior)  # taken out by the op
    scope = sorted(
        (prior[u] for u in op_scope(op, request, prior)), key=operator.attrgetter("arrival_index")
    )
    return KvPreState(request.snapshot, views_of(scope))


def canonical_kv(
    target: KvTarget, scope: Sequence[str], result, gpu_journal, host_journal, copies
) -> dict:
    """The comparable post-state of one op on ``target``, over the requests in ``scope``, from its
    pools' raw journals and copy list. Pure."""
    free_pages = (target.gpu_kv.free_pages(), target.host_kv.free_pages())
    return canonical_form(
        target,
        result,
        free_pages,
        canonical_events(gpu_journal),
        canonical_events(host_journal),
        canonical_copies(copies),
        scope,
    )


def canonical_form(
    target: KvTarget,
    result,
    free_pages: tuple[int, int],
    gpu_events: list,
    host_events: list,
    copies: list,
    scope: Sequence[str] = (),
) -> dict:
    """The comparable post-state of one op on ``target``: the requests in ``scope`` (live ones and
    released outputs), its counters, the op's result, the free GPU and host pages, and the pools'
    events and the copies (each already canonical: ``canonical_events``, ``canonical_copies``). The
    one shape compare mode and replay both build. Pure."""
    requests, outputs = Keyed(), Keyed()
    add_requests(requests, outputs, target, scope)
    free_gpu, free_host = free_pages
    return {
        "requests": requests,
        "outputs": outputs,
        "stats": canonical_stats(target),
        "pools": {
            "gpu": gpu_events,
            "host": host_events,
            "num_free_gpu": free_gpu,
            "num_free_host": free_host,
        },
        "copies": copies,
        "result": canonical_result(result),
    }


def canonical_result(result):
    """What an op returned, comparable: alloc's served uuids as a list (a tuple of the same uuids is
    the same answer), None for the other ops; anything else as it is (an iterator is never consumed
    here). Pure."""
    return list(result) if type(result) in (list, tuple) else result


_stat_values = operator.attrgetter(*STAT_FIELDS)  # a tuple: STAT_FIELDS names more than one field


def canonical_stats(target: KvTarget) -> dict:
    # built in C: two per compared op
    return dict(zip(STAT_FIELDS, _stat_values(target.state.stats)))


# Journal events and copies as records with named fields, so a report's wildcarded paths keep them
# apart (`copies[*].dst_page_ids[*]`, not `copies[*][*][*]` for source and destination alike).
def canonical_events(events) -> list:
    return [{"kind": e.kind, "uuid": e.uuid, "page_ids": list(e.page_ids)} for e in events]


def canonical_copies(copies) -> list:
    return [
        {
            "kind": c.kind,
            "uuid": c.uuid,
            "src_page_ids": list(c.src_page_ids),
            "dst_page_ids": list(c.dst_page_ids),
        }
        for c in copies
    ]


def load_name(target: KvTarget, uuid: str, handle) -> str | None:
    """Which load ``uuid``'s handle tracks after an op on ``target``: None (no load), "prior" (the
    handle it had before the op), "issued" (the handle of the load the op issued for it), "issued
    for <other uuid>", or "other" (a handle of no load of this op). Named by what the load is, not
    where it sits in the op's copies, so loads issued in another order differ in the copies alone.

    Reads the requests the op wrote as they were before it (``target.state.written``) and the
    handles its host pool returned (``load_handles``); a request the op did not write keeps its
    handle. Pure."""
    if handle is None:
        return None
    prior = (target.state.written or {}).get(uuid)
    if prior is None or prior.load_handle is handle:
        return "prior"
    loaded, issued = (target.host_kv.load_handles or {}).get(id(handle), (None, None))
    if issued is not handle:
        return "other"
    return "issued" if loaded == uuid else f"issued for {loaded}"


def add_requests(requests: Keyed, outputs: Keyed, target: KvTarget, uuids: Sequence[str]) -> None:
    """Canonicalise ``uuids`` on ``target`` into ``requests`` (live) and ``outputs`` (released).
    Mutates both."""
    live, done = target.state.requests, target.state.outputs
    for u in uuids:
        req = live.get(u)
        if req is not None:
            requests[u] = {
                "phase": req.phase.value,
                "num_cached_tokens": req.num_cached_tokens,
                "gpu_page_ids": list(req.gpu_page_ids),
                "host_page_ids": list(req.host_page_ids),
                "num_load_retries": req.num_load_retries,
                "swapped_step": req.swapped_step,
                "finish_reason": req.finish_reason,
                "load": load_name(target, u, req.load_handle),
                "load_started_step": req.load_started_step,
                "num_tokens": req.num_tokens,
                "arrival_index": req.arrival_index,
                "has_pending_append": target.has_pending_append(u),
            }
        elif u in done:
            out = done[u]
            outputs[u] = {
                "phase": out.phase.value,
                "finish_reason": out.finish_reason,
                "num_output_ids": len(out.output_ids),
                "has_pending_append": target.has_pending_append(u),
            }


def classify(paths: tuple[str, ...]) -> str:
    return "copies" if all(p.startswith("copies") for p in paths) else "state"


def exception_kind(error: BaseException) -> str:
    return "invalid_plan" if isinstance(error, PlanRejected) else "exception"
