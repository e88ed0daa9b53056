"""How one batch of page copies is cut into runs and issued (``page_copy.copy_pages`` and its
async queue call ``issue_copies``).

How a batch moves between two host pools: the pairs ``src_ids[i] -> dst_ids[i]``
are sorted by destination and merged into runs consecutive on both sides; each run
is one memcpy of a slice (numpy's, which releases the GIL), and a batch of
``CPU_PARALLEL_MIN_BYTES`` or more is cut into ``torch.get_num_threads()`` equal
shares copied by as many threads. One thread copies at about half the machine's
memory bandwidth, so even shuffled pages, one memcpy each, copy near the speed of
one contiguous copy.

With a GPU involved, the pairs are sorted by the ids of the *keyed* side, the host
pool (a DMA needs a contiguous host slice), and cut into runs of consecutive keyed
ids, each one call:

    run                                  | call
    -------------------------------------|-------------------------------------------
    both sides' ids consecutive          | dst_slice.copy_(src_slice): a DMA
    dst consecutive, src scattered       | index_select(src) -> dst_slice: gather
    src consecutive, dst scattered       | dst.index_copy_(src_slice): scatter

Gathers and scatters run on the GPU through a staging tensor, the DMA moves the
contiguous host slice, and runs are cut at ``MAX_RUN_BYTES`` so staging stays
bounded. Two pools on the same CUDA device skip runs: one gather and one scatter
kernel per chunk of that size. Fresh pools hand out consecutive ids, so a batch
is usually a handful of runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from batchgen.kv.copy_checks import checked_copy_ids

# Largest run (bytes) one call moves when a GPU is involved; bounds GPU staging.
MAX_RUN_BYTES = 64 * 2**20
# Host-to-host batches smaller than this are copied by the calling thread alone: starting threads
# costs more than they save.
CPU_PARALLEL_MIN_BYTES = 4 * 2**20


@dataclass(frozen=True, slots=True)
class CopySplit:
    """When a host-to-host batch is shared by copy threads, and by how many (validation lowers
    the size, so that its small pools split too)."""

    min_bytes: int = CPU_PARALLEL_MIN_BYTES
    num_threads: int | None = None  # None: torch.get_num_threads()

    def threads_for(self, num_bytes: int) -> int:
        """Threads a batch of ``num_bytes`` is copied on: one below ``min_bytes``. Pure."""
        if num_bytes < self.min_bytes:
            return 1
        return self.num_threads or torch.get_num_threads()


DEFAULT_SPLIT = CopySplit()


class _Run(NamedTuple):
    """Pairs ``start..stop-1`` of the sorted ids; the keyed side's ids are consecutive.

    ``src_start`` / ``dst_start`` are the first ids; the others sit in the sorted
    id tensors that come with the runs.
    """

    start: int
    stop: int
    src_start: int
    dst_start: int
    src_is_consecutive: bool
    dst_is_consecutive: bool

    @property
    def num_pages(self) -> int:
        return self.stop - self.start


def issue_copies(
    src: Tensor,
    src_ids: Sequence[int],
    dst: Tensor,
    dst_ids: Sequence[int],
    *,
    split: CopySplit = DEFAULT_SPLIT,
) -> None:
    """Validate (``copy_checks``), then enqueue every copy on the current stream (CPU: run them);
    mutates ``dst``. ``split``: when copy threads share a host-to-host batch."""
    src_index, dst_index = checked_copy_ids(src, src_ids, dst, dst_ids)
    if not len(src_index):
        return
    if src.is_cuda and dst.is_cuda:
        _copy_within_device(src, torch.from_numpy(src_index), dst, torch.from_numpy(dst_index))
    elif src.is_cuda or dst.is_cuda:
        runs = _runs(
            src_index, dst_index, key_is_dst=src.is_cuda, max_run_pages=_max_run_pages(src)
        )
        _copy_runs(src, dst, *runs)
    else:
        _copy_on_host(src, src_index, dst, dst_index, split)


def _copy_on_host(
    src: Tensor,
    src_index: np.ndarray,
    dst: Tensor,
    dst_index: np.ndarray,
    split: CopySplit,
) -> None:
    """Copy host pages by runs (see the module's docstring), on several threads for a large batch;
    mutates ``dst``."""
    src_starts, dst_starts, lengths = pair_runs(src_index, dst_index)
    src_pages, dst_pages = _page_bytes(src), _page_bytes(dst)
    num_threads = split.threads_for(len(src_index) * src_pages.shape[1])
    shares = _split_runs(src_starts, dst_starts, lengths, num_threads)

    def copy(share: list[tuple[int, int, int]]) -> None:
        for src_start, dst_start, length in share:
            dst_pages[dst_start : dst_start + length] = src_pages[src_start : src_start + length]

    if len(shares) == 1:
        copy(shares[0])
        return
    with ThreadPoolExecutor(len(shares) - 1, thread_name_prefix="page-copy-share") as helpers:
        helper_copies = [helpers.submit(copy, share) for share in shares[1:]]
        copy(shares[0])
        for helper_copy in helper_copies:
            helper_copy.result()


def _page_bytes(pool: Tensor) -> np.ndarray:
    """The pool as a ``[num_pages, page_bytes]`` uint8 array sharing its memory."""
    return pool.view(len(pool), -1).view(torch.uint8).numpy()


def pair_runs(
    src_index: np.ndarray, dst_index: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First src id, first dst id and length of each run of pairs consecutive on both sides, the
    pairs sorted by destination. Pure."""
    order = np.argsort(dst_index, kind="stable")
    src_ids, dst_ids = src_index[order], dst_index[order]
    is_run_start = np.ones(len(src_ids), dtype=bool)
    is_run_start[1:] = (src_ids[1:] != src_ids[:-1] + 1) | (dst_ids[1:] != dst_ids[:-1] + 1)
    starts = np.flatnonzero(is_run_start)
    return src_ids[starts], dst_ids[starts], np.diff(np.append(starts, len(src_ids)))


def _split_runs(
    src_starts: np.ndarray, dst_starts: np.ndarray, lengths: np.ndarray, num_shares: int
) -> list[list[tuple[int, int, int]]]:
    """The runs cut into ``num_shares`` lists of ``(src_start, dst_start, length)`` holding equal
    numbers of pages (within one), a run split where a share ends. Pure."""
    total = int(lengths.sum())
    share_ends = [total * (i + 1) // num_shares for i in range(num_shares)]
    shares: list[list[tuple[int, int, int]]] = [[] for _ in range(num_shares)]
    share, done = 0, 0  # done: pages given to shares so far
    for src_start, dst_start, length in zip(
        src_starts.tolist(), dst_starts.tolist(), lengths.tolist()
    ):
        while length:
            while done == share_ends[share]:
                share += 1
            taken = min(length, share_ends[share] - done)
            shares[share].append((src_start, dst_start, taken))
            src_start, dst_start, length, done = (
                src_start + taken,
                dst_start + taken,
                length - taken,
                done + taken,
            )
    return shares


def _copy_within_device(src: Tensor, src_index: Tensor, dst: Tensor, dst_index: Tensor) -> None:
    """One gather and one scatter kernel per chunk of pairs; mutates ``dst``."""
    src_index, dst_index = _on_device(src_index, src.device), _on_device(dst_index, dst.device)
    max_chunk_pages = _max_run_pages(src)
    for start in range(0, len(src_index), max_chunk_pages):
        chunk = slice(start, start + max_chunk_pages)
        dst.index_copy_(0, dst_index[chunk], src.index_select(0, src_index[chunk]))


def _copy_runs(
    src: Tensor, dst: Tensor, runs: list[_Run], sorted_src_index: Tensor, sorted_dst_index: Tensor
) -> None:
    """One call per run between host and device (see the module's table); mutates ``dst``."""
    # only gathers/scatters read them
    if not all(run.src_is_consecutive and run.dst_is_consecutive for run in runs):
        sorted_src_index = _on_device(sorted_src_index, src.device)
        sorted_dst_index = _on_device(sorted_dst_index, dst.device)
    for run in runs:
        src_slice = src[run.src_start : run.src_start + run.num_pages]
        dst_slice = dst[run.dst_start : run.dst_start + run.num_pages]
        if run.src_is_consecutive and run.dst_is_consecutive:
            dst_slice.copy_(src_slice, non_blocking=True)
        elif run.dst_is_consecutive:  # gather on the GPU into staging, then one DMA
            dst_slice.copy_(
                src.index_select(0, sorted_src_index[run.start : run.stop]), non_blocking=True
            )
        else:
            dst.index_copy_(
                0,
                sorted_dst_index[run.start : run.stop],
                src_slice.to(dst.device, non_blocking=True),
            )


def _runs(
    src_index: np.ndarray, dst_index: np.ndarray, *, key_is_dst: bool, max_run_pages: int
) -> tuple[list[_Run], Tensor, Tensor]:
    """Sort the pairs by the keyed side's ids and cut them where those stop being consecutive.

    Runs are also cut at ``max_run_pages``. Returns the runs and the src and dst
    ids in sorted order. Mutates nothing. In numpy, not torch: it runs on the host before
    every copy is issued, where each torch op on a small index pays a dispatch.
    """
    order = np.argsort(dst_index if key_is_dst else src_index, kind="stable")
    src_ids, dst_ids = src_index[order], dst_index[order]
    key_ids = dst_ids if key_is_dst else src_ids
    positions = np.arange(len(key_ids))
    is_run_start = np.ones(len(key_ids), dtype=bool)
    is_run_start[1:] = key_ids[1:] != key_ids[:-1] + 1
    first_of_consecutive = np.maximum.accumulate(np.where(is_run_start, positions, 0))
    is_run_start |= (positions - first_of_consecutive) % max_run_pages == 0
    starts = np.flatnonzero(is_run_start)
    stops = np.append(starts[1:], len(key_ids))
    runs = list(
        map(
            _Run,
            starts.tolist(),
            stops.tolist(),
            src_ids[starts].tolist(),
            dst_ids[starts].tolist(),
            _is_consecutive_between(src_ids, starts, stops).tolist(),
            _is_consecutive_between(dst_ids, starts, stops).tolist(),
        )
    )
    return runs, torch.from_numpy(src_ids), torch.from_numpy(dst_ids)


def _is_consecutive_between(
    page_ids: np.ndarray, starts: np.ndarray, stops: np.ndarray
) -> np.ndarray:
    """Per run, whether ``page_ids[start:stop]`` counts up by one."""
    breaks = np.zeros(len(page_ids), dtype=np.int64)
    breaks[1:] = page_ids[1:] != page_ids[:-1] + 1
    breaks_so_far = np.cumsum(breaks)
    return breaks_so_far[stops - 1] == breaks_so_far[starts]


def _max_run_pages(pool: Tensor) -> int:
    """Pages in a run (or chunk) of at most MAX_RUN_BYTES, and at least one page."""
    return max(1, MAX_RUN_BYTES // (pool[0].numel() * pool.element_size()))


def _on_device(index: Tensor, device: torch.device) -> Tensor:
    """``index`` on ``device``; CUDA goes through pinned memory so issuing never blocks."""
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index


def cuda_device(src: Tensor, dst: Tensor) -> torch.device:
    return src.device if src.is_cuda else dst.device
