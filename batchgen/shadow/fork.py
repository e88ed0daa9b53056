"""Forks of the worker's KV state for the shadow path, what differs after an op, and the
op's pre-state a logged divergence carries.

A fork shares the worker's request dict and requests until it writes them (copy-on-write,
``recording.ForkedState``) and overlays both pools (``forked_pages.ForkedPagePool``): it costs
what the op on it writes, records it as the authoritative side's wrappers do
(``batchgen.shadow.recording``), and the worker is never mutated through it.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Collection, Iterable, Mapping, Set
from dataclasses import dataclass, field

from batchgen.kv.backends import GpuKvPool, HostKvPool
from batchgen.kv.plans import KvPreState, RequestKvView
from batchgen.kv.target import KvTarget
from batchgen.shadow.forked_pages import ForkedPagePool
from batchgen.shadow.recording import ForkedState, RecordingHostPool, RecordingPool
from batchgen.state import Phase, RequestState


@dataclass(slots=True)
class ForkTarget(KvTarget):
    """A fork's target: its pending appends are the worker's, never written; ``dropped``: those
    the op on the fork dropped."""

    dropped: set[str] = field(default_factory=set)

    def drop_pending_append(self, uuid: str) -> None:
        """Mutates ``dropped``."""
        if self.has_pending_append(uuid):
            self.dropped.add(uuid)

    def has_pending_append(self, uuid: str) -> bool:
        return uuid in self.pending_appends and uuid not in self.dropped


def fork_target(target: KvTarget) -> ForkTarget:
    """A copy-on-write fork of ``target``: its request dict and requests shared until written,
    pools overlaid (bookkeeping only: the fork's host pool issues no copy), pending appends
    shared; everything the op on it writes recorded. Pure."""
    gpu = GpuKvPool(target.gpu_kv.num_pages, None, pages=ForkedPagePool(target.gpu_kv.pages))
    pages = ForkedPagePool(target.host_kv.pages)
    gpu_kv, host_kv = (
        RecordingPool(gpu),
        RecordingHostPool(HostKvPool(pages.num_pages, None, gpu, pages=pages)),
    )
    gpu_kv.journal, host_kv.journal, host_kv.copies, host_kv.load_handles = [], [], [], {}
    configs = (target.model_config, target.cache_config, target.engine_config)
    return ForkTarget(ForkedState(target.state), gpu_kv, host_kv, target.pending_appends, *configs)


def detach_fork(
    fork: ForkTarget, written: Mapping[str, RequestState], dropped: Collection[str]
) -> None:
    """After the worker wrote ``written`` (uuid -> the request before its first write) and dropped
    the pending appends ``dropped``: let the fork read as its own post-state where it shares state
    with the worker, by putting those prior states in front (ChainMaps: nothing shared is
    written), and its record of the requests before it wrote them name their states before the
    op. Mutates ``fork.state.requests``, ``fork.state.written`` and ``fork.pending_appends``."""
    own = fork.state.written
    prior = {uuid: before for uuid, before in written.items() if uuid not in own}
    if prior:
        fork.state.requests = ChainMap(prior, fork.state.requests)
    # the fork noted the worker's request objects as its "before"; those the worker wrote changed
    fork.state.written = {uuid: written.get(uuid, before) for uuid, before in own.items()}
    if dropped:
        fork.pending_appends = ChainMap(dict.fromkeys(dropped), fork.pending_appends)


# The fields of a request a KV op writes, and the two it reads that none may change (num_tokens:
# page demand; arrival_index: eviction and migration order).
KV_FIELDS = (
    "phase", "num_cached_tokens", "gpu_page_ids", "host_page_ids", "num_load_retries",
    "swapped_step", "finish_reason", "load_handle", "load_started_step", "num_tokens",
    "num_cached_prompt_tokens", "arrival_index",
)  # fmt: skip


def kv_state(req: RequestState | None) -> tuple | None:
    """A request's ``KV_FIELDS``; None for a request no longer live. Pure."""
    return None if req is None else tuple(getattr(req, name) for name in KV_FIELDS)


def differing_requests(
    fork: ForkTarget, target: KvTarget, written: Iterable[str], dropped: Set[str]
) -> list[str]:
    """The requests whose canonical entries may differ between two post-states of one op:
    ``fork`` (its writes in ``fork.state.written`` and ``fork.dropped``, detached:
    :func:`detach_fork`) and ``target``, which wrote ``written`` and dropped the pending appends
    ``dropped``. A request neither side wrote is the same object on both, so only the written
    ones are checked, those whose pending append one side dropped, and outputs of released ones.
    One named may still turn out equal. Pure."""
    candidates = list(dict.fromkeys([*written, *fork.state.written]))
    mine, theirs = fork.state.requests, target.state.requests
    differing = [u for u in candidates if kv_state(mine.get(u)) != kv_state(theirs.get(u))]
    differing += sorted(fork.dropped ^ dropped)
    gone = [u for u in candidates if u not in mine and u not in theirs]
    differing += [u for u in gone if _output_key(fork, u) != _output_key(target, u)]
    return list(dict.fromkeys(differing))


def _output_key(target: KvTarget, uuid: str) -> tuple | None:
    out = target.state.outputs.get(uuid)
    return None if out is None else (out.phase, out.finish_reason, len(out.output_ids))


# ---- the pre-state of a logged op ----------------------------------------------------------
_SCOPE_PHASES = {
    "evict": (Phase.RUNNING,),
    "migrate": (Phase.RUNNING, Phase.SWAPPED, Phase.LOADING),
}


def view_of(req: RequestState) -> RequestKvView:
    """One request as a KV op may see it, in full. Pure."""
    return RequestKvView(
        req.uuid, req.phase.value, req.arrival_index, req.num_tokens, req.num_cached_tokens,
        req.gpu_page_ids, req.host_page_ids, req.num_load_retries, req.swapped_step,
        len(req.request.prompt_ids), req.prompt_digests, req.num_cached_prompt_tokens,
    )  # fmt: skip


def op_scope(op: str, request, requests: Mapping[str, RequestState]) -> list[str]:
    """The requests ``op`` may read or write, given its op ``request``: those its input names
    (poll: the loads observed, release: the done requests, alloc: the batch), or for evict and
    migrate every request of ``requests`` in the phases they act on. Pure."""
    phases = _SCOPE_PHASES.get(op)
    if phases is not None:
        return [u for u, r in requests.items() if r.phase in phases]
    return list(request.uuids if op in ("poll", "release") else request.batch)


def pre_state(op: str, request, target: KvTarget) -> KvPreState:
    """The op's scope as it was before the op ran on ``target``, which recorded the requests it
    wrote as they were before (``target.state.written``), with ``request``'s snapshot. Pure;
    O(live requests), so built only to log a divergence."""
    written = target.state.written or {}
    prior = {u: written.get(u, r) for u, r in target.state.requests.items()}
    prior.update((u, r) for u, r in written.items() if u not in prior)  # taken out by the op
    scope = sorted((prior[u] for u in op_scope(op, request, prior)), key=lambda r: r.arrival_index)
    return KvPreState(request.snapshot, tuple(view_of(r) for r in scope))
