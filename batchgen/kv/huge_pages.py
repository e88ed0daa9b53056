"""CPU page pools on the operating system's 2 MiB pages (Linux transparent huge pages).

A decode step reads every row's K/V blocks of a layer, scattered over the pool; on 4 KiB pages
nearly every block read is a TLB miss. Asking the kernel to back the pool with 2 MiB pages
(``madvise(MADV_HUGEPAGE)`` before the memory is first touched) took 9-11% off the CPU decode
kernel's time on the benchmark machine (``docs/benchmarks-engine.md``). Where the request cannot
be made (not Linux, huge pages off) the pool is ordinary memory and nothing else changes.
"""

from __future__ import annotations

import ctypes
import math
import sys

import torch
from torch import Tensor

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # <linux/mman.h>


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A zero-filled contiguous CPU tensor starting on a 2 MiB boundary, its whole 2 MiB pages
    advised as huge before they are first written. Allocates up to 2 MiB more than it returns."""
    num_bytes = math.prod(shape) * dtype.itemsize
    raw = torch.empty(num_bytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    memory = raw[start : start + num_bytes]
    advise_huge_pages(memory.data_ptr(), num_bytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    return memory.view(dtype).view(shape).zero_()


def advise_huge_pages(address: int, length: int) -> bool:
    """Ask Linux to back ``length`` bytes from ``address`` (2 MiB aligned) with huge pages; whether
    it accepted. Changes only how the memory is mapped."""
    if not sys.platform.startswith("linux") or length == 0:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(address, length, MADV_HUGEPAGE) == 0
