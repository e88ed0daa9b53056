"""``keep_freed_memory``: on glibc a large block comes from the heap and stays with the process
once freed; by glibc's defaults it is mapped and unmapped. Each case runs in its own interpreter,
as the settings are the process's."""

import subprocess
import sys

import pytest

# allocates and frees 20 MiB through the C library, then prints where the block was and what
# the heap kept: glibc's mallinfo2 (2.33 and later), "mapped", "heap", "kept after free"
PROBE = """
import ctypes, sys
from batchgen.engine.host_malloc import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
block = libc.malloc(20 << 20)
during = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
print(applied, during.hblkhd >= 20 << 20, during.arena >= 20 << 20, after.arena >= 20 << 20)
"""


def probe(mode: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    ).stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is Linux's")
def test_glibc_maps_a_large_block_by_default_and_unmaps_it_when_freed():
    assert probe("default") == ["None", "True", "False", "False"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is Linux's")
def test_kept_a_large_block_comes_from_the_heap_and_stays_after_free():
    assert probe("keep") == ["True", "False", "True", "True"]
