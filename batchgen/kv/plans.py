"""The plan layer's boundary: frozen snapshots and op requests in, frozen plans out.

An op request is what one KV op may read: a :class:`KvSnapshot` (step, geometry, free page
counts) and the columns of the requests in its scope (entry i of each column is request
``uuids[i]``), built per op, only for that scope. A plan carries decisions and diffs (page ids
granted, victims and where they go, loads to start), never the manager's internals. Everything
round-trips through JSON exactly (:func:`to_json` / :func:`from_json`), which the divergence log
and ``replay`` rely on.

Page arithmetic, shared by every side (``pages_needed`` is written once, in ``batchgen.config``,
where the model, engine and KV layers all read it)::

    pages_needed(n, page_size) = ceil(n / page_size)      pages that hold n tokens
    decode demand               = sum over RUNNING requests of
                                  pages_needed(num_tokens) - len(gpu_page_ids)
"""

from __future__ import annotations

import enum
import functools
import itertools
import json
from dataclasses import dataclass
from typing import NamedTuple

from pydantic import TypeAdapter

from batchgen.config import pages_needed

frozen = dataclass(frozen=True, slots=True)


class Destination(str, enum.Enum):
    HOST = "host"  # KV stored to host pages; request SWAPPED
    RECOMPUTE = "recompute"  # KV dropped; request WAITING, recomputed later


class PollAction(str, enum.Enum):
    COMPLETE = "complete"  # load landed: RUNNING, host pages freed
    RETRY = "retry"  # load failed: start it again into the same pages
    RECOMPUTE = "recompute"  # load failed too often: drop KV, WAITING
    FAIL = "fail"  # load failed too often: drop KV, FAILED with the load error


