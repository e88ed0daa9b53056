"""The two KV tiers: the backend Protocols and their torch page pools.

::

    GPU pool  [num_gpu_pages,  L, 2, kv_heads, page_size, head_dim]  on the device
    host pool [num_host_pages, L, 2, kv_heads, page_size, head_dim]  CPU, pinned with CUDA

    store: GPU pages of a request -> its host pages   (synchronous; eviction)
    load : its host pages -> GPU pages                 (async, on the pool's copy queue; migration)

A pool without a tensor is bookkeeping-only (null-model runs, compare mode's
forks): it issues no copy. What an op's copies are is ``HostKvPool.copy_op``'s
answer, the one the copies issued and compare mode's records share.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import NamedTuple, Protocol

import torch

from batchgen.kv.copy_runs import DEFAULT_SPLIT
from batchgen.kv.page_copy import AsyncCopyQueue, copy_pages
from batchgen.kv.page_grants import Grants, SharedGrants
from batchgen.kv.page_pool import PagePool
from batchgen.state import AsyncHandle


class GpuKvBackend(Protocol):
    def allocate_pages(self, uuid: str, n: int) -> list[int]: ...
    def release_pages(self, uuid: str) -> None: ...
    def free_pages(self) -> int: ...

    # reads, no mutation: what allocate_pages(_, n) would return; the free queue, head first
    def peek_free_pages(self, n: int) -> list[int]: ...
    def free_page_ids(self) -> Iterator[int]: ...


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


class KvPool:
    """Shared bookkeeping surface of both tiers, and of compare mode's recording wrapper of either
    (delegates to the allocator)."""

    def __init__(self, pages: PagePool, tensor: torch.Tensor | None):
        """``pages``: the allocator (a ``PagePool``, or compare mode's overlay of one)."""
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

    def grant_pages_for(self, grants: SharedGrants) -> None:
        """Give each owner its cached pages shared, then its new pages, all validated first
        (prefix hits: ``PagePool.grant_pages_for``). Mutates the pool."""
        self.pages.grant_pages_for(grants)

    def release_pages(self, uuid: str) -> None:
        """Drop ``uuid``'s hold on all its pages (those no one else holds join the free queue).
        Mutates the pool."""
        self.pages.release_pages(uuid)

    def release_first_pages(self, uuid: str, n: int) -> None:
        """Drop ``uuid``'s hold on the first ``n`` pages of its table. Mutates the pool."""
        self.pages.release_first_pages(uuid, n)

    def register(self, page_id: int, digest: str) -> bool:
        """Index held ``page_id`` under its prompt digest (``PagePool.register``). Mutates the
        pool."""
        return self.pages.register(page_id, digest)

    def free_pages(self) -> int:
        return self.pages.num_free

    def peek_free_pages(self, n: int) -> list[int]:
        """The ids the next allocation of ``n`` pages would get; no mutation."""
        return self.pages.peek_free_pages(n)

    def free_page_ids(self) -> Iterator[int]:
        return self.pages.free_page_ids()

    def cached_prefix(self, digests: Iterable[str]) -> list[int]:
        return self.pages.cached_prefix(digests)

    def holders(self, page_id: int) -> int:
        return self.pages.holders(page_id)

    def shared_pages(self) -> dict[int, int]:
        return self.pages.shared_pages()

    def digest_of(self, page_id: int) -> str | None:
        return self.pages.digest_of(page_id)

    def pages_of(self, uuid: str) -> tuple[int, ...]:
        return self.pages.pages_of(uuid)

    def check_integrity(self, live_uuids: Collection[str] | None = None) -> None:
        self.pages.check_integrity(live_uuids)


class GpuKvPool(KvPool):
    """GPU tier: satisfies :class:`GpuKvBackend`."""

    def __init__(
        self,
        num_pages: int,
        tensor: torch.Tensor | None = None,
        *,
        pages: PagePool | None = None,
    ):
        super().__init__(pages if pages is not None else PagePool("gpu", num_pages), tensor)


class HostKvPool(KvPool):
    """Host tier: satisfies :class:`HostKvBackend`; issues every copy between tiers."""

    def __init__(
        self,
        num_pages: int,
        tensor: torch.Tensor | None,
        gpu: GpuKvPool,
        *,
        pages: PagePool | None = None,
    ):
        super().__init__(pages if pages is not None else PagePool("host", num_pages), tensor)
        self.gpu = gpu
        # this pool's loads, in issue order
        self.copy_queue = AsyncCopyQueue() if tensor is not None else None
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

    def copy_op(self, kind: str, uuid: str, gpu_page_ids) -> CopyOp:
        """The copy a ``store`` (GPU -> host) or ``load`` (host -> GPU) between ``gpu_page_ids``
        and ``uuid``'s host pages is, in order; ValueError when their counts differ. Pure."""
        host_page_ids = self.pages_of(uuid)
        if len(host_page_ids) != len(gpu_page_ids):
            raise ValueError(
                f"{kind} {uuid}: {len(gpu_page_ids)} GPU pages but {len(host_page_ids)} host pages"
            )
        if kind == "store":
            return CopyOp(kind, uuid, tuple(gpu_page_ids), host_page_ids)
        return CopyOp(kind, uuid, host_page_ids, tuple(gpu_page_ids))

    def store_from_gpu(self, uuid: str, gpu_page_ids: list[int]) -> None:
        """Copy ``gpu_page_ids`` into ``uuid``'s host pages, in order (synchronous).

        Mutates host page contents; the caller allocated the host pages first.
        """
        op = self.copy_op("store", uuid, gpu_page_ids)
        if self.tensor is not None and self.gpu.tensor is not None:
            self._watch(op)
            started = time.perf_counter()
            copy_pages(
                self.gpu.tensor,
                gpu_page_ids,
                self.tensor,
                list(op.dst_page_ids),
                split=self.copy_split,
            )
            self._count_copy("gpu_to_host", len(gpu_page_ids), started)

    def load_to_gpu_async(self, uuid: str, page_ids: list[int]) -> AsyncHandle:
        """Start copying ``uuid``'s host pages into GPU ``page_ids``; returns its handle.

        Mutates GPU page contents when the copy runs.
        """
        op = self.copy_op("load", uuid, page_ids)
        if self.tensor is None or self.gpu.tensor is None:
            return CompletedHandle()
        self._watch(op)
        started = time.perf_counter()
        handle = self.copy_queue.copy_pages_async(
            self.tensor,
            list(op.src_page_ids),
            self.gpu.tensor,
            list(page_ids),
            split=self.copy_split,
        )
        self._count_copy("host_to_gpu", len(page_ids), started)
        return handle

    def _count_copy(self, direction: str, num_pages: int, started: float) -> None:
        self.pages_copied[direction] += num_pages
        self.copy_seconds[direction] += time.perf_counter() - started

    def _watch(self, op: CopyOp) -> None:
        if self.on_copy is not None:
            self.on_copy(op)
