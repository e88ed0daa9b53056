"""Page allocator bookkeeping: a FIFO free queue and page ownership.

Allocation order is deterministic: pages leave from the head of the free queue
and released pages join its tail, so two pools in the same state hand out the
same ids (compare mode's forks, ``batchgen.shadow.forked_pages``, rely on it).
Every mutation bumps ``version``, so that a fork can tell its base changed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from batchgen.kv.page_grants import Grants, check_can_allocate, check_grants


class PagePool:
    """FIFO page allocator for one tier. Mutating methods say so."""

    def __init__(self, name: str, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"{name}: num_pages must be >= 0, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        self._queue: list[int] = list(range(num_pages))
        self._head = 0
        self._free_flags = bytearray(b"\x01") * num_pages
        self._owned: dict[str, list[int]] = {}
        self.version = 0  # bumped by every change: a fork checks its base by it (read only)

    # ---- queries (no mutation) -------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._queue) - self._head

    def peek_free_pages(self, n: int) -> list[int]:
        """The ids ``allocate_pages(_, n)`` would return now."""
        check_can_allocate(self, n)
        return self._queue[self._head : self._head + n]

    def pages_of(self, uuid: str) -> tuple[int, ...]:
        return tuple(self._owned.get(uuid, ()))

    def is_free(self, page_id: int) -> bool:
        return 0 <= page_id < self.num_pages and bool(self._free_flags[page_id])

    def owner_ids(self) -> list[str]:
        return [uuid for uuid, pages in self._owned.items() if pages]

    @property
    def free_queue(self) -> tuple[list[int], int]:
        """The free queue's list and its head's index (the free ids are ``list[head:]``), for a
        fork to read, never to change."""
        return self._queue, self._head

    # ---- mutations ---------------------------------------------------------------
    def allocate_pages(self, uuid: str, n: int) -> list[int]:
        """Take ``n`` pages from the queue head for ``uuid``. Mutates the pool."""
        page_ids = self.peek_free_pages(n)
        self._head += n
        self._compact()
        self._assign(uuid, page_ids)
        return page_ids

    def take_pages(self, uuid: str, page_ids: Sequence[int]) -> None:
        """Give ``uuid`` exactly ``page_ids``; see :meth:`take_pages_for`. Mutates the pool."""
        self.take_pages_for(((uuid, page_ids),))

    def take_pages_for(self, grants: Grants) -> None:
        """Give each owner exactly its page ids (a plan's choice), in order. Mutates the pool.

        Validates every grant first: each id in range, free, and named once across all of
        them; on a bad one it raises :class:`PageOwnershipError` and nothing changes. An
        owner given no ids is left as it is; when no owner is given any, nothing changes
        and forks stay valid. Marks the ids owned in one pass (a plan's grants come in bulk).
        """
        all_ids = [page_id for _, page_ids in grants for page_id in page_ids]
        if not all_ids:
            return
        queue_head = self._queue[self._head : self._head + len(all_ids)]
        if queue_head == all_ids and all(type(page_id) is int for page_id in all_ids):
            # the queue head (what a plan peeked): in range, free and distinct already
            self._head += len(all_ids)
        else:
            check_grants(self, grants)
            taken = set(all_ids)
            self._queue = [p for p in self._queue[self._head :] if p not in taken]
            self._head = 0
        self._compact()
        self.version += 1
        flags = self._free_flags
        for page_id in all_ids:
            flags[page_id] = 0
        owned = self._owned
        for uuid, page_ids in grants:
            if page_ids:
                owned.setdefault(uuid, []).extend(page_ids)

    def release_pages(self, uuid: str) -> list[int]:
        """Return every page of ``uuid`` to the queue tail, in page-table order.

        Mutates the pool. Releasing an owner with no pages is a no-op.
        """
        page_ids = self._owned.pop(uuid, [])
        if not page_ids:
            return []
        self.version += 1
        self._queue.extend(page_ids)
        for page_id in page_ids:
            self._free_flags[page_id] = 1
        return page_ids

    # ---- integrity ---------------------------------------------------------------
    def check_integrity(self, live_uuids: Collection[str] | None = None) -> None:
        """Raise AssertionError unless free + owned == total, no page is owned
        twice or both free and owned, and (when given) every owner is live."""
        free = self._queue[self._head :]
        owned = [p for pages in self._owned.values() for p in pages]
        seen = free + owned
        assert len(seen) == self.num_pages, (
            f"{self.name}: free {len(free)} + owned {len(owned)} != total {self.num_pages}"
        )
        assert len(set(seen)) == self.num_pages, (
            f"{self.name}: a page is free and owned, or owned twice"
        )
        assert all(self._free_flags[p] for p in free), (
            f"{self.name}: free-queue page not marked free"
        )
        assert not any(self._free_flags[p] for p in owned), f"{self.name}: owned page marked free"
        if live_uuids is not None:
            dead = sorted(set(self.owner_ids()) - set(live_uuids))
            assert not dead, f"{self.name}: pages owned by requests no longer live: {dead}"

    # ---- internals ---------------------------------------------------------------
    def _assign(self, uuid: str, page_ids: Sequence[int]) -> None:
        """Mark ``page_ids`` (already off the free queue) owned by ``uuid``; :meth:`take_pages_for`
        does the same for all its grants in one pass. Mutates the pool."""
        if not page_ids:  # nothing changes: forks stay valid, no empty owner entry
            return
        self.version += 1
        for page_id in page_ids:
            self._free_flags[page_id] = 0
        self._owned.setdefault(uuid, []).extend(page_ids)

    def _compact(self) -> None:
        if self._head > 4096 and self._head * 2 > len(self._queue):
            del self._queue[: self._head]
            self._head = 0
