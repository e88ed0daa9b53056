"""What the page-content oracle (``batchgen.engine.kv_verify``) compares: digests of pages as they
must be against digests of pages as they are. Pure functions over tensors and page tables.

An append into a request's pages, positions ``[start, start + n)`` of page table ``table``::

    position p          -> page table[p // page_size], slot p % page_size
    pages touched       -> table[start // page_size] .. table[(start + n - 1) // page_size]
    expected            -> those pages as they were, with the pending K/V in exactly those slots

The slot arithmetic is written here on its own, not shared with ``model.paged_kv.write_kvs``, so
that a wrong slot or page in the write shows as a difference instead of being repeated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from batchgen.kv.page_digest import layer_digests, page_digests
from batchgen.model.paged_kv import page_size_of


@dataclass(frozen=True, slots=True)
class PageMismatch:
    """One page layer whose digest is not the one it must have."""

    position: int  # index of the page in the checked list
    layer: int
    expected: int
    found: int


@dataclass(frozen=True, slots=True)
class AppendCheck:
    """The pages a flush appends into, and their digests as they must be after it."""

    uuids: tuple[str, ...]  # owner of each page
    page_ids: Tensor  # [num_pages] int64, on the pool's device
    expected: Tensor  # [num_pages, num_layers] digests


def mismatches(expected: Tensor, found: Tensor) -> list[PageMismatch]:
    """Every (page, layer) where the digests differ, in page then layer order. Pure."""
    rows, layers = torch.nonzero(expected != found, as_tuple=True)
    return [
        PageMismatch(row, layer, int(expected[row, layer]), int(found[row, layer]))
        for row, layer in zip(rows.tolist(), layers.tolist())
    ]


def expected_appends(
    pool: Tensor, appends: Sequence[tuple[str, Sequence[int], int, Tensor]]
) -> AppendCheck:
    """The digests the pages of ``appends`` (uuid, page table, start position, K/V ``[num_layers,
    2, n, kv_heads, head_dim]``) must have once the K/V are written: the pages as they are now with
    each K/V in its slots. An append its page table does not cover is left out (the write refuses
    it). Pure read of ``pool``."""
    page_size = page_size_of(pool)
    covered = [a for a in appends if (a[2] + a[3].shape[2] - 1) // page_size < len(a[1])]
    starts = np.array([start for _, _, start, _ in covered], dtype=np.int64)
    lengths = np.array([kv.shape[2] for *_, kv in covered], dtype=np.int64)
    firsts, lasts = starts // page_size, (starts + lengths - 1) // page_size
    page_offsets = np.concatenate([[0], np.cumsum(lasts - firsts + 1)[:-1]]).astype(np.int64)
    uuids, page_ids = [], []
    for (uuid, table, _, _), first, last in zip(covered, firsts.tolist(), lasts.tolist()):
        page_ids += table[first : last + 1]
        uuids += [uuid] * (last - first + 1)
    # each appended position, its append's start repeated plus its place in the append
    row_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    positions = np.repeat(starts - row_starts, lengths) + np.arange(int(lengths.sum()))
    local_pages = positions // page_size + np.repeat(page_offsets - firsts, lengths)
    new_kvs = [kv for *_, kv in covered]
    index = torch.as_tensor(page_ids, dtype=torch.int64, device=pool.device)
    pages = pool.index_select(0, index)
    if not new_kvs:
        return AppendCheck((), index, layer_digests(pages))
    new_kv = torch.cat(new_kvs, dim=2).permute(2, 0, 1, 3, 4)
    local = torch.as_tensor(local_pages, device=pool.device)
    slot = torch.as_tensor(positions % page_size, device=pool.device)
    pages[local, :, :, :, slot] = new_kv.to(device=pool.device, dtype=pool.dtype)
    return AppendCheck(tuple(uuids), index, layer_digests(pages))


def append_mismatches(pool: Tensor, check: AppendCheck) -> list[PageMismatch]:
    """The page layers of ``check`` the pool does not hold as they must be. Pure read."""
    return mismatches(check.expected, page_digests(pool, check.page_ids))
