"""Page allocator bookkeeping: a FIFO free queue, page ownership, and forks.

Allocation order is deterministic: pages leave from the head of the free queue
and released pages join its tail, so two pools in the same state hand out the
same ids. A fork is a bookkeeping-only overlay of a pool: it reads the base
lazily, keeps its own changes, and never touches the base. A fork is valid
only while its base is unchanged (checked on every access).

Every mutation can be journaled (``journal`` is a list or ``None``): the
journal is the pool's allocator-state diff for one KV op, which compare mode
checks instead of the whole free queue.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from batchgen.kv.page_grants import (
    Grants,
    PoolEvent,
    check_can_allocate,
    check_grants,
)


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
        self._version = 0
        self.journal: list[PoolEvent] | None = None

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
        self._version += 1
        flags = self._free_flags
        for page_id in all_ids:
            flags[page_id] = 0
        owned, journal = self._owned, self.journal
        for uuid, page_ids in grants:
            if page_ids:
                owned.setdefault(uuid, []).extend(page_ids)
                if journal is not None:
                    journal.append(PoolEvent("alloc", uuid, tuple(page_ids)))

    def release_pages(self, uuid: str) -> list[int]:
        """Return every page of ``uuid`` to the queue tail, in page-table order.

        Mutates the pool. Releasing an owner with no pages is a no-op.
        """
        page_ids = self._owned.pop(uuid, [])
        if not page_ids:
            return []
        self._version += 1
        self._queue.extend(page_ids)
        for page_id in page_ids:
            self._free_flags[page_id] = 1
        if self.journal is not None:
            self.journal.append(PoolEvent("release", uuid, tuple(page_ids)))
        return page_ids

    def fork(self) -> ForkedPagePool:
        """A bookkeeping-only overlay; valid while this pool is unchanged."""
        return ForkedPagePool(self)

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
        self._version += 1
        for page_id in page_ids:
            self._free_flags[page_id] = 0
        self._owned.setdefault(uuid, []).extend(page_ids)
        if self.journal is not None:
            self.journal.append(PoolEvent("alloc", uuid, tuple(page_ids)))

    def _compact(self) -> None:
        if self._head > 4096 and self._head * 2 > len(self._queue):
            del self._queue[: self._head]
            self._head = 0


class ForkedPagePool:
    """Overlay of a :class:`PagePool` for shadow runs and what-if planning.

    Reads the base's free queue and owners lazily; writes go to the overlay, so
    a fork costs what it touches, not the pool size. It always journals: its
    journal is the op's allocator diff.
    """

    def __init__(self, base: PagePool):
        self._base = base
        self._base_version = base._version
        self._num_free = base.num_free
        self.name = base.name
        self.num_pages = base.num_pages
        self._cursor = base._head  # first base-queue index not yet consumed by the fork
        self._taken: set[int] = set()  # base-free pages the fork handed out
        self._tail: list[int] = []  # pages released in the fork, FIFO
        self._released: set[str] = set()  # owners whose base pages the fork released
        # pages the fork gave each owner (after its release, if any)
        self._added: dict[str, list[int]] = {}
        self.journal: list[PoolEvent] = []

    @property
    def num_free(self) -> int:
        # _check_base, inlined: legacy alloc asks per request
        if self._base._version != self._base_version:
            self._check_base()
        return self._num_free

    def peek_free_pages(self, n: int) -> list[int]:
        check_can_allocate(self, n)
        out: list[int] = []
        queue, i = self._base._queue, self._cursor
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
            self.journal.append(PoolEvent("release", uuid, tuple(page_ids)))
        return page_ids

    def is_free(self, page_id: int) -> bool:
        self._check_base()
        return self._is_free(page_id)

    def _is_free(self, page_id: int) -> bool:
        in_base = 0 <= page_id < self.num_pages and self._base._free_flags[page_id]
        return (in_base and page_id not in self._taken) or page_id in self._tail

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
        queue = self._base._queue
        while self._cursor < len(queue) and queue[self._cursor] in self._taken:
            self._cursor += 1
        # what it touches: not the owner's whole page list
        self._added.setdefault(uuid, []).extend(page_ids)
        self.journal.append(PoolEvent("alloc", uuid, tuple(page_ids)))

    def _check_base(self) -> None:
        if self._base._version != self._base_version:
            raise RuntimeError(f"{self.name}: fork used after its base pool changed")
