"""Page copies between KV pools: synchronous and asynchronous, CPU and CUDA.

Each tier's KV lives in one tensor, page outermost, so one page of all layers is
one contiguous chunk and a run of consecutive page ids is one contiguous slice::

    pool[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]
         ^ page id  '------------- one page: contiguous -------------'

How a batch is cut into runs and issued is ``copy_runs``' job.

Async copies go through an :class:`AsyncCopyQueue`, which its owner (each host
KV pool has one) holds: it lazily starts one worker thread (CPU copies) and one
side stream per CUDA device (CUDA copies), so the async copies issued to one
queue from one thread run in issue order. Nothing here is process-wide.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from batchgen.kv.copy_runs import DEFAULT_SPLIT, CopySplit, cuda_device, issue_copies
from batchgen.kv.huge_pages import zeros_on_huge_pages


def new_page_tensor(
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
) -> Tensor:
    """A zero-filled pool of pages; ``pin_memory`` (CPU only, needs CUDA) makes DMA async. An
    unpinned CPU pool lies on huge pages where the system allows (``huge_pages``)."""
    if torch.device(device).type == "cpu" and not pin_memory:
        return zeros_on_huge_pages(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)


def copy_pages(
    src: Tensor,
    src_ids: Sequence[int],
    dst: Tensor,
    dst_ids: Sequence[int],
    *,
    split: CopySplit = DEFAULT_SPLIT,
) -> None:
    """Set ``dst[dst_ids[i]] = src[src_ids[i]]`` for every i; mutates ``dst`` only.

    Returns once the copy is complete (in stream order for GPU -> GPU, like any
    torch op; host <-> device copies synchronise the current stream).
    ``split``: when copy threads share a host-to-host batch.
    Raises ValueError for mismatched pools or ids, naming the offending id.
    """
    issue_copies(src, src_ids, dst, dst_ids, split=split)
    if src.device != dst.device:
        torch.cuda.current_stream(cuda_device(src, dst)).synchronize()


class CopyError(RuntimeError):
    """An async page copy failed; ``cause`` is the exception that stopped it."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"async page copy failed: {cause!r}")
        self.cause = cause


class CopyHandle:
    """Completion of one ``copy_pages_async`` call; does not touch the pools.

    Backed by a future (CPU copies, and copies that failed while being issued)
    or by a CUDA event recorded on the side stream after the copy.
    """

    __slots__ = ("_completion", "_cuda_error")

    def __init__(self, completion: Future[None] | torch.cuda.Event) -> None:
        self._completion = completion
        self._cuda_error: BaseException | None = None

    def done(self) -> bool:
        """True once the copy has finished, successfully or not; never blocks."""
        if isinstance(self._completion, Future):
            return self._completion.done()
        return self._cuda_event_done()

    def wait(self) -> None:
        """Block until the copy has finished; raise CopyError if it failed."""
        if isinstance(self._completion, Future):
            cause = self._completion.exception()
        else:
            cause = self._cuda_event_wait()
        if cause is not None:
            raise CopyError(cause) from cause

    def _cuda_event_done(self) -> bool:
        """``done`` for a CUDA event; a failed query is kept in ``_cuda_error`` (mutated)."""
        if self._cuda_error is None:
            try:
                return self._completion.query()
            except RuntimeError as error:
                self._cuda_error = error
        return True

    def _cuda_event_wait(self) -> BaseException | None:
        """Synchronize on the CUDA event; returns why the copy failed (kept in ``_cuda_error``,
        mutated), None when it succeeded."""
        if self._cuda_error is None:
            try:
                self._completion.synchronize()
            except RuntimeError as error:
                self._cuda_error = error
        return self._cuda_error

    @property
    def error(self) -> BaseException | None:
        """Why the copy failed; None while it runs and after it succeeded."""
        if isinstance(self._completion, Future):
            return self._completion.exception() if self._completion.done() else None
        return self._cuda_error


class AsyncCopyQueue:
    """Where one owner's async copies run: one worker thread (CPU), one side stream per CUDA device.

    Both are created on first use. The thread ends once the queue is garbage (its executor's own
    rule)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._side_streams: dict[int, torch.cuda.Stream] = {}

    def copy_pages_async(
        self,
        src: Tensor,
        src_ids: Sequence[int],
        dst: Tensor,
        dst_ids: Sequence[int],
        *,
        split: CopySplit = DEFAULT_SPLIT,
    ) -> CopyHandle:
        """Start ``copy_pages`` behind every copy issued to this queue before it, and return its
        handle.

        Mutates ``dst`` once the copy runs. Until ``done()``, the caller must not
        write the ``src`` pages nor read or write the ``dst`` pages. Copy failures,
        invalid ids included, surface as CopyError from ``wait()``, not here.
        """
        if src.is_cuda or dst.is_cuda:
            return self.issue_on_side_stream(src, src_ids, dst, dst_ids)
        copy = functools.partial(copy_pages, split=split)
        return CopyHandle(self.submit(copy, src, tuple(src_ids), dst, tuple(dst_ids)))

    def submit(self, copy: Callable[..., None], *args: object) -> Future[None]:
        """Run ``copy(*args)`` on the worker thread, after every copy submitted before it."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="page-copy")
        return self._executor.submit(copy, *args)

    def issue_on_side_stream(
        self, src: Tensor, src_ids: Sequence[int], dst: Tensor, dst_ids: Sequence[int]
    ) -> CopyHandle:
        """Enqueue the copy behind the current stream's work; mutates ``dst`` on the GPU
        timeline."""
        try:
            device = cuda_device(src, dst)
            side_stream = self._side_stream(device)
            side_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side_stream):
                issue_copies(src, src_ids, dst, dst_ids)
                finished = torch.cuda.Event()
                finished.record(side_stream)
            for pool in (src, dst):
                if pool.is_cuda:  # keep the caching allocator off pool memory until the copy ran
                    pool.record_stream(side_stream)
        except Exception as error:
            failed: Future[None] = Future()
            failed.set_exception(error)
            return CopyHandle(failed)
        return CopyHandle(finished)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The device's side stream: taken from torch's pool once, then kept for every async
        copy."""
        with self._lock:
            if device.index not in self._side_streams:
                self._side_streams[device.index] = torch.cuda.Stream(device)
            return self._side_streams[device.index]
