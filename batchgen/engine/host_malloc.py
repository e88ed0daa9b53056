"""glibc's malloc told to keep the memory a process frees, as an inference engine wants it.

A forward on a CPU allocates its activations afresh each step (several MiB at a prefill, a few
hundred KiB at a decode). glibc serves a large block with ``mmap`` and hands the top of its heap
back to the system once more than ``M_TRIM_THRESHOLD`` of it is free, so a steady run keeps
faulting the same pages in again: 8-19 thousand page faults in each run of the 256 x 4 static
mix of ``scripts/bench.py vllm``, 1-2 thousand after ``keep_freed_memory``, and 54 thousand
against 0.2-4 at 512 x 8 (``docs/benchmarks-engine.md``). vLLM's CPU backend preloads tcmalloc
to cut the same cost; these settings do it inside the process, with nothing to preload.

The settings are the process's: every later allocation of any library keeps what it frees, and
the process's resident memory stays at its peak. ``batchgen``'s command line and ``LLM`` apply
them; a program that embeds the engine otherwise may call ``keep_freed_memory`` itself.
"""

from __future__ import annotations

import ctypes

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
# glibc's largest mmap threshold on a 64-bit system: blocks this large or larger are still mapped
MMAP_THRESHOLD = 32 * 1024 * 1024
# freed memory at the heap's top is never handed back below this (mallopt takes a C int)
TRIM_THRESHOLD = 2**31 - 1
# each growth of the heap asks for this much more, so that a step's activations fit the next
TOP_PAD = 64 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse (see the module's docstring); True if
    it took every setting, False where the C library is not glibc (the settings are then left as
    they were). Mutates the process's malloc settings."""
    libc = ctypes.CDLL(None)  # the C library this process runs on
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    settings = {
        M_MMAP_THRESHOLD: MMAP_THRESHOLD,
        M_TRIM_THRESHOLD: TRIM_THRESHOLD,
        M_TOP_PAD: TOP_PAD,
    }
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings.items())
