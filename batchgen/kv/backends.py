"""The two KV tiers: the backend Protocols and their torch page pools.

::

    GPU pool  [num_gpu_pages,  L, 2, kv_heads, page_size, head_dim]  on the device
    host pool [num_host_pages, L, 2, kv_heads, page_size, head_dim]  CPU, pinned with CUDA

    store: GPU pages of a request -> its host pages   (synchronous; eviction)
    load : its host pages -> GPU pages                 (async, on the pool's copy queue; migration)

A pool without a tensor is bookkeeping-only (null-model runs, forks). A forked
host pool records the copies it would issue instead of issuing them; the real
host pool records the copies it issues while its ``copies`` is a list (compare
mode sets one for the duration of an op), so the ordered copy operations of one
op can be checked.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import NamedTuple, Protocol

import torch

from batchgen.kv.copy_runs import DEFAULT_SPLIT
from batchgen.kv.page_copy import AsyncCopyQueue, copy_pages
from batchgen.kv.page_grants import Grants, PoolEvent
from batchgen.kv.page_pool import ForkedPagePool, PagePool


class AsyncHandle(Protocol):
    def done(self) -> bool: ...
    def wait(self) -> None: ...  # raises when the copy failed


class GpuKvBackend(Protocol):
    def allocate_pages(self, uuid: str, n: int) -> list[int]: ...
    def release_pages(self, uuid: str) -> None: ...
    def free_pages(self) -> int: ...

    # what allocate_pages(_, n) would return; no mutation
    def peek_free_pages(self, n: int) -> list[int]: ...


class HostKvBackend(Protocol):
    def allocate_pages(self, uuid: str, n: int) -> list[int]: ...
    def load_to_gpu_async(self, uuid: str, page_ids: list[int]) -> AsyncHandle: ...

    # what allocate_pages(_, n) would return; no mutation
    def peek_free_pages(self, n: int) -> list[int]: ...


class CopyOp(NamedTuple):
    """One batched page copy: ``kind`` is ``store`` (GPU->host) or ``load`` (a NamedTuple, like
    PoolEvent)."""

    kind: str
    uuid: str
    src_page_ids: tuple[int, ...]
    dst_page_ids: tuple[int, ...]


class CompletedHandle:
    """Handle of a copy that needed no work (bookkeeping-only pools)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class _KvPool:
    """Shared bookkeeping surface of both tiers (delegates to the allocator)."""

    def __init__(self, pages: PagePool | ForkedPagePool, tensor: torch.Tensor | None):
        self.pages = pages
        self.tensor = tensor

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages

    def allocate_pages(self, uuid: str, n: int) -> list[int]:
        """Take ``n`` pages from the free-queue head for ``uuid``. Mutates the pool."""
        return self.pages.allocate_pages(uuid, n)

    def take_pages(self, uuid: str, page_ids: list[int]) -> None:
        """Give ``uuid`` exactly ``page_ids``. Mutates the pool."""
        self.pages.take_pages(uuid, page_ids)

    def take_pages_for(self, grants: Grants) -> None:
        """Give each owner exactly its page ids, all validated first (plan application). Mutates the
        pool."""
        self.pages.take_pages_for(grants)

    def release_pages(self, uuid: str) -> None:
        """Return all of ``uuid``'s pages to the free queue. Mutates the pool."""
        self.pages.release_pages(uuid)

    def free_pages(self) -> int:
        return self.pages.num_free

    def peek_free_pages(self, n: int) -> list[int]:
        """The ids the next allocation of ``n`` pages would get; no mutation."""
        return self.pages.peek_free_pages(n)

    def pages_of(self, uuid: str) -> tuple[int, ...]:
        return self.pages.pages_of(uuid)

    def check_integrity(self, live_uuids: Collection[str] | None = None) -> None:
        self.pages.check_integrity(live_uuids)

    @property
    def is_fork(self) -> bool:
        return isinstance(self.pages, ForkedPagePool)

    @property
    def journal(self) -> list[PoolEvent] | None:
        return self.pages.journal


class GpuKvPool(_KvPool):
    """GPU tier: satisfies :class:`GpuKvBackend`."""

    def __init__(
        self,
        num_pages: int,
        tensor: torch.Tensor | None = None,
        *,
        pages: PagePool | ForkedPagePool | None = None,
    ):
        super().__init__(pages if pages is not None else PagePool("gpu", num_pages), tensor)

    def fork(self) -> GpuKvPool:
        """Bookkeeping-only overlay (no tensor); valid while this pool is unchanged."""
        return GpuKvPool(self.num_pages, None, pages=self.pages.fork())


