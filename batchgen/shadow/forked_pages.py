"""Compare mode's fork of a page pool: a bookkeeping-only overlay.

It reads the base lazily, keeps its own changes, and never touches the base; it hands out the
same ids the base would (the base's FIFO free queue, ``batchgen.kv.page_pool``), shares and frees
pages as the base does (holder counts, cache entries keeping their digests). A fork is valid only
while its base is unchanged (checked on every access).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

from batchgen.kv.page_grants import (
    Grants,
    SharedGrants,
    check_can_allocate,
    check_grants,
    check_shared_grants,
)
from batchgen.kv.page_pool import PagePool


class ForkedPagePool:
    """Overlay of a :class:`PagePool` for the shadow path.

    Reads the base's free queue, tables, holders and digests lazily; writes go to the overlay, so
    a fork costs what it touches, not the pool size. Mutating methods mutate the overlay only.
    """

    def __init__(self, base: PagePool):
        self._base = base
        self._base_version = base.version
        self._num_free = base.num_free
        self.name = base.name
        self.num_pages = base.num_pages
        self._base_free = base.free_page_ids()  # read on demand into _seen
        self._seen: list[int] = []  # the base's free queue, as far as it was read
        self._cursor = 0  # the first index of _seen the fork may not have taken
        self._taken: set[int] = set()  # base-free pages the fork took (new or shared)
        self._tail: dict[int, None] = {}  # pages freed in the fork, FIFO
        self._tables: dict[str, list[int]] = {}  # page tables the fork wrote
        self._holders: dict[int, int] = {}  # holder counts the fork changed
        self._undigested: set[int] = set()  # cache entries the fork took as new pages

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        # _check_base, inlined: legacy alloc asks per request
        if self._base.version != self._base_version:
            self._check_base()
        return self._num_free

    def free_page_ids(self) -> Iterator[int]:
        """The fork's free pages in queue order: the base's it has not taken, then its own."""
        self._check_base()
        return itertools.chain(self._base_free_ids(), list(self._tail))

    def peek_free_pages(self, n: int) -> list[int]:
        check_can_allocate(self, n)
        return list(itertools.islice(self.free_page_ids(), n))

    def pages_of(self, uuid: str) -> tuple[int, ...]:
        self._check_base()
        table = self._tables.get(uuid)
        return self._base.pages_of(uuid) if table is None else tuple(table)

    def is_free(self, page_id: int) -> bool:
        self._check_base()
        return 0 <= page_id < self.num_pages and not self.holders(page_id)

    def holders(self, page_id: int) -> int:
        held = self._holders.get(page_id)
        return self._base.holders(page_id) if held is None else held

    def digest_of(self, page_id: int) -> str | None:
        return None if page_id in self._undigested else self._base.digest_of(page_id)

    def cached_prefix(self, digests: Iterable[str]) -> list[int]:
        self._check_base()
        pages = self._base.cached_prefix(digests)
        cut = next((i for i, p in enumerate(pages) if p in self._undigested), len(pages))
        return pages[:cut]

    def shared_pages(self) -> dict[int, int]:
        self._check_base()
        candidates = set(self._base.shared_pages()) | set(self._holders)
        return {p: self.holders(p) for p in candidates if self.holders(p) > 1}

    # ---- mutations (of the overlay) ---------------------------------------------------------
    def allocate_pages(self, uuid: str, n: int) -> list[int]:
        page_ids = self.peek_free_pages(n)
        self._take(page_ids)
        self._add(uuid, page_ids)
        return page_ids

    def take_pages(self, uuid: str, page_ids: Sequence[int]) -> None:
        self.take_pages_for(((uuid, page_ids),))

    def take_pages_for(self, grants: Grants) -> None:
        """See :meth:`PagePool.take_pages_for`. Mutates the fork only."""
        self._check_base()
        check_grants(self, grants)
        for uuid, page_ids in grants:
            self._take(page_ids)
            self._add(uuid, page_ids)

    def grant_pages_for(self, grants: SharedGrants) -> None:
        """See :meth:`PagePool.grant_pages_for`. Mutates the fork only."""
        self._check_base()
        check_shared_grants(self, grants)
        for uuid, shared, new in grants:
            for page_id in shared:
                if not self.holders(page_id):
                    self._unfree(page_id)
            self._add(uuid, shared)
            self._take(new)
            self._add(uuid, new)

    def release_pages(self, uuid: str) -> list[int]:
        page_ids = list(self.pages_of(uuid))  # refuses a stale fork
        self._tables[uuid] = []
        return self._drop(page_ids)

    def release_first_pages(self, uuid: str, n: int) -> list[int]:
        page_ids = list(self.pages_of(uuid))
        if not 0 <= n <= len(page_ids):
            raise ValueError(f"{self.name}: {uuid} holds {len(page_ids)} pages, not {n}")
        self._tables[uuid] = page_ids[n:]
        return self._drop(page_ids[:n])

    # ---- internals -------------------------------------------------------------------------
    def _base_free_ids(self) -> Iterator[int]:
        """The base's free pages the fork has not taken, from the first it may not have taken."""
        seen, i = self._seen, self._cursor
        while True:
            if i == len(seen):
                page_id = next(self._base_free, None)
                if page_id is None:
                    return
                seen.append(page_id)
            if seen[i] not in self._taken:
                yield seen[i]
            i += 1

    def _unfree(self, page_id: int) -> None:
        """Take free ``page_id`` off the fork's free view. Mutates the overlay."""
        self._num_free -= 1
        if page_id in self._tail:
            del self._tail[page_id]
            return
        self._taken.add(page_id)
        seen = self._seen
        while self._cursor < len(seen) and seen[self._cursor] in self._taken:
            self._cursor += 1

    def _take(self, page_ids: Sequence[int]) -> None:
        """Take free ``page_ids`` as new pages (a cache entry's digest is dropped)."""
        self._check_base()
        for page_id in page_ids:
            self._unfree(page_id)
            if self._base.digest_of(page_id) is not None:
                self._undigested.add(page_id)

    def _add(self, uuid: str, page_ids: Sequence[int]) -> None:
        """Add ``uuid`` as a holder of ``page_ids``, at the end of its table."""
        if not page_ids:
            return
        for page_id in page_ids:
            self._holders[page_id] = self.holders(page_id) + 1
        self._tables[uuid] = [*self.pages_of(uuid), *page_ids]

    def _drop(self, page_ids: Sequence[int]) -> list[int]:
        freed = []
        for page_id in page_ids:
            self._holders[page_id] = self.holders(page_id) - 1
            if not self._holders[page_id]:
                self._tail[page_id] = None
                self._num_free += 1
                freed.append(page_id)
        return freed

    def _check_base(self) -> None:
        if self._base.version != self._base_version:
            raise RuntimeError(f"{self.name}: fork used after its base pool changed")
