"""The page pools of a rebuilt pre-state (``rebuild``'s table says what each comes from): the
scope's page tables, pages shared with prefix caching, the holds of requests outside the scope,
the prefix cache's index, and the free queue in the order the op met it.

Nothing here reads anything but its arguments; every inconsistency is a :class:`ReplayError`.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from batchgen.kv.page_grants import PageOwnershipError
from batchgen.kv.page_pool import PagePool
from batchgen.kv.plans import AllocRequest, EvictionRequest, MigrationRequest, RequestKvView

PLACEHOLDER_OWNER = "<replay:not-in-scope>"  # holds the pages held outside the op's scope
_REORDER_OWNER = "<replay:reorder>"


class ReplayError(ValueError):
    """A record whose op cannot be rebuilt (unknown op, inconsistent pre-state)."""


@dataclass(frozen=True)
class CacheFacts:
    """What an op request says of the GPU pool's prefix cache, beyond the scope's page tables."""

    digests: Mapping[int, str] = field(default_factory=dict)  # page -> digest a lookup found
    cache_entries: frozenset[int] = frozenset()  # free pages with a digest
    outside: Mapping[int, int] = field(default_factory=dict)  # page -> holds outside the scope


def cache_facts(request, views: Sequence[RequestKvView]) -> CacheFacts:
    """The prefix cache as ``request`` (an op request, prefix caching on) read it: alloc and
    migrate, the cached prefixes it looked up (each page under the digest of its request at its
    index), their cache entries, and those held by no request of the scope (held outside, once);
    evict, the holds its ``shared_page_holders`` count beyond the scope's. Pure."""
    held = Counter(page_id for view in views for page_id in view.gpu_page_ids)
    if isinstance(request, EvictionRequest):
        return CacheFacts(outside=_outside_holds(request.shared_page_holders, held))
    if isinstance(request, AllocRequest):
        prefixes = zip(request.needing.uuids, request.cached_pages)
    elif isinstance(request, MigrationRequest):
        prefixes = zip(request.swapped.uuids, request.swapped.cached_pages)
    else:
        return CacheFacts()
    digests = _looked_up(prefixes, {view.uuid: view for view in views})
    entries = frozenset(request.cache_entries)
    unnamed = sorted(entries - digests.keys())
    if unnamed:
        raise ReplayError(f"the op request's cache entries {unnamed} are in no cached prefix")
    outside = {page_id: 1 for page_id in digests if page_id not in entries and not held[page_id]}
    return CacheFacts(digests, entries, outside)


def _outside_holds(shared: Iterable[tuple[int, int]], held: Counter) -> dict[int, int]:
    """Each shared page's holders (``shared``: page, holders) less the scope's (``held``)."""
    outside = {}
    for page_id, num_holders in shared:
        extra = num_holders - held[page_id]
        if extra < 0:
            raise ReplayError(
                f"gpu page {page_id}: {num_holders} holders recorded, but the scope's page tables"
                f" name it {held[page_id]} times"
            )
        if extra:
            outside[page_id] = extra
    return outside


def _looked_up(prefixes, views: Mapping[str, RequestKvView]) -> dict[int, str]:
    """Each page of the cached ``prefixes`` (uuid, pages) under its request's digest there."""
    digests: dict[int, str] = {}
    for uuid, page_ids in prefixes:
        view = views.get(uuid)
        if view is None or len(page_ids) > len(view.prompt_digests):
            known = "no view" if view is None else f"{len(view.prompt_digests)} prompt digests"
            raise ReplayError(
                f"request {uuid}: a cached prefix of {len(page_ids)} pages, but {known}"
            )
        for page_id, digest in zip(page_ids, view.prompt_digests):
            if digests.setdefault(page_id, digest) != digest:
                raise ReplayError(f"gpu page {page_id} is cached under two digests")
    return digests


def gpu_index(views: Sequence[RequestKvView], facts: CacheFacts) -> dict[int, str]:
    """The digest each GPU page is indexed under: the pages the op looked up (``facts``), and each
    page held more than once, under a holder's digest at its index (one held only outside the
    scope: a placeholder digest). Other held pages are not indexed: no op looks them up. Pure."""
    holds = Counter(page_id for view in views for page_id in view.gpu_page_ids)
    in_scope = set(holds)
    holds.update(facts.outside)
    digests = dict(facts.digests)
    for view in views:
        for page_id, digest in zip(view.gpu_page_ids, view.prompt_digests):
            if holds[page_id] > 1:
                digests.setdefault(page_id, digest)
    for page_id, num_holds in holds.items():
        if num_holds > 1 and page_id not in in_scope:
            digests.setdefault(page_id, f"{PLACEHOLDER_OWNER} page {page_id}")
    return digests


