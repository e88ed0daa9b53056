"""The one dump of KV state the tests compare: two paths' states after the same ops must be equal,
and a refused op must leave a state equal to its dump before.

A dump holds what a KV op can change and a path can be seen by: the requests (every field; a load
handle by identity), the outputs, the counters, each pool's free queue in order, page tables,
holder counts and digests, the copies issued and the pending appends. Pool internals that only
count changes (``version``) are left out: two pools in the same state may have reached it by
different numbers of calls.
"""

from __future__ import annotations

import copy
import dataclasses

from batchgen.kv.target import KvTarget
from batchgen.state import RequestState


def pool_dump(pages) -> dict:
    """A page pool's (or its fork's) state: free queue, tables, holders, digests. Pure."""
    held = {p for uuid in pages.owner_ids() for p in pages.pages_of(uuid)}
    return {
        "free_queue": list(pages.free_page_ids()),
        "tables": {uuid: pages.pages_of(uuid) for uuid in pages.owner_ids()},
        "holders": {p: pages.holders(p) for p in sorted(held)},
        "digests": {p: pages.digest_of(p) for p in range(pages.num_pages) if pages.digest_of(p)},
    }


def request_dump(req: RequestState, handles: bool) -> dict:
    """Every field of a request; its load handle by identity (``handles``), else whether it has
    one (two workers' handles are different objects). Pure."""
    fields = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}
    handle = req.load_handle
    fields["load_handle"] = (id(handle) if handles else True) if handle is not None else None
    return copy.deepcopy(fields)


def kv_dump(target: KvTarget, copies=(), *, handles: bool = True) -> dict:
    """Everything a KV op on ``target`` could change, and ``copies`` (the copies it issued); load
    handles as ``request_dump`` takes them. Pure."""
    state = target.state
    return {
        "step": state.step,
        "num_submitted": state.num_submitted,
        "requests": [(uuid, request_dump(req, handles)) for uuid, req in state.requests.items()],
        "outputs": list(state.outputs.items()),
        "stats": dataclasses.asdict(state.stats),
        "gpu": pool_dump(target.gpu_kv.pages),
        "host": pool_dump(target.host_kv.pages),
        "copies": list(copies),
        "pending": [
            (uuid, p.start_pos, None if p.kv is None else tuple(p.kv.shape))
            for uuid, p in target.pending_appends.items()
        ],
    }
