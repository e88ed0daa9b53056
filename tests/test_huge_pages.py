"""CPU KV pools lie on 2 MiB pages where Linux offers them (transparent huge pages)."""

import mmap
import sys
from pathlib import Path

import pytest
import torch

from batchgen.kv.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages, zeros_on_huge_pages
from batchgen.kv.page_copy import new_page_tensor

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapped_bytes_at(address: int, field: str = "AnonHugePages:") -> int:
    """Bytes of the mapping holding ``address`` that ``field`` of ``/proc/self/smaps`` counts (by
    default those on huge pages; ``Rss:``, those in memory)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:
            low, high = (int(bound, 16) for bound in first.split("-"))
            inside = low <= address < high
        elif inside and first == field:
            return int(line.split()[1]) * 1024
    return 0


def test_a_pool_on_huge_pages_is_zeroed_contiguous_and_starts_on_a_huge_page():
    pool = zeros_on_huge_pages((3, 2, 2, 1, 4, 8), torch.bfloat16)
    assert pool.shape == (3, 2, 2, 1, 4, 8) and pool.dtype == torch.bfloat16
    assert pool.is_contiguous() and not pool.any()
    assert pool.data_ptr() % HUGE_PAGE_BYTES == 0


def test_a_cpu_pool_of_the_worker_starts_on_a_huge_page():
    pool = new_page_tensor((4, HUGE_PAGE_BYTES // 4), dtype=torch.float32, device="cpu")
    assert pool.data_ptr() % HUGE_PAGE_BYTES == 0 and not pool.any()


@pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_linux_accepts_the_request():
    mapping = mmap.mmap(-1, 2 * HUGE_PAGE_BYTES)
    assert advise_huge_pages(mapping, 0, HUGE_PAGE_BYTES)


@pytest.mark.skipif(
    not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
    reason="this system offers no transparent huge pages",
)
def test_the_pool_is_backed_by_huge_pages_once_written():
    # heap memory another tensor touched and freed first, as a worker's earlier pools leave it
    torch.ones(8, HUGE_PAGE_BYTES // 4)  # made and freed at once
    pool = zeros_on_huge_pages((8, HUGE_PAGE_BYTES // 4), torch.float32)
    pool.fill_(1.0)
    assert mapped_bytes_at(pool.data_ptr()) >= 7 * HUGE_PAGE_BYTES


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/smaps is Linux's")
def test_a_fresh_pool_takes_no_memory_until_its_pages_are_written():
    pool = zeros_on_huge_pages((64, HUGE_PAGE_BYTES // 4), torch.float32)  # 128 MiB
    assert mapped_bytes_at(pool.data_ptr(), "Rss:") == 0
    pool[3].fill_(2.0)
    assert mapped_bytes_at(pool.data_ptr(), "Rss:") <= 2 * HUGE_PAGE_BYTES
    assert int(pool.count_nonzero()) == HUGE_PAGE_BYTES // 4


def test_a_mapping_the_system_refuses_is_a_memory_error(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(MemoryError, match="cannot map 64 bytes"):
        zeros_on_huge_pages((16,), torch.float32)