def rebuilt_pool(
    name: str,
    num_pages: int,
    owned: Mapping[str, Sequence[int]],
    num_free: int,
    first_free: Sequence[int],
    digests: Mapping[int, str] | None = None,
    facts: CacheFacts | None = None,
) -> PagePool:
    """A pool whose owners hold ``owned`` (in that order; a page held already is shared), whose
    placeholders hold ``facts.outside``, whose ``digests`` are indexed, and whose free queue
    starts with ``first_free``, then the cache entries, then the other unowned pages ascending,
    cut at ``num_free``; the unowned pages past it are held by PLACEHOLDER_OWNER. Pure."""
    digests, facts = digests or {}, facts or CacheFacts()
    pool = PagePool(name, num_pages)
    try:
        for uuid, page_ids in owned.items():
            _hold(pool, uuid, page_ids, digests)
        for k, page_ids in enumerate(_outside_tables(facts.outside)):
            _hold(pool, placeholder(k), page_ids, digests)
    except PageOwnershipError as error:
        raise ReplayError(f"the recorded page tables are inconsistent: {error}") from None
    _queue_free(pool, num_free, first_free, sorted(facts.cache_entries), digests)
    return pool


def placeholder(k: int) -> str:
    """The owner of the (k + 1)-th hold outside the scope on a page: PLACEHOLDER_OWNER first."""
    return PLACEHOLDER_OWNER if k == 0 else f"{PLACEHOLDER_OWNER} #{k + 1}"


def _outside_tables(outside: Mapping[int, int]) -> list[list[int]]:
    """Placeholder k's pages: those held outside the scope more than k times, ascending."""
    num_tables = max(outside.values(), default=0)
    return [sorted(p for p, n in outside.items() if n > k) for k in range(num_tables)]


def _hold(pool: PagePool, uuid: str, page_ids: Sequence[int], digests: Mapping[int, str]) -> None:
    """Give ``uuid`` ``page_ids``, in order: a page held already is shared (it has its digest),
    any other taken and indexed under its digest, if it has one. Mutates ``pool``."""
    keyed = [(not pool.is_free(page_id), page_id) for page_id in page_ids]
    for shared, run in itertools.groupby(keyed, key=lambda item: item[0]):
        ids = [page_id for _, page_id in run]
        pool.grant_pages_for([(uuid, ids, ())] if shared else [(uuid, (), ids)])
        for page_id in () if shared else ids:
            if page_id in digests:
                _register(pool, page_id, digests[page_id])


def _register(pool: PagePool, page_id: int, digest: str) -> None:
    """Index held ``page_id`` under ``digest``. Mutates ``pool``."""
    if not pool.register(page_id, digest):
        raise ReplayError(
            f"{pool.name}: page {page_id} cannot be indexed under digest {digest}: pages"
            f" {pool.cached_prefix([digest])} hold it already"
        )


def _queue_free(
    pool: PagePool,
    num_free: int,
    first_free: Sequence[int],
    cache_entries: Sequence[int],
    digests: Mapping[int, str],
) -> None:
    """Free exactly ``num_free`` of the unowned pages, queued as :func:`rebuilt_pool` says, the
    cache entries under their digests; the rest held by PLACEHOLDER_OWNER. Mutates ``pool``."""
    unowned = [page_id for page_id in range(pool.num_pages) if pool.is_free(page_id)]
    if num_free > len(unowned):
        raise ReplayError(
            f"{pool.name}: {num_free} free pages recorded, but the scope leaves only"
            f" {len(unowned)} unowned"
        )
    held = [page_id for page_id in cache_entries if not pool.is_free(page_id)]
    if held:
        raise ReplayError(f"{pool.name}: cache entries {held} are held by the scope")
    head = [page_id for page_id in first_free if pool.is_free(page_id)]
    free = list(dict.fromkeys([*head, *cache_entries, *unowned]))[:num_free]
    left_out = sorted(set(cache_entries) - set(free))
    if left_out:
        raise ReplayError(f"{pool.name}: {num_free} free pages leave out cache entries {left_out}")
    held_elsewhere = sorted(set(unowned) - set(free))
    if held_elsewhere:
        pool.take_pages(PLACEHOLDER_OWNER, held_elsewhere)
    pool.take_pages(_REORDER_OWNER, free)  # the queue is now empty ...
    for page_id in cache_entries:
        _register(pool, page_id, digests[page_id])
    pool.release_pages(_REORDER_OWNER)  # ... and refills in ``free``'s order, digests kept
