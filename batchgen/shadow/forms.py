"""A KV op's post-state as compare mode and replay see it: canonical forms, and verdict names.

A canonical form is plain comparable data with flattened paths (``requests[r17].gpu_page_ids[3]``):
the requests an op wrote, new outputs, pending appends, counters, each pool's allocator events and
the ordered copy operations. ``replay`` builds the same forms from a divergence record, so a
replayed op is judged exactly as the live one was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batchgen.kv.plan_checks import PlanRejected
from batchgen.kv.target import KvTarget
from batchgen.shadow.fork import ForkTarget, detach_fork, differing_requests
from batchgen.shadow.recording import RecordedTarget
from compare import Keyed, Observation

STAT_FIELDS = (
    "evictions", "loads", "load_failures", "recompute_preemptions", "prefix_cache_queries",
    "prefix_cache_hits",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ShadowRun:
    """What the shadow step of an op leaves for canonicalization."""

    fork: ForkTarget  # the shadow's post-state, its pools' journals and copies included
    result: object  # what the shadow path's op returned
    # the fork's free GPU and host pages after the op: readable only until the authoritative path
    # changes the worker's pools
    free_pages: tuple[int, int]


def canonical_pair(target: RecordedTarget, seen: Observation, shadow: ShadowRun | None) -> tuple:
    """Both canonical forms of one compared op, once the authoritative path ran on ``target`` (the
    worker's, recorded: ``seen``) and the shadow path on its fork (``shadow``; None: it raised).
    Only requests whose post-states differ are canonicalized, on both sides; journals and copy
    lists equal on both sides are canonicalized once and shared; when neither side wrote anything
    both forms are only counters and result (everything else equals the pre-state on both sides).
    A side that raised gets None (the other's form is still logged). Pure, but for the fork's view
    (``detach_fork``)."""
    written, dropped = target.state.written, target.dropped
    gpu, host = target.gpu_kv, target.host_kv
    if seen.raised:
        return None, None if shadow is None else _whole_form(shadow.fork, shadow)
    if shadow is None:
        form = canonical_kv(
            target, list(written), seen.value, gpu.journal, host.journal, host.copies
        )
        return form, None
    fork = shadow.fork
    if _wrote_nothing(fork) and _wrote_nothing(target):
        return _quiet_form(target, seen.value), _quiet_form(fork, shadow.result)
    gpu_events, fork_gpu_events = _shared(gpu.journal, fork.gpu_kv.journal, canonical_events)
    host_events, fork_host_events = _shared(host.journal, fork.host_kv.journal, canonical_events)
    copies, fork_copies = _shared(host.copies, fork.host_kv.copies, canonical_copies)
    detach_fork(fork, written, dropped)
    differing = differing_requests(fork, target, written, dropped)
    theirs = canonical_form(
        fork, shadow.result, shadow.free_pages, fork_gpu_events, fork_host_events, fork_copies,
        differing,
    )  # fmt: skip
    free_pages = (gpu.free_pages(), host.free_pages())
    mine = canonical_form(
        target, seen.value, free_pages, gpu_events, host_events, copies, differing
    )
    return mine, theirs


def _whole_form(fork: ForkTarget, shadow: ShadowRun) -> dict:
    """The shadow's form when the authoritative path raised: replay reads its journals."""
    gpu_events = canonical_events(fork.gpu_kv.journal)
    host_events = canonical_events(fork.host_kv.journal)
    copies = canonical_copies(fork.host_kv.copies)
    return canonical_form(fork, shadow.result, shadow.free_pages, gpu_events, host_events, copies)


def _wrote_nothing(target: RecordedTarget) -> bool:
    """Whether the op on ``target`` changed no request, pending append, pool page or copy (what
    its wrappers recorded: ``batchgen.shadow.recording``). Pure."""
    host = target.host_kv
    return not (
        target.state.written
        or target.dropped
        or target.gpu_kv.journal
        or host.journal
        or host.copies
    )


def _quiet_form(target: KvTarget, result) -> dict:
    return {"stats": canonical_stats(target), "result": canonical_result(result)}


def _shared(mine: list, theirs: list, canonicalize: Callable[[list], list]) -> tuple[list, list]:
    """Both sides' canonical lists; one list, shared, when the raw ones are equal."""
    canonical = canonicalize(mine)
    return canonical, canonical if theirs == mine else canonicalize(theirs)


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


def canonical_stats(target: KvTarget) -> dict:
    stats = target.state.stats
    return {name: getattr(stats, name) for name in STAT_FIELDS}


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
    """Canonicalize ``uuids`` on ``target`` into ``requests`` (live) and ``outputs`` (released).
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
                "num_cached_prompt_tokens": req.num_cached_prompt_tokens,
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
