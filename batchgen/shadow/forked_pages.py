"""Compare mode's fork of a page pool: a bookkeeping-only overlay.

It reads the base lazily, keeps its own changes, and never touches the base; it hands out the
same ids the base would (the base's FIFO free queue, ``batchgen.kv.page_pool``). A fork is valid
only while its base is unchanged (checked on every access).
"""

from __future__ import annotations

from collections.abc import Sequence

from batchgen.kv.page_grants import Grants, check_can_allocate, check_grants
from batchgen.kv.page_pool import PagePool


class ForkedPagePool:
    """Overlay of a :class:`PagePool` for the shadow path.

    Reads the base's free queue and owners lazily; writes go to the overlay, so
    a fork costs what it touches, not the pool size. Mutating methods mutate the
    overlay only.
    """

    def __init__(self, base: PagePool):
        self._base = base
        self._base_version = base.version
        self._num_free = base.num_free
        self.name = base.name
        self.num_pages = base.num_pages
        # the base's free queue (the same list while the base is unchanged), and its first index
        # the fork has not consumed yet
        self._queue, self._cursor = base.free_queue
        self._taken: set[int] = set()  # base-free pages the fork handed out
        self._tail: list[int] = []  # pages released in the fork, FIFO
        self._released: set[str] = set()  # owners whose base pages the fork released
        # pages the fork gave each owner (after its release, if any)
        self._added: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        # _check_base, inlined: legacy alloc asks per request
        if self._base.version != self._base_version:
            self._check_base()
        return self._num_free

    def peek_free_pages(self, n: int) -> list[int]:
        check_can_allocate(self, n)
        out: list[int] = []
        queue, i = self._queue, self._cursor
        while len(out) < n and i < len(queue):
            if queue[i] not in self._taken:
                out.append(queue[i])
            i += 1
        out.extend(self._tail[: n - len(out)])
        return out

    def pages_of(self, uuid: str) -> tuple[int, ...]:
        self._check_base()
        base = () if uuid in self._released else self._base.pages_of(uuid)
        added = self._added.get(uuid)
        return base + tuple(added) if added else base

    def allocate_pages(self, uuid: str, n: int) -> list[int]:
        page_ids = self.peek_free_pages(n)
        self._assign(uuid, page_ids)
        return page_ids

    def take_pages(self, uuid: str, page_ids: Sequence[int]) -> None:
        self.take_pages_for(((uuid, page_ids),))

    def take_pages_for(self, grants: Grants) -> None:
        """See :meth:`PagePool.take_pages_for`. Mutates the fork only."""
        self._check_base()
        check_grants(self, grants)
        for uuid, page_ids in grants:
            self._assign(uuid, page_ids)

    def release_pages(self, uuid: str) -> list[int]:
        page_ids = list(self.pages_of(uuid))  # refuses a stale fork
        self._released.add(uuid)
        self._added.pop(uuid, None)
        if page_ids:
            self._num_free += len(page_ids)
            self._tail.extend(page_ids)
        return page_ids

    def is_free(self, page_id: int) -> bool:
        self._check_base()
        return self._is_free(page_id)

    def _is_free(self, page_id: int) -> bool:
        return (self._base.is_free(page_id) and page_id not in self._taken) or page_id in self._tail

    def _assign(self, uuid: str, page_ids: Sequence[int]) -> None:
        self._check_base()
        if not page_ids:
            return
        self._num_free -= len(page_ids)
        for page_id in page_ids:
            if page_id in self._tail:
                self._tail.remove(page_id)
            else:
                self._taken.add(page_id)
        queue = self._queue
        while self._cursor < len(queue) and queue[self._cursor] in self._taken:
            self._cursor += 1
        # what it touches: not the owner's whole page list
        self._added.setdefault(uuid, []).extend(page_ids)

    def _check_base(self) -> None:
        if self._base.version != self._base_version:
            raise RuntimeError(f"{self.name}: fork used after its base pool changed")
