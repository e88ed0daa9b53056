"""A KV op's post-state as compare mode sees it: forks of an op's scope, canonical forms, verdict names.

A fork copies the scope's requests (bookkeeping only) and overlays both pools; a
canonical form is plain comparable data with flattened paths
(``requests[r17].gpu_page_ids[3]``). ``replay`` builds the same forms from a
divergence record, so a replayed op is judged exactly as the live one was.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Sequence
from itertools import repeat, starmap
from types import SimpleNamespace

from compare import Keyed
from batchgen.worker.kv_apply import PlanRejected
from batchgen.worker.kv_target import KvTarget
from batchgen.worker.state import RequestState, WorkerState

STAT_FIELDS = ("evictions", "loads", "load_failures", "recompute_preemptions")

# RequestState(*_request_fields(req)) is copy.copy(req), about 5x faster (a fork copies its whole scope).
_request_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(RequestState)))

# The RequestState fields behind canonical_kv's view of a live request (pending appends are checked apart).
KV_FIELDS = ("phase", "num_cached_tokens", "gpu_page_ids", "host_page_ids", "num_load_retries", "swapped_step",
             "finish_reason", "load_handle", "load_started_step")
_kv_fields = operator.attrgetter(*KV_FIELDS)
_RELEASED = SimpleNamespace(**{name: None for name in KV_FIELDS})  # stands for a request no longer live


def differing_requests(scope: Sequence[str], a: KvTarget, b: KvTarget) -> list[str]:
    """The requests of ``scope`` whose ``canonical_kv`` entries may differ between two post-states of one op:
    ``a`` a fork (it holds the scope's requests only), ``b`` the worker. Pure. A request left out has
    equal entries on both sides; one named may still turn out equal. One C-level pass over the scope;
    pending appends and outputs only when present."""
    mine = map(_kv_fields, map(a.state.requests.get, scope, repeat(_RELEASED)))
    theirs = map(_kv_fields, map(b.state.requests.get, scope, repeat(_RELEASED)))
    differing = [u for u, x, y in zip(scope, mine, theirs) if x != y]
    if a.pending_appends or b.pending_appends:  # poll and release: small scopes
        differing += [u for u in scope if (u in a.pending_appends) != (u in b.pending_appends)]
    if len(a.state.requests) < len(scope):  # released by the fork: maybe on both sides
        gone = [u for u in scope if u not in a.state.requests and u not in b.state.requests]
        differing += [u for u in gone if _output_key(a, u) != _output_key(b, u)]
    return list(dict.fromkeys(differing))


def _output_key(target: KvTarget, uuid: str) -> tuple | None:
    out = target.state.outputs.get(uuid)
    return None if out is None else (out.phase, out.finish_reason, len(out.output_ids))


def fork_target(target: KvTarget, scope: Sequence[str]) -> KvTarget:
    """A target over copies of the scope's requests and forked pools; the original is untouched."""
    state = target.state
    copies = starmap(RequestState, map(_request_fields, map(state.requests.__getitem__, scope)))
    forked = WorkerState(step=state.step, requests=dict(zip(scope, copies)),
                         stats=copy.copy(state.stats), num_submitted=state.num_submitted)
    gpu = target.gpu_kv.fork()
    host = target.host_kv.fork(gpu)
    live_pending = target.pending_appends
    pending = {u: live_pending[u] for u in scope if u in live_pending} if live_pending else {}
    return KvTarget(forked, gpu, host, pending, target.model_config, target.cache_config, target.engine_config)


def canonical_kv(target: KvTarget, scope: Sequence[str], result, gpu_events, host_events, copies) -> dict:
    """The comparable post-state of one op on ``target``, over the requests in ``scope``. Pure."""
    requests, outputs = Keyed(), Keyed()
    add_requests(requests, outputs, target, scope)
    return {
        "requests": requests,
        "outputs": outputs,
        "stats": canonical_stats(target),
        "pools": canonical_pools(target, canonical_events(gpu_events), canonical_events(host_events)),
        "copies": canonical_copies(copies),
        "result": result,
    }


def canonical_stats(target: KvTarget) -> dict:
    stats = target.state.stats
    return {name: getattr(stats, name) for name in STAT_FIELDS}


def canonical_events(events) -> list:
    return [[e.kind, e.uuid, list(e.page_ids)] for e in events]


def canonical_pools(target: KvTarget, gpu_events: list, host_events: list) -> dict:
    return {"gpu": gpu_events, "host": host_events,
            "num_free_gpu": target.gpu_kv.free_pages(), "num_free_host": target.host_kv.free_pages()}


def canonical_copies(copies) -> list:
    return [[c.kind, c.uuid, list(c.src_page_ids), list(c.dst_page_ids)] for c in copies]


def add_requests(requests: Keyed, outputs: Keyed, target: KvTarget, uuids: Sequence[str]) -> None:
    """Canonicalise ``uuids`` on ``target`` into ``requests`` (live) and ``outputs`` (released). Mutates both."""
    live, done = target.state.requests, target.state.outputs
    for u in uuids:
        req = live.get(u)
        if req is not None:
            requests[u] = {
                "phase": req.phase.value, "num_cached_tokens": req.num_cached_tokens,
                "gpu_page_ids": list(req.gpu_page_ids), "host_page_ids": list(req.host_page_ids),
                "num_load_retries": req.num_load_retries, "swapped_step": req.swapped_step,
                "finish_reason": req.finish_reason, "has_load": req.load_handle is not None,
                "load_started_step": req.load_started_step,
                "has_pending_append": u in target.pending_appends,
            }
        elif u in done:
            out = done[u]
            outputs[u] = {"phase": out.phase.value, "finish_reason": out.finish_reason,
                          "num_output_ids": len(out.output_ids),
                          "has_pending_append": u in target.pending_appends}


def classify(paths: tuple[str, ...]) -> str:
    return "copies" if all(p.startswith("copies") for p in paths) else "state"


def exception_kind(error: BaseException) -> str:
    return "invalid_plan" if isinstance(error, PlanRejected) else "exception"