# ---- snapshot ------------------------------------------------------------------------------
@frozen
class KvGeometry:
    """Model and cache geometry, and the limits decisions depend on."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype_size: int
    num_gpu_pages: int
    num_host_pages: int
    watermark: float  # fraction of GPU pages kept free
    max_num_seqs: int
    max_load_retries: int
    load_failure: str = "recompute"  # after the last retry: "recompute" or "fail"
    prefix_caching: bool = False  # full prompt pages reused across requests


@frozen
class KvSnapshot:
    """What every KV op reads: the step, the geometry, the free page counts."""

    step: int
    geometry: KvGeometry
    num_free_gpu_pages: int
    num_free_host_pages: int


@frozen
class PageColumns:
    """Requests with their GPU page tables, as columns of equal length."""

    uuids: tuple[str, ...]
    num_tokens: tuple[int, ...]
    gpu_page_ids: tuple[tuple[int, ...], ...]


@frozen
class SwappedColumns:
    """SWAPPED requests with their host page tables, as columns, in arrival order."""

    uuids: tuple[str, ...]
    host_page_ids: tuple[tuple[int, ...], ...]
    swapped_steps: tuple[int, ...]  # the step each went to host
    # with prefix caching: the GPU pages holding each one's longest cached prompt prefix (read
    # from the pool's index as the request is built), which a load re-links
    cached_pages: tuple[tuple[int, ...], ...] = ()


def decode_demand(running: PageColumns, page_size: int) -> int:
    """GPU pages the ``running`` requests lack, together, for every token to have a slot: the
    pages their tokens need less the pages they hold. Pure."""
    needed = sum(map(pages_needed, running.num_tokens, itertools.repeat(page_size)))
    return needed - sum(map(len, running.gpu_page_ids))


class RequestKvView(NamedTuple):
    """One request as a KV op may see it, in full: the pre-state a logged divergence carries."""

    uuid: str
    phase: str  # Phase value
    arrival_index: int
    num_tokens: int
    num_cached_tokens: int
    gpu_page_ids: tuple[int, ...]
    host_page_ids: tuple[int, ...]
    num_load_retries: int
    swapped_step: int | None
    num_prompt_tokens: int
    # prefix caching (defaults: a log written before it, or with it off): the digest of each full
    # prompt page, and the prompt tokens its first admission took from the cache
    prompt_digests: tuple[str, ...] = ()
    num_cached_prompt_tokens: int = 0


@frozen
class KvPreState:
    """The requests one op could read, in full, before it ran (built only to log a divergence)."""

    snapshot: KvSnapshot
    requests: tuple[RequestKvView, ...]  # the op's scope, in arrival order


# ---- op requests ---------------------------------------------------------------------------
@frozen
class PollRequest:
    snapshot: KvSnapshot
    uuids: tuple[str, ...]  # the requests whose loads were observed this step
    errors: tuple[str | None, ...]  # of each load: None if it completed, else the error
    num_load_retries: tuple[int, ...]  # of each request


@frozen
class ReleaseRequest:
    snapshot: KvSnapshot
    uuids: tuple[str, ...]  # the done requests


@frozen
class EvictionRequest:
    snapshot: KvSnapshot
    running: PageColumns  # every RUNNING request, in arrival order
    decode_demand: int  # of ``running`` (:func:`decode_demand`), summed where the request is built
    # (page, holders) of each GPU page more than one request holds (prefix caching)
    shared_page_holders: tuple[tuple[int, int], ...] = ()


@frozen
class MigrationRequest:
    snapshot: KvSnapshot
    swapped: SwappedColumns  # every SWAPPED request, in arrival order
    running: PageColumns  # every RUNNING request; empty when nothing is SWAPPED
    decode_demand: int  # of ``running`` (:func:`decode_demand`)
    num_loading: int  # LOADING requests; 0 when nothing is SWAPPED
    cache_entries: tuple[int, ...] = ()  # the free ones (cache entries) of swapped.cached_pages


@frozen
class AllocRequest:
    snapshot: KvSnapshot
    # the scheduled requests to act on, in batch order: tokens past their last page, or not
    # RUNNING yet (each is granted its pages, maybe none, or left out)
    needing: PageColumns
    batch: tuple[str, ...]  # all scheduled uuids, in batch order
    # with prefix caching, for each of ``needing`` being admitted: the GPU pages holding the
    # longest cached prefix of the prompt pages it may reuse (``prefix_digests.reusable_pages``),
    # read from the pool's index as the request is built; else ()
    cached_pages: tuple[tuple[int, ...], ...] = ()
    cache_entries: tuple[int, ...] = ()  # the free ones (cache entries) of cached_pages


OP_REQUEST_TYPES = {
    "poll": PollRequest,
    "release": ReleaseRequest,
    "evict": EvictionRequest,
    "migrate": MigrationRequest,
    "alloc": AllocRequest,
}


# ---- plans ---------------------------------------------------------------------------------
@frozen
class PollPlan:
    """What to do with each observed load, as columns, applied in order (order fixes free-queue
    order)."""

    uuids: tuple[str, ...]
    actions: tuple[PollAction, ...]
    reasons: tuple[str | None, ...]  # FAIL: the request's failure reason; else None


@frozen
class ReleasePlan:
    released: tuple[str, ...]  # pages on both tiers freed, loads drained, outputs kept
    drop_pending_append_ids: tuple[str, ...]  # pending K/V the worker must discard


@frozen
class Victim:
    uuid: str
    destination: Destination
    gpu_page_ids: tuple[int, ...]  # freed; copied to host first when destination is HOST
    host_page_ids: tuple[int, ...]  # granted host pages (empty for RECOMPUTE)


@frozen
class EvictionPlan:
    victims: tuple[Victim, ...]  # applied in order


@frozen
class LoadStart:
    uuid: str
    gpu_page_ids: tuple[int, ...]  # granted; the load copies the host pages past the re-linked
    host_page_ids: tuple[int, ...]  # source pages, freed when the load completes (re-linked: now)
    # cached GPU pages re-linked instead of loaded: the first of the page table, one for each of
    # the first host pages
    shared_page_ids: tuple[int, ...] = ()


@frozen
class MigrationPlan:
    loads: tuple[LoadStart, ...]


@frozen
class PageGrant:
    uuid: str
    new_page_ids: tuple[int, ...]  # appended to the request's GPU page table (may be empty)
    # cached prompt pages it shares (prefix hits), before the new ones in its table
    shared_page_ids: tuple[int, ...] = ()


@frozen
class DoesNotFit:
    uuid: str
    num_pages_needed: int
    num_pages_free: int


@frozen
class AllocPlan:
    grants: tuple[PageGrant, ...]  # requests granted pages, in batch order
    not_fitting: tuple[DoesNotFit, ...]  # left out of this step; the rest of the batch is served


# ---- JSON ----------------------------------------------------------------------------------
@functools.cache
def _adapter(cls) -> TypeAdapter:
    return TypeAdapter(cls)


def to_json(obj) -> str:
    """Serialise a snapshot, op request or plan (edge use: logs, replay). Pure."""
    return _adapter(type(obj)).dump_json(obj).decode()


def from_json(cls, text: str):
    """Inverse of :func:`to_json` for the given class. Pure."""
    return _adapter(cls).validate_json(text)


def to_jsonable(obj) -> dict:
    return json.loads(to_json(obj))
