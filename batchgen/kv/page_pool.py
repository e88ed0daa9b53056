"""Page allocator bookkeeping: a FIFO free queue, page holders, and the prefix cache's index.

Allocation order is deterministic: pages leave from the head of the free queue and freed pages
join its tail, so two pools in the same state hand out the same ids (compare mode's forks,
``batchgen.shadow.forked_pages``, rely on it). Every mutation bumps ``version``, so that a fork
can tell its base changed.

Prefix caching (the policy is ``batchgen.kv.manager``'s docstring) lives here as bookkeeping:

    holders   a page is held by every owner whose page table names it (``grant_pages_for`` adds
              one); it is free when no owner holds it, and joins the free-queue tail then
    digests   ``register`` gives a held page its prompt digest; the index maps each digest to
              the one page holding it. A freed page keeps its digest: it is a cache entry, free
              (counted in ``num_free``) and reusable (``grant_pages_for`` takes it off the queue)
              until an allocation takes it from the head, which drops its digest
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Sequence

from batchgen.kv.page_grants import (
    Grants,
    SharedGrants,
    check_can_allocate,
    check_grants,
    check_shared_grants,
)


class PagePool:
    """FIFO page allocator for one tier. Mutating methods say so."""

    def __init__(self, name: str, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"{name}: num_pages must be >= 0, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._holders = [0] * num_pages  # page -> how many page tables name it
        self._owned: dict[str, list[int]] = {}
        self._digest_of: dict[int, str] = {}  # page -> its prompt digest (held or cache entry)
        self._page_of: dict[str, int] = {}  # digest -> the page holding it
        self._shared: set[int] = set()  # pages more than one table names
        self.version = 0  # bumped by every change: a fork checks its base by it (read only)

    # ---- queries (no mutation) -------------------------------------------------
    @property
    def num_free(self) -> int:
        """Free pages, cache entries included (they are reclaimable)."""
        return len(self._free)

    def free_page_ids(self) -> Iterator[int]:
        """The free pages in queue order, head first (valid while the pool is unchanged)."""
        return iter(self._free)

    def peek_free_pages(self, n: int) -> list[int]:
        """The ids ``allocate_pages(_, n)`` would return now."""
        check_can_allocate(self, n)
        return list(itertools.islice(self._free, n))

    def pages_of(self, uuid: str) -> tuple[int, ...]:
        return tuple(self._owned.get(uuid, ()))

    def is_free(self, page_id: int) -> bool:
        return 0 <= page_id < self.num_pages and not self._holders[page_id]

    def holders(self, page_id: int) -> int:
        return self._holders[page_id]

    def owner_ids(self) -> list[str]:
        return [uuid for uuid, pages in self._owned.items() if pages]

    def digest_of(self, page_id: int) -> str | None:
        return self._digest_of.get(page_id)

    def cached_prefix(self, digests: Iterable[str]) -> list[int]:
        """The pages holding the longest prefix of ``digests`` the index has, in order."""
        page_of = self._page_of
        pages = []
        for digest in digests:
            page_id = page_of.get(digest)
            if page_id is None:
                break
            pages.append(page_id)
        return pages

    def shared_pages(self) -> dict[int, int]:
        """Each page more than one page table names, with its holder count."""
        return {page_id: self._holders[page_id] for page_id in self._shared}

    # ---- mutations ---------------------------------------------------------------
    def allocate_pages(self, uuid: str, n: int) -> list[int]:
        """Take ``n`` pages from the queue head for ``uuid`` (dropping the digests of cache
        entries among them). Mutates the pool."""
        page_ids = self.peek_free_pages(n)
        self._take(page_ids)
        self._assign(uuid, page_ids)
        return page_ids

    def take_pages(self, uuid: str, page_ids: Sequence[int]) -> None:
        """Give ``uuid`` exactly ``page_ids``; see :meth:`take_pages_for`. Mutates the pool."""
        self.take_pages_for(((uuid, page_ids),))

    def take_pages_for(self, grants: Grants) -> None:
        """Give each owner exactly its page ids (a plan's choice), in order, as new pages: a cache
        entry among them loses its digest. Mutates the pool.

        Validates every grant first: each id in range, free, and named once across all of them;
        on a bad one it raises :class:`PageOwnershipError` and nothing changes. An owner given no
        ids is left as it is; when no owner is given any, nothing changes and forks stay valid.
        """
        all_ids = [page_id for _, page_ids in grants for page_id in page_ids]
        if not all_ids:
            return
        head = list(itertools.islice(self._free, len(all_ids)))
        if head != all_ids or not all(type(page_id) is int for page_id in all_ids):
            check_grants(self, grants)  # the queue head (what a plan peeked) needs no check
        self._take(all_ids)
        for uuid, page_ids in grants:
            self._assign(uuid, page_ids)

    def grant_pages_for(self, grants: SharedGrants) -> None:
        """Give each owner, in order, its cached pages shared (one more holder each; a free cache
        entry leaves the free queue, keeping its digest), then its new pages (as
        :meth:`take_pages_for` takes them), appended to its page table in that order. Validates
        every grant first (:func:`check_shared_grants`); on a bad one nothing changes. Mutates
        the pool."""
        if not any(shared for _, shared, _ in grants):
            self.take_pages_for([(uuid, new) for uuid, _, new in grants])
            return
        check_shared_grants(self, grants)
        for uuid, shared, new in grants:
            for page_id in shared:
                if not self._holders[page_id]:
                    del self._free[page_id]
            self._assign(uuid, shared)
            self._take(new)
            self._assign(uuid, new)

    def register(self, page_id: int, digest: str) -> bool:
        """Index held page ``page_id`` under ``digest``, unless the page has a digest already or
        another page holds this one (then nothing changes). Returns whether it was indexed.
        Mutates the pool."""
        if page_id in self._digest_of or digest in self._page_of:
            return False
        if not self._holders[page_id]:
            raise ValueError(f"{self.name}: page {page_id} is free; only a held page is indexed")
        self.version += 1
        self._digest_of[page_id] = digest
        self._page_of[digest] = page_id
        return True

    def release_pages(self, uuid: str) -> list[int]:
        """Drop ``uuid``'s hold on each of its pages; a page no one holds any more joins the queue
        tail, in page-table order, keeping its digest. Returns the pages freed.

        Mutates the pool. Releasing an owner with no pages is a no-op.
        """
        page_ids = self._owned.pop(uuid, [])
        return self._drop(page_ids) if page_ids else []

    def release_first_pages(self, uuid: str, n: int) -> list[int]:
        """Drop ``uuid``'s hold on the first ``n`` pages of its table (see
        :meth:`release_pages`). Mutates the pool."""
        page_ids = self._owned.get(uuid, [])
        if not 0 <= n <= len(page_ids):
            raise ValueError(f"{self.name}: {uuid} holds {len(page_ids)} pages, not {n}")
        dropped, self._owned[uuid] = page_ids[:n], page_ids[n:]
        if not self._owned[uuid]:
            del self._owned[uuid]
        return self._drop(dropped) if dropped else []

    # ---- integrity ---------------------------------------------------------------
    def check_integrity(self, live_uuids: Collection[str] | None = None) -> None:
        """Raise AssertionError unless every page is free or held, a page's holder count is the
        number of page tables naming it, no table names a page twice, the digest index is
        one-to-one, and (when given) every owner is live."""
        counts = [0] * self.num_pages
        for uuid, pages in self._owned.items():
            assert len(set(pages)) == len(pages), f"{self.name}: {uuid} names a page twice"
            for page_id in pages:
                counts[page_id] += 1
        assert counts == self._holders, f"{self.name}: a page's holder count is not its tables'"
        assert self._shared == {p for p, n in enumerate(counts) if n > 1}, (
            f"{self.name}: the shared set is not the pages held twice"
        )
        free = [p for p in range(self.num_pages) if not counts[p]]
        assert sorted(self._free) == free, f"{self.name}: the free queue is not the unheld pages"
        assert {p: d for d, p in self._page_of.items()} == self._digest_of, (
            f"{self.name}: the digest index is not one-to-one"
        )
        if live_uuids is not None:
            dead = sorted(set(self.owner_ids()) - set(live_uuids))
            assert not dead, f"{self.name}: pages owned by requests no longer live: {dead}"

    # ---- internals ---------------------------------------------------------------
    def _take(self, page_ids: Sequence[int]) -> None:
        """Take free ``page_ids`` off the queue as new pages: a cache entry's digest is dropped.
        Mutates the queue and the index."""
        free, digest_of = self._free, self._digest_of
        for page_id in page_ids:
            del free[page_id]
        if digest_of:
            for page_id in page_ids:
                digest = digest_of.pop(page_id, None)
                if digest is not None:
                    del self._page_of[digest]

    def _assign(self, uuid: str, page_ids: Sequence[int]) -> None:
        """Add ``uuid`` as a holder of ``page_ids`` (already off the free queue, or held), at the
        end of its table. Mutates the pool."""
        if not page_ids:  # nothing changes: forks stay valid, no empty owner entry
            return
        self.version += 1
        holders = self._holders
        for page_id in page_ids:
            holders[page_id] += 1
            if holders[page_id] == 2:
                self._shared.add(page_id)
        self._owned.setdefault(uuid, []).extend(page_ids)

    def _drop(self, page_ids: Sequence[int]) -> list[int]:
        """One hold less on each of ``page_ids``; returns those no one holds now, queued at the
        tail. Mutates the pool."""
        self.version += 1
        holders, freed = self._holders, []
        for page_id in page_ids:
            holders[page_id] -= 1
            if holders[page_id] == 1:
                self._shared.discard(page_id)
            elif not holders[page_id]:
                self._free[page_id] = None
                freed.append(page_id)
        return freed
