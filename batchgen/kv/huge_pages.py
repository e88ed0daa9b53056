"""CPU page pools on the operating system's 2 MiB pages (Linux transparent huge pages).

A decode step reads every row's K/V blocks of a layer, scattered over the pool; on 4 KiB pages
nearly every block read is a TLB miss. Asking the kernel to back the pool with 2 MiB pages
(``madvise(MADV_HUGEPAGE)`` before the memory is first touched) took 9-11% off the CPU decode
kernel's time on the benchmark machine (``docs/benchmarks-engine.md``). The pool gets a fresh
anonymous mapping of its own: memory from torch's allocator may be heap memory already touched
on 4 KiB pages, which the request does not turn into huge ones. Where the request cannot be made
(not Linux, huge pages off) the pool is ordinary memory and nothing else changes.
"""

from __future__ import annotations

import math
import mmap

import torch
from torch import Tensor

HUGE_PAGE_BYTES = 2 << 20
# private: a shared anonymous mapping is shmem, whose huge pages a separate setting governs (and
# usually refuses)
PRIVATE_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A contiguous CPU tensor of zeros on a fresh mapping of its own, starting on a 2 MiB
    boundary, its whole 2 MiB pages advised as huge. Nothing is written: a fresh anonymous
    mapping reads as zeros already, and its memory is committed page by page as it is first
    touched (a pool sized for many contexts costs only what the job fills). Maps up to 2 MiB more
    than it returns; MemoryError when the system refuses the mapping."""
    num_bytes = math.prod(shape) * dtype.itemsize
    try:
        mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=PRIVATE_ANONYMOUS)
    except OSError as error:
        raise MemoryError(f"cannot map {num_bytes} bytes: {error}") from None
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    advise_huge_pages(mapping, start, num_bytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    return raw[start : start + num_bytes].view(dtype).view(shape)


def advise_huge_pages(mapping: mmap.mmap, start: int, length: int) -> bool:
    """Ask the system to back ``length`` bytes of ``mapping`` from offset ``start`` (both
    multiples of the page size) with huge pages; whether it accepted. Changes only how the memory
    is mapped."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or length == 0:
        return False
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, length)
    except OSError:
        return False
    return True