class HostKvPool(_KvPool):
    """Host tier: satisfies :class:`HostKvBackend`; issues every copy between tiers."""

    def __init__(
        self,
        num_pages: int,
        tensor: torch.Tensor | None,
        gpu: GpuKvPool,
        *,
        pages: PagePool | ForkedPagePool | None = None,
    ):
        super().__init__(pages if pages is not None else PagePool("host", num_pages), tensor)
        self.gpu = gpu
        # this pool's loads, in issue order
        self.copy_queue = AsyncCopyQueue() if tensor is not None else None
        self.copies: list[CopyOp] | None = [] if self.is_fork else None
        # While copies are recorded: id of each load handle this pool returned -> (the request its
        # load is for, the handle: held, so that its id is not reused by another object while the op
        # is compared).
        self.load_handles: dict[int, tuple[str, AsyncHandle]] | None = {} if self.is_fork else None
        # called with each copy this pool issues between tensors, before it runs (the page-content
        # oracle, ``batchgen.engine.kv_verify``); None: nobody watches
        self.on_copy: Callable[[CopyOp], None] | None = None
        # when copy threads share a store or load batch (validation lowers the size)
        self.copy_split = DEFAULT_SPLIT
        # pages copied between the tensors, and the seconds the calls issuing them took, by
        # direction (batchgen.metrics' kv_offload_*): a store's call runs the whole copy, a load's
        # call only starts it
        self.pages_copied = {"gpu_to_host": 0, "host_to_gpu": 0}
        self.copy_seconds = {"gpu_to_host": 0.0, "host_to_gpu": 0.0}

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (all layers, K and V); 0 without a tensor. Pure."""
        return 0 if self.tensor is None else self.tensor[0].numel() * self.tensor.element_size()

    def record_copies(self, on: bool) -> None:
        """Start (fresh lists) or stop recording the copies issued and the load handles returned.
        Mutates both."""
        self.copies, self.load_handles = ([], {}) if on else (None, None)

    def store_from_gpu(self, uuid: str, gpu_page_ids: list[int]) -> None:
        """Copy ``gpu_page_ids`` into ``uuid``'s host pages, in order (synchronous).

        Mutates host page contents; the caller allocated the host pages first.
        """
        host_page_ids = list(self.pages_of(uuid))
        if len(host_page_ids) != len(gpu_page_ids):
            raise ValueError(
                f"store {uuid}: {len(gpu_page_ids)} GPU pages but {len(host_page_ids)} host pages"
            )
        op = CopyOp("store", uuid, tuple(gpu_page_ids), tuple(host_page_ids))
        self._record(op)
        if self.tensor is not None and self.gpu.tensor is not None:
            self._watch(op)
            started = time.perf_counter()
            copy_pages(
                self.gpu.tensor,
                gpu_page_ids,
                self.tensor,
                host_page_ids,
                split=self.copy_split,
            )
            self._count_copy("gpu_to_host", len(gpu_page_ids), started)

    def load_to_gpu_async(self, uuid: str, page_ids: list[int]) -> AsyncHandle:
        """Start copying ``uuid``'s host pages into GPU ``page_ids``; returns its handle.

        Mutates GPU page contents when the copy runs.
        """
        host_page_ids = list(self.pages_of(uuid))
        if len(host_page_ids) != len(page_ids):
            raise ValueError(
                f"load {uuid}: {len(page_ids)} GPU pages but {len(host_page_ids)} host pages"
            )
        op = CopyOp("load", uuid, tuple(host_page_ids), tuple(page_ids))
        self._record(op)
        if self.tensor is None or self.gpu.tensor is None:
            return self._issued(CompletedHandle())
        self._watch(op)
        started = time.perf_counter()
        handle = self.copy_queue.copy_pages_async(
            self.tensor,
            host_page_ids,
            self.gpu.tensor,
            list(page_ids),
            split=self.copy_split,
        )
        self._count_copy("host_to_gpu", len(page_ids), started)
        return self._issued(handle)

    def fork(self, gpu_fork: GpuKvPool) -> HostKvPool:
        """Bookkeeping-only overlay bound to ``gpu_fork``; records copies, issues none."""
        return HostKvPool(self.num_pages, None, gpu_fork, pages=self.pages.fork())

    def _count_copy(self, direction: str, num_pages: int, started: float) -> None:
        self.pages_copied[direction] += num_pages
        self.copy_seconds[direction] += time.perf_counter() - started

    def _record(self, op: CopyOp) -> None:
        if self.copies is not None:
            self.copies.append(op)

    def _watch(self, op: CopyOp) -> None:
        if self.on_copy is not None:
            self.on_copy(op)

    def _issued(self, handle: AsyncHandle) -> AsyncHandle:
        """``handle``, noted (while copies are recorded) as the handle of the load recorded last."""
        if self.load_handles is not None:
            self.load_handles[id(handle)] = (self.copies[-1].uuid, handle)
        return handle
